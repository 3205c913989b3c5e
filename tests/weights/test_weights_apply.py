"""Copying named tensors into a live (tiny, tied-embedding) Llama."""
from __future__ import annotations

import pytest
import torch

from areal_kernel.errors import ArealError
from areal_kernel.weights.apply import check_meta, copy_into_model, model_tensor_table


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def test_table_has_tied_aliases(model):
    table = model_tensor_table(model)
    assert table["lm_head.weight"] is table["model.embed_tokens.weight"]
    assert "model.layers.0.mlp.up_proj.weight" in table


def test_copy_through_either_tied_name(model):
    table = model_tensor_table(model)
    new = torch.full((64, 16), 0.5)
    assert copy_into_model(table, [("lm_head.weight", new)]) == ["lm_head.weight"]
    assert torch.equal(model.model.embed_tokens.weight, new)
    new2 = torch.full((64, 16), -1.0, dtype=torch.bfloat16)  # dtype converted on copy
    copy_into_model(table, [("model.embed_tokens.weight", new2)])
    assert torch.equal(model.lm_head.weight, torch.full((64, 16), -1.0))
    with torch.inference_mode():  # the server copies inside inference mode
        copy_into_model(table, [("model.norm.weight", torch.arange(16.0))])
    assert torch.equal(model.model.norm.weight, torch.arange(16.0))


def test_check_meta_names_the_problem(model):
    table = model_tensor_table(model)
    check_meta(table, [{"name": "model.norm.weight", "shape": [16]}])
    with pytest.raises(ArealError, match="model.nope"):
        check_meta(table, [{"name": "model.nope", "shape": [1]}])
    with pytest.raises(ArealError, match=r"model.norm.weight.*\[17\].*\[16\]"):
        check_meta(table, [{"name": "model.norm.weight", "shape": [17]}])
    with pytest.raises(ArealError, match="shape"):
        copy_into_model(table, [("model.norm.weight", torch.zeros(3))])
