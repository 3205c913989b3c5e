"""Entry point ``fsdp`` of the ``areal.plugins`` group: imports only areal_kernel."""

from __future__ import annotations

from typing import Any

from areal_kernel.hookspecs import hookimpl


@hookimpl
def areal_register_train_engines(register: Any) -> None:
    register(
        "fsdp",
        "areal_fsdp.engine:FSDPTrainEngine",
        config_model="areal_fsdp.config:FSDPEngineConfig",
        capabilities=[
            "packing",
            "disk_export",
            "broadcast_export",
            "multi_process",
            "dcp_checkpoint",
            "policies",
            "joint_policies",
        ],
        description="PyTorch FSDP2 (fully_shard) over d x t rank processes (allocation fsdp:d2, fsdp:t2, fsdp:d2t2; "
        "tensor parallelism for Llama, Qwen3), pipeline stages (fsdp:p2, Llama), or experts split over the data "
        "ranks (fsdp:d2e2, Qwen3-MoE)",
    )
