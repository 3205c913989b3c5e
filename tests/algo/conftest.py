"""A tiny random Llama for the GRPO tests (no tokenizer needed here)."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    path = str(tmp_path_factory.mktemp("tiny_llama_algo"))
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path
