"""The parallel layout of an ``fsdp`` allocation (no torch).

``actor.backend: fsdp:d2t2`` -> 2 data-parallel replicas x 2 tensor-parallel
ranks (world size d*t*p*c). Ranks are numbered data-major: rank ``r`` is replica
``r // t``, tensor rank ``r % t`` (the inner dimension of the 2-D device
mesh, so the ranks of one tensor group are neighbours). What the engine runs:

- d (data): FSDP2 ``fully_shard`` over the replicas' axis;
- t (tensor): DTensor tensor parallelism inside each replica, for the model
  families ``areal_fsdp.tensor_parallel`` has a plan for;
- p (pipeline): ``torch.distributed.pipelining`` stages, one rank per
  pipeline rank (``areal_fsdp.pipeline``), on its own for now (``fsdp:p2``,
  ``fsdp:p4``): combined with d or t it is refused with one line;
- e (expert): the experts of every MoE layer split over the data ranks
  (``areal_fsdp.expert_parallel``): the kernel counts a train engine's
  ranks as d*t*p*c and experts reuse them, so ``fsdp:d2e2`` is 2 ranks,
  each holding half of the experts; this engine runs ``e == d`` with neither
  t nor p (``fsdp:e2`` alone would be one rank: refused with the form to write);
- c (context): every micro-batch's packed row is cut into ``c`` contiguous
  chunks along the sequence, one per context rank (``areal_fsdp.context_parallel``):
  each rank runs the model on its chunk and its attention reads the keys and
  values of the whole row (all-gathered); with d only (``fsdp:c2``,
  ``fsdp:d2c2``): ranks are numbered data-major, rank ``r`` is replica
  ``r // c``, context rank ``r % c``; FSDP shards the parameters over all
  d*c ranks. Combined with t, p or e it is refused with one line.

The pipeline helpers here (``split_layers``, ``stage_rank``) are pure
arithmetic, shared by the rank processes and the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from areal_kernel.config.allocation import Allocation, allocation_at
from areal_kernel.errors import ConfigError

EXAMPLES = "'fsdp:d2', 'fsdp:t2', 'fsdp:d2t2', 'fsdp:p2', 'fsdp:d2e2' or 'fsdp:d2c2'"

# actor.fsdp.pipeline_schedule -> (torch.distributed.pipelining schedule class,
# stages per rank). A schedule with more than one stage per rank places them
# round-robin ("loop"): stage s on pipeline rank s % p.
PIPELINE_SCHEDULES: dict[str, tuple[str, int]] = {
    "1f1b": ("Schedule1F1B", 1),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2),
}


@dataclass(frozen=True)
class Layout:
    """Sizes of the mesh dimensions (all >= 1; ``pp > 1`` only with ``dp == tp == 1``;
    ``ep > 1`` only with ``ep == dp`` and ``tp == pp == 1``: the expert ranks are the data ranks;
    ``cp > 1`` only with ``tp == pp == ep == 1``)."""

    dp: int
    tp: int
    pp: int = 1
    ep: int = 1
    cp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def coords(self, rank: int) -> tuple[int, int]:
        """``(data-parallel index, tensor-parallel index)`` of a global rank;
        with pipeline parallelism ``(data-parallel index, pipeline rank)``;
        with expert parallelism ``(data-parallel index, expert rank)``;
        with context parallelism ``(data-parallel index, context rank)``
        (``coord_names`` says which)."""
        if self.ep > 1:
            return rank, rank % self.ep
        inner = self.pp if self.pp > 1 else self.cp if self.cp > 1 else self.tp
        return rank // inner, rank % inner

    @property
    def coord_names(self) -> str:
        return "dp" if self.pp > 1 else "de" if self.ep > 1 else "dc" if self.cp > 1 else "dt"

    def rank_coords(self, rank: int) -> dict[str, int]:
        """``{"d": .., "t": ..}``, ``{"d": .., "p": ..}``, ``{"d": .., "e": ..}``
        or ``{"d": .., "c": ..}`` of a global rank (what the engine logs)."""
        return dict(zip(self.coord_names, self.coords(rank)))

    def __str__(self) -> str:
        if self.pp > 1:
            return f"fsdp:d{self.dp}p{self.pp}"
        if self.ep > 1:
            return f"fsdp:d{self.dp}e{self.ep}"
        if self.cp > 1:
            return f"fsdp:d{self.dp}c{self.cp}"
        return f"fsdp:d{self.dp}t{self.tp}"


def layout_of(allocation: Allocation | str | None, where: str = "actor.backend") -> Layout:
    """The ``Layout`` of an allocation; one ``ConfigError`` naming ``where``,
    the allocation and what is valid for dims this engine cannot run."""
    if allocation is None:
        allocation = "fsdp"
    a = allocation_at(allocation, where)
    if a.c > 1 and (a.t > 1 or a.p > 1 or a.e > 1):
        others = "".join(f"{k}{getattr(a, k)}" for k in ("t", "p", "e") if getattr(a, k) > 1)
        raise ConfigError(
            f"{where}: {a} combines context parallelism (c{a.c}) with {others}, which the fsdp engine does not do "
            f"yet; valid: c with data parallelism only, e.g. 'fsdp:c{a.c}' or 'fsdp:d{a.d}c{a.c}'"
        )
    if a.e > 1:
        _check_expert_dims(a, where)
    if a.p > 1 and (a.d > 1 or a.t > 1):
        others = "".join(f"{k}{getattr(a, k)}" for k in ("d", "t") if getattr(a, k) > 1)
        raise ConfigError(
            f"{where}: {a} combines pipeline parallelism (p{a.p}) with {others}, which the fsdp engine does not "
            f"do yet; valid: p alone ('fsdp:p{a.p}') or d/t without p ('fsdp:d{a.d}t{a.t}')"
        )
    return Layout(dp=a.d, tp=a.t, pp=a.p, ep=a.e, cp=a.c)


def _check_expert_dims(a: Allocation, where: str) -> None:
    """``e`` splits the experts over the data ranks: one line for the forms
    this engine does not run (the kernel counts ranks as d*t*p*c, so the
    experts need ``d`` ranks to split over)."""
    if a.t > 1 or a.p > 1:
        others = "".join(f"{k}{getattr(a, k)}" for k in ("t", "p") if getattr(a, k) > 1)
        raise ConfigError(
            f"{where}: {a} combines expert parallelism (e{a.e}) with {others}, which the fsdp engine does not do "
            f"yet; valid: experts split over the data ranks alone, e.g. 'fsdp:d{a.e}e{a.e}'"
        )
    if a.d == 1:
        raise ConfigError(
            f"{where}: {a} is one rank: the kernel counts a train engine's ranks as d*t*p*c and expert "
            f"parallelism reuses them, so the experts need data ranks to split over; write 'fsdp:d{a.e}e{a.e}' "
            f"({a.e} ranks, each holding 1/{a.e} of the experts)"
        )
    if a.d != a.e:
        raise ConfigError(
            f"{where}: {a}: the fsdp engine splits the experts over all data ranks (e = d); replicated expert "
            f"groups (d a multiple of e) are not implemented yet; use 'fsdp:d{a.d}e{a.d}'"
        )


def check_layout_settings(layout: Layout, settings: Any, where: str = "actor.backend") -> None:
    """Settings the tensor-, pipeline-, expert- and context-parallel paths do
    not support yet: one ``ConfigError`` naming the allocation and the setting
    (never a run that would silently compute something else)."""
    if layout.tp == 1 and layout.pp == 1 and layout.ep == 1 and layout.cp == 1:
        return
    if layout.cp > 1:
        kind, dim = "context parallelism", f"c{layout.cp}"
    elif layout.ep > 1:
        kind, dim = "expert parallelism", f"e{layout.ep}"
    elif layout.pp > 1:
        kind, dim = "pipeline parallelism", f"p{layout.pp}"
    else:
        kind, dim = "tensor parallelism", f"t{layout.tp}"
    refused = {
        "gradient_checkpointing": f"activation recomputation is not validated with {kind}",
        "cpu_offload": f"offloading is not validated with {kind}",
        # areal_fsdp.multi_adapter switches adapters on FSDP units over d only.
        "adapters": f"several adapters are not validated with {kind}",
    }
    if layout.pp > 1 or layout.ep > 1 or layout.cp > 1:
        # Tensor parallelism splits the adapters with their base layers
        # (areal_fsdp.tensor_parallel.module_plan); stages, experts and the
        # context attention's runner are not validated with adapters yet.
        refused["lora"] = f"LoRA adapters are not split by {kind} yet"
        # The stages / the experts are not FSDP units: FSDP's mixed-precision
        # policy would silently not apply to them, and bf16 autocast changes
        # the dtype the ranks send each other (the context ranks: the keys and
        # values they exchange); not validated.
        refused["autocast_bf16"] = f"bf16 autocast is not validated with {kind}"
    for field, why in refused.items():
        value = getattr(settings, field, None)
        if value not in (None, False):
            raise ConfigError(
                f"{where}: {layout} ({dim}) with actor.fsdp.{field} is not supported ({why}); "
                f"drop {field} or use data parallelism only, e.g. 'fsdp:d{layout.world_size}'"
            )
    lora = getattr(settings, "lora", None)
    if layout.tp > 1 and lora is not None and lora.dropout > 0:
        # Every tensor rank draws the same dropout mask (same seed, same
        # calls): right for a replicated input, but a row-wise layer's input
        # slices would all get one slice's mask repeated (not validated).
        raise ConfigError(
            f"{where}: {layout} ({dim}) with actor.fsdp.lora.dropout={lora.dropout} is not supported (adapter "
            f"dropout is not split by {kind}); set lora.dropout: 0 or use 'fsdp:d{layout.world_size}'"
        )
    mp = getattr(settings, "mixed_precision", None)
    if (
        (layout.pp > 1 or layout.ep > 1 or layout.cp > 1)
        and mp is not None
        and any(v is not None for v in (mp.param_dtype, mp.reduce_dtype, mp.output_dtype))
    ):
        why = (
            "pipeline stages are not FSDP units, so the policy would not apply"
            if layout.pp > 1
            else "the experts are not FSDP units, so the policy would not apply"
            if layout.ep > 1
            else "keys and values exchanged in lower precision are not validated"
        )
        raise ConfigError(
            f"{where}: {layout} ({dim}) with actor.fsdp.mixed_precision is not supported ({why}); "
            f"drop mixed_precision or use 'fsdp:d{layout.world_size}'"
        )


def split_layers(n_layers: int, n_stages: int) -> list[range]:
    """Decoder layers ``[0, n_layers)`` split by count into ``n_stages``
    consecutive ranges, as even as possible; when they do not divide, the
    earlier stages take one layer more (the last stage also runs the final
    norm and the LM head). ``ValueError`` when a stage would get none."""
    if n_stages < 1 or n_layers < n_stages:
        raise ValueError(f"{n_layers} decoder layers cannot fill {n_stages} pipeline stages")
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def stage_rank(stage: int, pp: int) -> int:
    """Pipeline rank that holds ``stage`` (round-robin: stage ``s`` on ``s % pp``)."""
    return stage % pp
