"""Entry point ``sglang`` (group ``areal.plugins``): registration only, lazy targets."""
from __future__ import annotations

from typing import Any

from areal_kernel.hookspecs import hookimpl


@hookimpl
def areal_register_inference_engines(register: Any) -> None:
    register(
        "sglang",
        "areal_sglang.backend:SGLangBackend",
        config_model="areal_sglang.config:SGLangServerConfig",
        # No "broadcast_update": SGLang receives in-memory weights as one
        # broadcast per tensor on a group it builds itself, while the kernel's
        # trainer-side sender broadcasts flat buckets on its private group, so
        # `weight_update.mode: auto` must pick the disk transport.
        capabilities=["pause", "disk_update"],
        description="SGLang servers (python -m sglang.launch_server), native HTTP API",
    )
