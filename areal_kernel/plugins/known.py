"""Names users may write that belong to plugins we know of, for install hints."""

from __future__ import annotations

# entry-point / config name -> distribution that provides it
KNOWN_PLUGINS: dict[str, str] = {
    "vllm": "areal-vllm",
    "sglang": "areal-sglang",
    "fsdp": "areal-fsdp",
    "megatron": "areal-megatron",
    "npu": "areal-npu",
}

# name -> the registry kinds it is known under: an install hint is given only
# where the name means something (`actor.backend: vllm` is not fixed by installing areal-vllm).
KNOWN_KINDS: dict[str, tuple[str, ...]] = {
    "vllm": ("inference_engine",),
    "sglang": ("inference_engine",),
    "fsdp": ("train_engine",),
    "megatron": ("train_engine",),
    "npu": ("platform",),
}


def install_hint(name: str, kind: str | None = None) -> str | None:
    """``pip install`` advice for ``name`` (of registry ``kind``, when given), or ``None``."""
    dist = KNOWN_PLUGINS.get(name)
    if dist is None or (kind is not None and name in KNOWN_KINDS and kind not in KNOWN_KINDS[name]):
        return None
    return f"'{name}' is provided by the {dist} plugin: pip install {dist}"
