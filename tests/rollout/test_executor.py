"""The rollout executor with a small test workflow (an ordinary user
workflow that needs no model): admission, filtering, failure budget."""
import asyncio
import threading
import time

import pytest

from areal_kernel.api.io import Trajectory, TrajectoryGroup
from areal_kernel.errors import ArealError
from areal_kernel.rollout.executor import RolloutExecutor, staleness_histogram, zero_variance


def group(rewards, version=0, gid="g"):
    trajs = [Trajectory([1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], [-1, version, version], r, group_id=gid) for r in rewards]
    return TrajectoryGroup(trajs, group_id=gid)


class CountingWorkflow:
    """Records how many episodes are running and how many ever started."""

    def __init__(self, rewards_for=lambda rec: [0.0, 1.0], delay=0.02, fail_for=lambda rec: False):
        self.started = 0
        self.running = 0
        self.max_running = 0
        self.rewards_for = rewards_for
        self.delay = delay
        self.fail_for = fail_for
        self.lock = threading.Lock()

    async def arun_episode(self, engine, record):
        with self.lock:
            self.started += 1
            self.running += 1
            self.max_running = max(self.max_running, self.running)
        try:
            await asyncio.sleep(self.delay)
            if self.fail_for(record):
                raise RuntimeError(f"episode {record} broke")
            return group(self.rewards_for(record), gid=str(record))
        finally:
            with self.lock:
                self.running -= 1


def records(n):
    it = iter(range(n))
    return lambda: next(it, None)


def wait_until(pred, timeout=5.0):
    t = time.monotonic() + timeout
    while time.monotonic() < t:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


def test_staleness_zero_is_synchronous():
    wf = CountingWorkflow()
    ex = RolloutExecutor(None, wf, records(100), batch_size=4, max_staleness=0, max_concurrent=64)
    ex.start()
    try:
        assert wait_until(lambda: ex.stats.accepted == 4)
        # The 0.2 s sleeps here are observation windows for admissions that
        # must NOT happen (there is no event for "nothing started"), not
        # synchronisation.
        time.sleep(0.2)
        assert wf.started == 4  # nothing beyond one batch before the update
        batch = ex.get_batch(4)
        assert len(batch) == 4
        time.sleep(0.2)
        assert wf.started == 4  # consuming is not enough: the version must move
        ex.set_version(1)
        assert wait_until(lambda: wf.started == 8)
        time.sleep(0.2)
        assert wf.started == 8
    finally:
        ex.stop()


def test_staleness_one_runs_one_batch_ahead_and_respects_concurrency():
    wf = CountingWorkflow(delay=0.05)
    ex = RolloutExecutor(None, wf, records(100), batch_size=4, max_staleness=1, max_concurrent=3)
    ex.start()
    try:
        assert wait_until(lambda: ex.stats.accepted == 8)
        time.sleep(0.2)  # an observation window: no ninth episode may start
        assert wf.started == 8
        assert wf.max_running <= 3
    finally:
        ex.stop()


def test_dynamic_filter_with_bounded_retries():
    # Every even record gives all-equal rewards (no signal).
    wf = CountingWorkflow(rewards_for=lambda r: [1.0, 1.0] if r % 2 == 0 else [0.0, 1.0])
    ex = RolloutExecutor(None, wf, records(100), batch_size=2, max_staleness=0, max_concurrent=8,
                         keep=lambda g: not zero_variance(g), retry_budget=4)
    ex.start()
    try:
        batch = ex.get_batch(2)
        assert all(not zero_variance(g) for g in batch)
        assert ex.stats.rejected >= 1
    finally:
        ex.stop()


def test_filter_budget_exhausted_accepts_rather_than_starves():
    wf = CountingWorkflow(rewards_for=lambda r: [1.0, 1.0])
    ex = RolloutExecutor(None, wf, records(100), batch_size=2, max_staleness=0, max_concurrent=8,
                         keep=lambda g: not zero_variance(g), retry_budget=1)
    ex.start()
    try:
        batch = ex.get_batch(2, timeout=10)
        assert len(batch) == 2
        assert ex.stats.rejected == 2  # retry_budget * batch_size
        assert ex.stats.accepted_unfiltered == 2
    finally:
        ex.stop()


def test_repeated_episode_failures_stop_with_a_clear_error():
    wf = CountingWorkflow(fail_for=lambda r: True)
    ex = RolloutExecutor(None, wf, records(100), batch_size=2, max_staleness=0, max_concurrent=2, max_failures=3)
    ex.start()
    try:
        with pytest.raises(ArealError, match="rollout episodes failed; last error: RuntimeError: episode"):
            ex.get_batch(2, timeout=10)
    finally:
        ex.stop()


def test_data_exhaustion_is_reported():
    ex = RolloutExecutor(None, CountingWorkflow(), records(3), batch_size=2, max_staleness=5, max_concurrent=8)
    ex.start()
    try:
        assert len(ex.get_batch(2)) == 2
        with pytest.raises(ArealError, match="the dataset ran out: 1 of 2 groups"):
            ex.get_batch(2, timeout=10)
    finally:
        ex.stop()


