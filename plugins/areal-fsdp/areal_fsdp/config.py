"""``actor.fsdp`` settings (pydantic v2, no torch).

Everything the single-process torch engine has (optimizer, lr schedule,
micro-batch token budget, bf16 autocast, gradient checkpointing, ...) plus
what sharding adds. Field names follow ``TorchEngineConfig`` so a config can
switch ``actor.backend`` between ``torch`` and ``fsdp:dN`` and keep its section.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from areal_kernel.engine.config import TorchEngineConfig

DType = Literal["float32", "bfloat16", "float16"]


class MixedPrecisionConfig(BaseModel):
    """FSDP2 ``MixedPrecisionPolicy``. ``None`` keeps the master weights' dtype
    (``param_dtype`` of the engine section)."""

    model_config = ConfigDict(extra="forbid")

    param_dtype: DType | None = Field(None, description="dtype parameters are all-gathered in and computed with")
    reduce_dtype: DType | None = Field(
        None, description="dtype of the gradient reduce-scatter (None: param_dtype); float32 keeps sums exact"
    )
    output_dtype: DType | None = Field(None, description="dtype the root module's outputs are cast to")
    cast_forward_inputs: bool = True


class FSDPEngineConfig(TorchEngineConfig):
    """Settings of the ``fsdp`` train engine (``actor.fsdp: {...}``). The rank
    layout is not here: it comes from the allocation (``actor.backend: fsdp:d2``,
    ``fsdp:t2``, ``fsdp:d2t2``, ``fsdp:p2``, ``fsdp:d2e2``, ``fsdp:d2c2``; see ``areal_fsdp.layout``)."""

    @classmethod
    def check_allocation(cls, allocation: Any, where: str = "actor.backend") -> None:
        """Called by the kernel when it validates ``actor.backend``: one
        ConfigError for dims this engine cannot run (c combined with t, p or e; p combined with d or t;
        e other than e = d without t or p)."""
        from areal_fsdp.layout import layout_of

        layout_of(allocation, where)

    mixed_precision: MixedPrecisionConfig = Field(default_factory=MixedPrecisionConfig)
    reshard_after_forward: bool = Field(
        True, description="free gathered parameters after forward (re-gathered in backward): less memory, more traffic"
    )
    wrap_policy: Literal["decoder_layer", "root"] = Field(
        "decoder_layer",
        description="'decoder_layer': every transformer block is its own FSDP unit (gather one block at a time); "
        "'root': one unit for the whole model",
    )
    cpu_offload: bool = Field(
        False,
        description="keep sharded parameters, gradients and optimizer state in host memory (accelerators only; "
        "on the cpu platform they already are there and this is a no-op)",
    )
    dist_timeout_s: float = Field(1800.0, gt=0, description="timeout of collectives between ranks")
    startup_timeout_s: float = Field(300.0, gt=0, description="how long rank processes may take to start and connect")
    pipeline_schedule: Literal["1f1b", "interleaved_1f1b"] = Field(
        "1f1b",
        description="with a p dim (fsdp:p2): the torch.distributed.pipelining schedule. '1f1b': one stage per rank; "
        "'interleaved_1f1b': two stages per rank, placed round-robin (needs at least 2*p decoder layers); "
        "ignored without p",
    )
    export_shard_mb: int = Field(
        1024, ge=1, description="HF export: rank 0 gathers and writes at most this many MB per safetensors file"
    )
