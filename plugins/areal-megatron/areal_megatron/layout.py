"""The parallel layout of a ``megatron`` allocation (no torch).

``actor.backend: megatron:d2t2p1`` -> data 2, tensor 2, pipeline 1 ranks
(world size d*t*p*c). What megatron-core and this engine can run:

- d (data), t (tensor) and p (pipeline): on every platform, gloo included;
- c (context parallel): megatron-core's context-parallel attention exists
  only in Transformer Engine's attention, which the local layer spec this
  engine uses does not have: refused everywhere;
- e (expert parallel): only for mixture-of-experts models; the architectures
  the engine converts (Llama, Qwen2, Qwen3) are dense: refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_kernel.config.allocation import Allocation, allocation_at
from areal_kernel.errors import ConfigError

EXAMPLES = "'megatron:d2', 'megatron:t2', 'megatron:p2' or 'megatron:d2t2p1'"


@dataclass(frozen=True)
class Layout:
    """Sizes of the parallel dimensions (all >= 1)."""

    dp: int
    tp: int
    pp: int

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def __str__(self) -> str:
        return f"megatron:d{self.dp}t{self.tp}p{self.pp}"


def layout_of(allocation: Allocation | str, where: str = "actor.backend") -> Layout:
    """The ``Layout`` of an allocation; one ``ConfigError`` naming ``where``
    and what is valid for anything this engine cannot run."""
    a = allocation_at(allocation, where)
    if a.c != 1:
        raise ConfigError(
            f"{where}: {a} asks for context parallelism (c{a.c}); megatron-core implements it only in "
            f"Transformer Engine attention, which the megatron engine's local layer spec does not use. "
            f"Use d, t and p dims, e.g. {EXAMPLES}"
        )
    if a.e != 1:
        raise ConfigError(
            f"{where}: {a} asks for expert parallelism (e{a.e}); the models the megatron engine converts "
            f"(Llama, Qwen2, Qwen3) have no experts. Use d, t and p dims, e.g. {EXAMPLES}"
        )
    return Layout(dp=a.d, tp=a.t, pp=a.p)