def test_staleness_histogram_counts_oldest_token():
    g = TrajectoryGroup([
        Trajectory([1, 2, 3], [0, 1, 1], [0.0] * 3, [-1, 0, 1], 1.0),
        Trajectory([1, 2, 3], [0, 1, 1], [0.0] * 3, [-1, 2, 2], 0.0),
    ])
    assert staleness_histogram([g], version=2) == {0: 1, 2: 1}


def test_a_rollout_that_finishes_too_late_is_dropped_not_trained():
    """Admission bounds staleness in admission order only: a slow episode
    admitted at version 0 that finishes after later ones would reach the
    trainer at version >= 2 with max_staleness 1. It must be dropped (and its
    slot freed), never handed out. The slow episode is held on an event the
    test sets once the trainer is 5 versions on, not on a longer sleep."""
    box = {}
    release = threading.Event()

    class SlowFirst:
        async def arun_episode(self, engine, record):
            v = box["ex"]._version  # stamped like a server would: the weights at generation time
            if record == 0:
                box["slow_started"] = True
                await asyncio.to_thread(release.wait, 60)
                assert release.is_set(), "the test never released the slow episode"
                box["slow_done"] = True
            return group([0.0, 1.0], version=v, gid=str(record))

    ex = RolloutExecutor(None, SlowFirst(), records(100), batch_size=2, max_staleness=1, max_concurrent=64)
    box["ex"] = ex
    ex.start()
    handed = []
    try:
        assert wait_until(lambda: "slow_started" in box)
        for v in range(5):
            batch = ex.get_batch(2, timeout=10)
            handed += [(g.group_id, max(t.staleness(v) for t in g.trajectories)) for g in batch]
            ex.set_version(v + 1)
        assert "slow_done" not in box  # still held: it finishes only now, 5 versions late
        release.set()
        assert wait_until(lambda: "slow_done" in box, timeout=30)  # the slow episode has finished
        for v in range(5, 10):
            if ex.stats.stale_dropped:
                break
            batch = ex.get_batch(2, timeout=10)
            handed += [(g.group_id, max(t.staleness(v) for t in g.trajectories)) for g in batch]
            ex.set_version(v + 1)
        assert ex.stats.stale_dropped == 1
        assert all(s <= 1 for _, s in handed), handed
        assert "0" not in [gid for gid, _ in handed]
        # The freed slot was given to another rollout: admissions continue.
        assert wait_until(lambda: ex.budget.started <= (1 + ex._version + 1) * 2)
    finally:
        release.set()  # a failed assertion must not leave the episode holding stop()
        ex.stop()


def test_get_batch_stopped_while_waiting_puts_its_groups_back_in_order():
    """An interrupted run stops waiting for a batch: get_batch returns [] and
    the groups it had already taken go back to the front of the queue, so a
    recovery checkpoint (state_dict) holds them and the next batch is the
    same one an uninterrupted run would have trained on."""
    release = threading.Event()

    class ThirdWaits(CountingWorkflow):
        async def arun_episode(self, engine, record):
            if record == 2:
                while not release.is_set():
                    await asyncio.sleep(0.01)
            return await super().arun_episode(engine, record)

    ex = RolloutExecutor(None, ThirdWaits(), records(3), batch_size=3, max_staleness=0, max_concurrent=8)

    class StopOnceTaken:
        """Set once get_batch has taken both finished groups (the queue is empty) and still waits for the third."""

        def is_set(self):
            return ex.stats.accepted == 2 and ex._out.empty()

    ex.start()
    try:
        assert ex.get_batch(3, stop=StopOnceTaken()) == []
        assert ex._out.qsize() == 2  # both back
        release.set()
        ex.drain()
        state = ex.state_dict()
        assert sorted(item["group"]["group_id"] for item in state["queued"]) == ["0", "1", "2"]
        assert [g.group_id for g in ex.get_batch(3)] == ["0", "1", "2"]
    finally:
        ex.stop()


def test_give_back_returns_the_last_batch_to_the_front_of_the_queue():
    """A joint step of several policies took this executor's batch, then was
    interrupted while waiting for another policy's: ``give_back`` puts the
    batch back in order, ``state_dict`` holds it, and the next ``get_batch``
    returns the same groups; a second ``give_back`` changes nothing."""
    ex = RolloutExecutor(None, CountingWorkflow(), records(4), batch_size=2, max_staleness=1, max_concurrent=8)
    ex.start()
    try:
        first = [g.group_id for g in ex.get_batch(2)]
        assert first == ["0", "1"]
        assert wait_until(lambda: ex._out.qsize() == 2)  # the next batch finished meanwhile
        ex.give_back()
        ex.give_back()
        ex.drain()
        assert [item["group"]["group_id"] for item in ex.state_dict()["queued"]] == ["0", "1", "2", "3"]
        assert [g.group_id for g in ex.get_batch(2)] == first
        assert [g.group_id for g in ex.get_batch(2)] == ["2", "3"]
    finally:
        ex.stop()
