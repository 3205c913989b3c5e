"""The kernel's rank plumbing (``areal_kernel.engine.ranks``) with real rank
processes started by the local scheduler and a real gloo process group.

The engine here is the smallest one that can show the shutdown rule: its
construction leaves behind what some libraries leave in a rank (a thread that
never ends and an ``atexit`` handler that blocks). A rank must still end by
itself, with code 0, once the controller says ``shutdown``."""

from __future__ import annotations

import os
import textwrap

import pytest

from areal_kernel.config.models import ExperimentConfig
from areal_kernel.plugins import get_registry
from areal_kernel.config import resolve
from areal_kernel.engine.ranks import RankGroup
from areal_kernel.scheduling.local import LocalScheduler
from areal_kernel.testing.procs import wait_gone

RANK_MODULE = '''
import atexit
import subprocess
import sys
import threading
import time

from areal_kernel.engine.ranks import rank_main


class Sticky:
    """Leaves a non-daemon thread, a blocking exit handler and a child
    process (as a library's worker would be) behind."""

    def __init__(self, rank, world_size, tag):
        self.rank, self.world_size, self.tag = rank, world_size, tag
        threading.Thread(target=time.sleep, args=(10**6,), daemon=False).start()
        atexit.register(time.sleep, 10**6)
        self.child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(10**6)"])

    def child_pid(self):
        return self.child.pid

    def whoami(self):
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)  # the ranks really share one process group
        return (self.tag, self.rank, self.world_size, float(t.item()))


def main(argv=None):
    return rank_main(lambda rank, world_size, tag: Sticky(rank, world_size, tag), "sticky", argv)


if __name__ == "__main__":
    raise SystemExit(main())
'''


@pytest.fixture
def group(tmp_path):
    (tmp_path / "sticky_rank.py").write_text(textwrap.dedent(RANK_MODULE))
    cfg = resolve(ExperimentConfig.model_validate({"actor": {"backend": "torch:d2"}}), get_registry())
    # Not the group's own scheduler: its stop() would end the ranks' process
    # groups, children included, and hide whether a rank ends its own.
    sched = LocalScheduler(cfg)
    g = RankGroup(
        "sticky", "sticky_rank", 2, sched, str(tmp_path / "logs"), startup_timeout_s=120, pythonpath=[str(tmp_path)]
    )
    yield g
    g.stop()
    sched.stop()


def test_ranks_run_commands_and_exit_by_themselves_despite_what_the_engine_left(group):
    group.start()
    group.call("create", [{"tag": "a"}, {"tag": "b"}])
    assert group.call("whoami") == [("a", 0, 2, 3.0), ("b", 1, 2, 3.0)]
    children = group.call("child_pid")
    procs = list(group.procs)
    group.shutdown(timeout_s=60)
    # 0 is the rank's own exit; a rank the group had to kill reports -9.
    codes = [p.poll() for p in procs]
    logs = {r: open(os.path.join(group.log_dir, f"rank-{r}.log")).read()[-2000:] for r in range(2)}
    assert codes == [0, 0], (codes, logs)
    # The ranks' own child processes went with them.
    assert [pid for pid in children if not wait_gone(pid, 10)] == []


def test_an_engine_outside_a_run_holds_devices_for_its_ranks_alone(monkeypatch):
    """An engine used on its own (no run: no inference servers) builds a
    scheduler that places its ranks alone: ``fsdp:d1`` fits a one-GPU machine.
    In a run, the servers' devices count too and the same machine is one clear
    error. (Found on an H200: the throughput check's ``fsdp:d1`` was refused
    as needing two devices.)"""
    from areal_kernel.api.scheduler import ACTOR, SchedulerContext
    from areal_kernel.errors import ArealError
    from areal_kernel.platforms.base import Platform

    class OneDevice(Platform):  # an accelerator platform with one device, to plan against
        name = "onedevice"
        device_type = "cpu"
        dist_backend = "gloo"
        visible_devices_env = "ONEDEVICE_VISIBLE_DEVICES"

        @property
        def exclusive_devices(self) -> bool:  # devices of its own, computing on the host
            return True

        def device_count(self) -> int:
            return 1

    monkeypatch.setattr("areal_kernel.platforms.current_platform", lambda: OneDevice())
    cfg = resolve(ExperimentConfig.model_validate({"actor": {"backend": "torch:d1"}}), get_registry())
    assert OneDevice().exclusive_devices
    alone = get_registry().build("scheduler", "local", SchedulerContext(name="local", config=cfg, roles=(ACTOR,)))
    assert alone.device_plan() == {"actor": [[0]], "rollout": []}
    in_a_run = get_registry().build("scheduler", "local", SchedulerContext(name="local", config=cfg))
    with pytest.raises(ArealError, match="needs 2 cpu devices"):
        in_a_run.device_plan()
