"""``MegatronTrainEngine``: the controller-side face of d x t x p Megatron ranks.

It implements the kernel's ``TrainEngine`` in the controller process (which
never holds the model) and drives the ranks (``areal_megatron.rank``) through
the kernel's ranked-engine base (``areal_kernel.engine.ranked.RankedTrainEngine``,
on ``areal_kernel.engine.ranks.RankGroup``). What is Megatron's own here: the
d x t x p layout, how parts reach the ranks (below), and rank reuse
(``ranks=``, from ``detach_ranks`` of an engine of another layout).

Data parallelism: a batch is split into ``d`` parts balanced by tokens; every
rank receives all parts and keeps its replica's (the tensor and pipeline
ranks of a replica see the same data). Losses follow the kernel's loss
contract (each micro-batch returns its share of the *batch* loss) and the
ranks sum gradients over replicas, so a step equals the single-process step
whatever the layout. One rank per replica (last pipeline stage, tensor rank
0) reports losses, stats and scores.
"""

from __future__ import annotations

from typing import Any

from areal_kernel.api.io import TrajectoryBatch
from areal_kernel.config.allocation import Allocation
from areal_kernel.engine.ranked import RankedTrainEngine
from areal_kernel.engine.ranks import RankGroup
from areal_kernel.errors import ConfigError
from areal_kernel.logging import get_logger

from areal_megatron.config import MegatronEngineConfig
from areal_megatron.layout import Layout, layout_of

log = get_logger(__name__)


class MegatronTrainEngine(RankedTrainEngine):
    """Megatron-Core train engine over ``d*t*p`` rank processes.

    Built by the kernel with ``from_context`` (allocation ``megatron:d2t2p1``,
    the run's scheduler, logs in ``<run_dir>/megatron-ranks``); built directly
    (tests, scripts) ``allocation`` is a string or an ``Allocation`` and a
    ``local`` scheduler of its own starts the ranks. ``ranks``: the rank
    processes of an engine of the same world size (its ``detach_ranks()``)
    to build on instead of starting new ones: the ranks drop their old model
    and re-initialise Megatron's parallel state.
    """

    engine_name = "megatron"
    rank_module = "areal_megatron.rank"
    # megatron-core's dist_checkpointing; the optimizer needs the same t and p layout to load.
    save_state_command = "dist_save"
    load_state_command = "dist_load"
    rank_weight_sample = True  # the weight-delivery check samples in the ranks

    config: MegatronEngineConfig

    def __init__(
        self,
        config: MegatronEngineConfig | dict[str, Any] | None = None,
        allocation: Allocation | str | None = None,
        *,
        log_dir: str | None = None,
        scheduler: Any = None,
        run_config: Any = None,
        ranks: RankGroup | None = None,
    ) -> None:
        settings = MegatronEngineConfig.parse(config)
        self.layout: Layout = layout_of(allocation if allocation is not None else "megatron")
        if ranks is not None and ranks.world_size != self.layout.world_size:
            raise ConfigError(f"ranks: {ranks.world_size} rank processes cannot run {self.layout}")
        super().__init__(
            settings, self.layout.world_size, log_dir=log_dir, scheduler=scheduler, run_config=run_config, ranks=ranks
        )
        self._reporters: dict[int, int] = {}  # data-parallel rank -> reporting global rank

    # ------------------------------------------------------- base-class hooks
    @property
    def data_parallel_size(self) -> int:
        return self.layout.dp

    def create_kwargs(self) -> dict[str, Any]:
        return {"config": self.config.model_dump(), "tp": self.layout.tp, "pp": self.layout.pp}

    def on_initialized(self, answers: list[Any]) -> None:
        self._reporters = {o["dp_rank"]: r for r, o in enumerate(answers) if o["reporter"]}
        log.info("megatron engine ready", layout=str(self.layout), logs=self.log_dir)

    def call_parts(
        self,
        cmd: str,
        parts: list[TrajectoryBatch],
        per_part: list[dict[str, Any]],
        common: dict[str, Any],
    ) -> list[Any]:
        """Every rank receives all ``d`` parts and keeps its replica's (the
        tensor and pipeline ranks of a replica see the same data); per-part
        arguments travel as lists indexed by replica. One rank per replica
        (last pipeline stage, tensor rank 0) reports its part's answer."""
        lists = {k: [kw[k] for kw in per_part] for k in (per_part[0] if per_part else {})}
        answers = self.call_ranks(cmd, {"parts": parts, **lists, **common})
        return [answers[self._reporters[d]] for d in range(len(parts))]

    def state_meta(self) -> dict[str, Any]:
        return {"layout": str(self.layout)}
