"""make_tiny_llama: a real LlamaConfig model, with or without SmolLM2's tokenizer;
make_tiny_byte_chat_llama: the same with a byte-level tokenizer (also written beside
make_tiny_byte_chat_qwen3_moe's mixture of experts)."""

from __future__ import annotations

import json

import pytest

from areal_kernel.testing.models import make_tiny_byte_chat_llama, make_tiny_llama


def _weights(path):
    from safetensors.torch import load_file

    return load_file(f"{path}/model.safetensors")


def test_without_tokenizer(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    d = make_tiny_llama(tmp_path / "m", hidden=32, layers=3, heads=4, kv_heads=2)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (config["model_type"], config["vocab_size"], config["num_hidden_layers"]) == ("llama", 256, 3)
    assert not (tmp_path / "m" / "tokenizer.json").exists()
    model = AutoModelForCausalLM.from_pretrained(d)
    logits = model(torch.tensor([[1, 5, 7]])).logits
    assert logits.shape == (1, 3, 256)


def test_same_seed_same_weights_other_seed_differs(tmp_path):
    import torch

    a = _weights(make_tiny_llama(tmp_path / "a", seed=3))
    b = _weights(make_tiny_llama(tmp_path / "b", seed=3))
    c = _weights(make_tiny_llama(tmp_path / "c", seed=4))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], c["model.layers.0.self_attn.q_proj.weight"])


def test_global_rng_untouched(tmp_path):
    import torch

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    make_tiny_llama(tmp_path / "m", seed=9)
    assert torch.equal(torch.rand(3), expected)


def test_bad_head_split_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="hidden=30"):
        make_tiny_llama(tmp_path / "m", hidden=30, heads=4)


@pytest.mark.slow
def test_with_smollm2_tokenizer(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from areal_kernel.models.resolve import resolve_model_path

    # The shared model cache, read only (the conversion itself is test_smollm2.py's).
    d = make_tiny_llama(tmp_path / "m", tokenizer_from=resolve_model_path("smollm2-135m-instruct"))
    tok = AutoTokenizer.from_pretrained(d)
    assert len(tok) == 49152 and tok.eos_token_id == 2
    assert tok.chat_template is not None
    model = AutoModelForCausalLM.from_pretrained(d)
    assert model.config.vocab_size == 49152 and model.config.eos_token_id == 2
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids.shape[1]


def test_byte_level_tokenizer_round_trips_any_text_and_chats(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = make_tiny_byte_chat_llama(tmp_path / "m", seed=1)
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d)
    assert len(tok) == 259 == model.config.vocab_size
    assert model.config.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert model.config.pad_token_id == tok.pad_token_id != tok.eos_token_id
    text = "What is 3 + 4? Ünïcödé, 漢字 and\ttabs"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text.encode("utf-8")) and max(ids) < 256  # one token per byte, no special token
    assert tok.decode(ids) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    chat_ids = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    assert chat_ids[0, 0].item() == tok.convert_tokens_to_ids("<|im_start|>")  # a special token is one id
    with torch.no_grad():
        out = model.generate(chat_ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > chat_ids.shape[1]


def test_byte_chat_qwen3_moe_has_the_same_tokenizer(tmp_path):
    """make_tiny_byte_chat_qwen3_moe writes the byte-level chat tokenizer of
    make_tiny_byte_chat_llama (the same files, one helper) beside a Qwen3-MoE
    whose vocab and special ids are the tokenizer's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from areal_kernel.testing.models import make_tiny_byte_chat_qwen3_moe

    moe = make_tiny_byte_chat_qwen3_moe(tmp_path / "moe", experts=4, top_k=2)
    llama = make_tiny_byte_chat_llama(tmp_path / "llama")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        with open(f"{moe}/{name}") as a, open(f"{llama}/{name}") as b:
            assert a.read() == b.read(), name
    tok = AutoTokenizer.from_pretrained(moe)
    model = AutoModelForCausalLM.from_pretrained(moe)
    assert model.config.model_type == "qwen3_moe" and model.config.num_experts == 4
    assert len(tok) == 259 == model.config.vocab_size
    assert (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id) == (
        tok.bos_token_id,
        tok.eos_token_id,
        tok.pad_token_id,
    )
    chat_ids = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.no_grad():
        assert model(chat_ids).logits.shape == (1, chat_ids.shape[1], 259)
