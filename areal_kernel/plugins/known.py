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


def install_hint(name: str) -> str | None:
    dist = KNOWN_PLUGINS.get(name)
    return f"'{name}' is provided by the {dist} plugin: pip install {dist}" if dist else None
