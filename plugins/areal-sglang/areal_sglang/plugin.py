"""Entry point ``sglang`` (group ``areal.plugins``): registration only, lazy targets."""

from __future__ import annotations

from typing import Any

from areal_kernel.hookspecs import hookimpl

# Train engines whose named_weights_for_transfer() holds the real tensors in
# the controller process (the fsdp engine keeps them in its ranks): `auto`
# picks in-memory updates only for these.
_IN_PROCESS_TRAIN_ENGINES = frozenset({"torch"})


@hookimpl
def areal_register_inference_engines(register: Any) -> None:
    register(
        "sglang",
        "areal_sglang.backend:SGLangBackend",
        config_model="areal_sglang.config:SGLangServerConfig",
        # broadcast_update: through the `sglang_broadcast` transport below (SGLang's
        # own group and flattened buckets), never the kernel's `broadcast` one.
        capabilities=["pause", "disk_update", "broadcast_update"],
        description="SGLang servers (python -m sglang.launch_server), native HTTP API",
    )


@hookimpl
def areal_register_weight_transports(register: Any) -> None:
    register(
        "sglang_broadcast",
        "areal_sglang.weights:SGLangBroadcastTransport",
        description="in-memory updates to SGLang servers: its update group, flattened buckets",
    )


@hookimpl
def areal_select_weight_transport(train_backend: str, inference_backend: str, platform: str, mode: str) -> str | None:
    if inference_backend != "sglang" or mode == "disk":
        return None  # the kernel's default applies
    if mode == "broadcast":
        return "sglang_broadcast"
    if mode == "auto":
        # Where the platform measured a disk round trip as the cheaper pause
        # (cpu; SGLang has no CPU build anyway), follow it.
        from areal_kernel.platforms import platform_named

        if (
            not platform_named(platform).prefers_in_memory_weight_updates
            or train_backend not in _IN_PROCESS_TRAIN_ENGINES
        ):
            return "disk"
        return "sglang_broadcast"
    return None


@hookimpl
def areal_register_environments(register: Any) -> None:
    register(
        "sglang",
        "areal_sglang.environment:sglang_environment",
        description="a Python environment for SGLang servers (areal env create sglang; rollout.sglang.python)",
    )
