"""Entry point ``megatron`` of the ``areal.plugins`` group: imports only areal_kernel."""

from __future__ import annotations

from typing import Any

from areal_kernel.hookspecs import hookimpl


@hookimpl
def areal_register_train_engines(register: Any) -> None:
    register(
        "megatron",
        "areal_megatron.engine:MegatronTrainEngine",
        config_model="areal_megatron.config:MegatronEngineConfig",
        capabilities=["disk_export", "broadcast_export", "multi_process", "dist_checkpoint"],
        description="Megatron-Core GPT (local layer spec) over d x t x p rank processes "
        "(allocation megatron:d2t2p1); Llama, Qwen2, Qwen3",
    )
