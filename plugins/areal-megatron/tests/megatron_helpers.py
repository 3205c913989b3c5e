"""Helpers of the areal-megatron tests, imported by module name (a bare
``from conftest import`` resolves to whichever tests directory's conftest a
whole-suite run loaded first)."""

from __future__ import annotations


def make_tiny_qwen(path: str, model_type: str, seed: int = 0) -> str:
    """A random-init Qwen2 (qkv biases) or Qwen3 (q/k norms, explicit head_dim)
    from its real ``transformers`` config class, untied embeddings."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    if model_type == "qwen2":
        cfg, cls = Qwen2Config(**common), Qwen2ForCausalLM
    else:
        cfg, cls = Qwen3Config(head_dim=24, **common), Qwen3ForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(cfg)
        with torch.no_grad():
            for p in model.parameters():  # norms and biases non-trivial too
                p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path, safe_serialization=True)
    return path
