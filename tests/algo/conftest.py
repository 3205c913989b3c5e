"""Fixtures of the algorithm tests: a tiny random Llama (no tokenizer needed
here) and the test algorithm plugin."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from areal_kernel.testing.packages import pip_install_private, use_private_site

HERE = Path(__file__).resolve().parent

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


# A real third-party plugin (plugin_packages/areal-test-algo) installed into a
# private site directory once per module, enabled per test.

@pytest.fixture(scope="module")
def algo_plugin_site(tmp_path_factory) -> Path:
    return pip_install_private(HERE / "plugin_packages" / "areal-test-algo", tmp_path_factory.mktemp("algo-plugin"))


@pytest.fixture
def with_algo_plugin(algo_plugin_site, monkeypatch, areal_env):
    return use_private_site(algo_plugin_site, monkeypatch, areal_env)
