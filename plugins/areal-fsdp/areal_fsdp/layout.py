"""The parallel layout of an ``fsdp`` allocation (no torch).

``actor.backend: fsdp:d2t2`` -> 2 data-parallel replicas x 2 tensor-parallel
ranks (world size d*t). Ranks are numbered data-major: rank ``r`` is replica
``r // t``, tensor rank ``r % t`` (the inner dimension of the 2-D device
mesh, so the ranks of one tensor group are neighbours). What the engine runs:

- d (data): FSDP2 ``fully_shard`` over the replicas' axis;
- t (tensor): DTensor tensor parallelism inside each replica, for the model
  families ``areal_fsdp.tensor_parallel`` has a plan for;
- p, c, e (pipeline, context, expert): not implemented in this engine;
  refused with the allocation named (the megatron engine runs p).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from areal_kernel.config.allocation import Allocation, allocation_at
from areal_kernel.errors import ConfigError

EXAMPLES = "'fsdp:d2', 'fsdp:t2' or 'fsdp:d2t2'"


@dataclass(frozen=True)
class Layout:
    """Sizes of the two mesh dimensions (both >= 1)."""

    dp: int
    tp: int

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    def coords(self, rank: int) -> tuple[int, int]:
        """``(data-parallel index, tensor-parallel index)`` of a global rank."""
        return rank // self.tp, rank % self.tp

    def __str__(self) -> str:
        return f"fsdp:d{self.dp}t{self.tp}"


def layout_of(allocation: Allocation | str | None, where: str = "actor.backend") -> Layout:
    """The ``Layout`` of an allocation; one ``ConfigError`` naming ``where``,
    the allocation and what is valid for dims this engine cannot run."""
    if allocation is None:
        allocation = "fsdp"
    a = allocation_at(allocation, where)
    extra = [f"{k}{getattr(a, k)}" for k in ("p", "c", "e") if getattr(a, k) != 1]
    if extra:
        raise ConfigError(
            f"{where}: {a} asks for pipeline/context/expert parallelism ({', '.join(extra)}), which the fsdp "
            f"engine does not do; valid dims are d (data) and t (tensor), e.g. {EXAMPLES}"
        )
    return Layout(dp=a.d, tp=a.t)


def check_layout_settings(layout: Layout, settings: Any, where: str = "actor.backend") -> None:
    """Settings the tensor-parallel path does not support yet: one
    ``ConfigError`` naming the allocation and the setting (never a run that
    would silently compute something else)."""
    if layout.tp == 1:
        return
    refused = {
        "lora": "LoRA adapters are not sharded by the tensor-parallel plan",
        "gradient_checkpointing": "activation recomputation is not validated with tensor parallelism",
        "cpu_offload": "offloading is not validated with tensor parallelism",
    }
    for field, why in refused.items():
        value = getattr(settings, field, None)
        if value not in (None, False):
            raise ConfigError(
                f"{where}: {layout} (t{layout.tp}) with actor.fsdp.{field} is not supported ({why}); "
                f"drop {field} or use data parallelism only, e.g. 'fsdp:d{layout.world_size}'"
            )
