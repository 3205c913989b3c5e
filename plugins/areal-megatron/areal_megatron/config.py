"""``actor.megatron`` settings (pydantic v2, no torch).

Field names follow ``TorchEngineConfig`` so a config can switch
``actor.backend`` between ``torch``, ``fsdp:dN`` and ``megatron:...`` and keep
its section. The parallel layout is not here: it comes from the allocation
(``actor.backend: megatron:d2t2p1``, see ``areal_megatron.layout``).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from areal_kernel.engine.config import TorchEngineConfig


class MegatronEngineConfig(TorchEngineConfig):
    """Settings of the ``megatron`` train engine (``actor.megatron: {...}``)."""

    share_prompts: bool = Field(
        False,
        description="not available: Megatron-Core's local attention has no tree masks, so every sequence "
        "is scored on its own (padded micro-batches)",
    )
    dist_timeout_s: float = Field(1800.0, gt=0, description="timeout of collectives between ranks")
    startup_timeout_s: float = Field(300.0, gt=0, description="how long rank processes may take to start and connect")
    export_shard_mb: int = Field(
        1024, ge=1, description="HF export: rank 0 gathers and writes at most this many MB per safetensors file"
    )

    @classmethod
    def check_allocation(cls, allocation: Any, where: str = "actor.backend") -> None:
        """Called by the kernel when it validates ``actor.backend``: one
        ConfigError for dims this engine cannot run (``areal_megatron.layout``)."""
        from areal_megatron.layout import layout_of

        layout_of(allocation, where)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if data.get("share_prompts"):
                raise ValueError(
                    "share_prompts: true is not supported by the megatron engine (Megatron-Core's local "
                    "attention cannot run a shared-prompt tree); set it to false"
                )
            if data.get("lora") is not None:
                raise ValueError("lora: LoRA adapters are not supported by the megatron engine; use fsdp or torch")
            if data.get("gradient_checkpointing"):
                raise ValueError(
                    "gradient_checkpointing: not supported by the megatron engine yet (Megatron-Core's "
                    "recompute needs its CUDA RNG tracker); set it to false"
                )
        return data
