"""``RankedTrainEngine``'s own controller-side logic, without rank processes.

The rank traffic itself is covered by the fsdp and megatron plugin suites
(real ranks); here: the errors before ``initialize``, the scheduler choice,
and how a batch is split into data-parallel parts."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import Field

from areal_kernel.api.io import Trajectory, TrajectoryBatch
from areal_kernel.engine.config import TorchEngineConfig
from areal_kernel.engine.ranked import RankedTrainEngine
from areal_kernel.errors import ArealError, ConfigError


class ToySettings(TorchEngineConfig):
    startup_timeout_s: float = Field(300.0, gt=0)
    dist_timeout_s: float = Field(1800.0, gt=0)
    export_shard_mb: int = Field(1024, ge=1)


class ToyEngine(RankedTrainEngine):
    engine_name = "toy"
    rank_module = "areal_kernel"  # never started here
    save_state_command = "save_toy"
    load_state_command = "load_toy"

    def __init__(self, settings: dict[str, Any] | None = None, world_size: int = 2, *, scheduler: Any = None) -> None:
        super().__init__(ToySettings.model_validate(settings or {}), world_size, scheduler=scheduler)


def _batch(lengths: list[int], groups: list[str] | None = None) -> TrajectoryBatch:
    return TrajectoryBatch([
        Trajectory(list(range(n)), [0] * n, [0.0] * n, [-1] * n, 0.0, group_id=(groups or [""] * len(lengths))[i])
        for i, n in enumerate(lengths)
    ])  # fmt: skip


def test_calls_before_initialize_name_the_engine_and_the_fix():
    e = ToyEngine()
    for call in (lambda: e.call_ranks("full_weights"), e.weight_transfer_meta, lambda: e.save_state("unused")):
        with pytest.raises(
            ArealError, match=r"ToyEngine is not initialized: call initialize\(model_path, total_train_steps\)"
        ):
            call()
    assert e.ranks is None
    e.destroy()  # nothing started: a no-op that does not raise


def test_a_scheduler_that_cannot_start_ranks_is_refused_by_name():
    class NoRanks:
        pass

    e = ToyEngine(scheduler=NoRanks())
    with pytest.raises(
        ConfigError, match="scheduler.type: scheduler 'NoRanks' cannot start train-engine ranks.*the toy engine"
    ):
        e.rank_scheduler()


def test_the_runs_scheduler_is_used_and_not_owned():
    class Sched:
        def start_train_ranks(self, argv: list[str], log_dir: str, env: dict[str, str]) -> list[Any]:
            raise AssertionError("not started here")

    sched = Sched()
    e = ToyEngine(scheduler=sched)
    assert e.rank_scheduler() is sched and not e.owns_scheduler
    group = e.make_rank_group()
    assert group.scheduler is sched and not group.owns_scheduler and group.world_size == 2
    assert group.module == "areal_kernel" and group.name == "toy" and not group.started


def test_parts_are_balanced_by_tokens_largest_first():
    e = ToyEngine(world_size=2)
    # 9 -> part 0, 7 -> part 1, 5 -> part 1 (7 < 9), 3 -> part 0 (9 < 12)
    assert e.partition(_batch([3, 9, 5, 7])) == [[0, 1], [2, 3]]
    # fewer sequences than parts: a part may stay empty
    assert ToyEngine(world_size=3).partition(_batch([4, 4])) == [[0], [1], []]


def test_shared_prompts_keep_groups_together_when_there_are_enough_groups():
    e = ToyEngine({"share_prompts": True}, world_size=2)
    assert e.partition(_batch([5, 1, 5, 1], ["a", "b", "a", "b"])) == [[0, 2], [1, 3]]
    # one group for two parts: split per sequence instead, or a part would idle
    assert e.partition(_batch([5, 1, 5, 1], ["a", "a", "a", "a"])) == [[0, 1], [2, 3]]
