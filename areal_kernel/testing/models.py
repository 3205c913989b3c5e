"""Tiny random models for fast tests (a few hundred KB, forward in milliseconds).

They are built in ``areal_kernel.models.tiny`` (the model layer also builds
the known model ``tiny-vlm-random`` from them); this is their name for tests.
``make_tiny_qwen3_moe`` (a tiny mixture-of-experts model for the expert-parallel
tests) and ``make_tiny_byte_chat_qwen3_moe`` (the same with the byte-level chat
tokenizer, for runs of ``areal train``) are defined here: no known model is
built from them.
"""

from __future__ import annotations

import os
from pathlib import Path

from areal_kernel.models.tiny import (
    VLM_CHAT_TEMPLATE,
    VLM_IMAGE_TOKENS,
    make_tiny_byte_chat_llama,
    make_tiny_chat_llama,
    make_tiny_llama,
    make_tiny_vlm,
    write_byte_chat_tokenizer,
)

__all__ = [
    "VLM_CHAT_TEMPLATE",
    "VLM_IMAGE_TOKENS",
    "make_tiny_byte_chat_llama",
    "make_tiny_chat_llama",
    "make_tiny_llama",
    "make_tiny_byte_chat_qwen3_moe",
    "make_tiny_qwen3_moe",
    "make_tiny_vlm",
]


def make_tiny_qwen3_moe(
    path: str | os.PathLike[str],
    *,
    vocab_size: int = 256,
    hidden: int = 64,
    layers: int = 2,
    experts: int = 4,
    top_k: int = 2,
    moe_intermediate: int = 32,
    heads: int = 4,
    kv_heads: int = 2,
    norm_topk_prob: bool = True,
    seed: int = 0,
    std: float = 0.2,
    special_ids: tuple[int, int, int] = (1, 2, 2),
) -> str:
    """Write a random-init mixture-of-experts model (a real ``Qwen3MoeConfig``:
    every decoder layer's MLP is ``experts`` experts with a top-``top_k``
    router) to ``path``; vocab 256, tied embeddings, no tokenizer. Every
    matrix (router, experts, attention, embedding) is drawn with ``std``
    (default 0.2, not transformers' 0.02: with near-zero router weights the
    router's top-k choices would hinge on rounding, and two engines that sum
    in other orders would route tokens differently); norm weights stay 1.
    Same ``seed`` -> same weights; the global torch RNG is left untouched.
    ``special_ids``: the (bos, eos, pad) token ids of the config."""
    import torch
    from transformers import GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    if top_k > experts:
        raise ValueError(f"top_k={top_k} cannot exceed experts={experts}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    bos, eos, pad = special_ids
    config = Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,  # dense MLP size (unused: every layer is sparse)
        moe_intermediate_size=moe_intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(config)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, p in model.named_parameters():
                if p.dim() > 1:
                    p.copy_(torch.randn(p.shape, generator=g) * std)
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(str(out), safe_serialization=True)
    return str(out)


def make_tiny_byte_chat_qwen3_moe(path: str | os.PathLike[str], **kwargs: object) -> str:
    """``make_tiny_qwen3_moe`` with the byte-level chat tokenizer of
    ``make_tiny_byte_chat_llama`` (``write_byte_chat_tokenizer``: 259 tokens,
    SmolLM2's chat format): prompts render and tokenise, so ``areal train``
    and the embedded inference server run it (the expert-parallel
    end-to-end tests). ``kwargs`` go to ``make_tiny_qwen3_moe``; the vocab
    and special ids come from the tokenizer."""
    ids = write_byte_chat_tokenizer(path)
    special = (ids["bos_token_id"], ids["eos_token_id"], ids["pad_token_id"])
    return make_tiny_qwen3_moe(path, vocab_size=ids["vocab_size"], special_ids=special, **kwargs)  # type: ignore[arg-type]
