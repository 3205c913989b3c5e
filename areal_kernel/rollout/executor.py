"""The rollout executor: runs workflow episodes concurrently on an asyncio loop
in a background thread, under the staleness budget, and hands finished
groups to the trainer through a thread-safe queue."""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from areal_kernel.api.engine import InferenceEngine
from areal_kernel.api.io import Trajectory, TrajectoryGroup

# Trajectory.metadata key of a sample's own metrics: {name: number}; the
# trainer logs the mean over every finished sample as workflow/<name>.
# Defined with the workflow contract; public here too.
from areal_kernel.api.workflow import SAMPLE_METRICS_KEY, WorkflowProtocol
from areal_kernel.errors import ArealError
from areal_kernel.logging import get_logger
from areal_kernel.rollout.staleness import StalenessBudget
from areal_kernel.utils.aio import KernelEventLoop, close_loop

log = get_logger(__name__)


def zero_variance(group: TrajectoryGroup) -> bool:
    r = group.rewards
    return len(r) > 1 and max(r) - min(r) < 1e-9


@dataclass
class RolloutStats:
    admitted: int = 0
    accepted: int = 0
    rejected: int = 0
    accepted_unfiltered: int = 0
    failed: int = 0
    stale_dropped: int = 0
    latencies: list[float] = field(default_factory=list)
    # Rewards of every finished group, kept or filtered out: the model's real
    # sampling accuracy, which the (filtered) training batch over- or under-states.
    rewards: list[float] = field(default_factory=list)
    # Per-sample numbers workflows report in Trajectory.metadata["metrics"]
    # (every finished sample, like rewards), logged as workflow/<name> means.
    sample_metrics: dict[str, list[float]] = field(default_factory=dict)

    def add_sample_metrics(self, group: TrajectoryGroup) -> None:
        for t in group.trajectories:
            m = t.metadata.get(SAMPLE_METRICS_KEY) if isinstance(t.metadata, dict) else None
            if isinstance(m, dict):
                for k, v in m.items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        self.sample_metrics.setdefault(str(k), []).append(float(v))

    def snapshot_and_reset(self) -> dict[str, float]:
        lat, rew, per_sample = self.latencies, self.rewards, self.sample_metrics
        self.latencies, self.rewards, self.sample_metrics = [], [], {}
        return {
            **{f"workflow/{k}": sum(v) / len(v) for k, v in sorted(per_sample.items()) if v},
            "rollout/reward_mean": sum(rew) / len(rew) if rew else float("nan"),
            "rollout/admitted": self.admitted,
            "rollout/accepted": self.accepted,
            "rollout/rejected": self.rejected,
            "rollout/accepted_unfiltered": self.accepted_unfiltered,
            "rollout/failed": self.failed,
            "rollout/stale_dropped": self.stale_dropped,
            "rollout/latency_mean_s": sum(lat) / len(lat) if lat else 0.0,
            "rollout/latency_max_s": max(lat) if lat else 0.0,
        }


class RolloutExecutor:
    """``next_record()`` yields dataset records (``None`` when exhausted);
    ``workflow.arun_episode(engine, record)`` returns a ``TrajectoryGroup`` or
    ``None``; ``keep(group)`` says whether a group is worth training on (e.g.
    not all rewards equal); ``retry_budget`` bounds how many groups per
    training batch may be rejected before groups are accepted regardless, so a
    run never starves."""

    def __init__(
        self,
        engine: InferenceEngine,
        workflow: WorkflowProtocol,
        next_record: Callable[[], Any],
        *,
        batch_size: int,
        max_staleness: int,
        max_concurrent: int,
        keep: Callable[[TrajectoryGroup], bool] | None = None,
        retry_budget: int = 0,
        max_failures: int = 8,
    ) -> None:
        self.engine = engine
        self.workflow = workflow
        self.next_record = next_record
        self.budget = StalenessBudget(batch_size, max_staleness, max_concurrent)
        self.keep = keep
        self.retry_budget = retry_budget
        self.max_failures = max_failures
        self.stats = RolloutStats()
        self._version = 0
        # (admission number, group): batches are handed out in admission
        # order, so a batch's layout (and its float sums) does not depend on
        # which rollout happened to finish first.
        self._out: queue.Queue[tuple[int, TrajectoryGroup]] = queue.Queue()
        self._seq = 0
        self._rejected_since_batch = 0
        self._last_batch: list[tuple[int, TrajectoryGroup]] = []  # what give_back returns to the queue
        self._error: BaseException | None = None
        self._exhausted = False
        self._paused = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- controller side ---------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._thread_main, name="areal-rollout", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def set_version(self, version: int) -> None:
        self._version = version

    def pause(self) -> None:
        """Stop admitting new episodes (running ones continue)."""
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()

    @property
    def exhausted(self) -> bool:
        return self._exhausted and self.budget.running == 0 and self._out.empty()

    def drain(self, timeout: float | None = None) -> None:
        """Stop admitting and wait until no episode is running (finished ones
        wait in the queue): a quiescent point at which ``state_dict`` is exact."""
        self.pause()
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.budget.running > 0:
            if self._error is not None:
                raise self._error
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{self.budget.running} rollouts still running after {timeout}s")
            time.sleep(0.02)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly (call after ``drain``): the
        staleness accounting and the finished groups not yet trained on."""
        if self.budget.running:
            raise RuntimeError("RolloutExecutor.state_dict() needs drain() first: rollouts are running")
        with self._out.mutex:
            queued = list(self._out.queue)
        images: dict[str, list[str]] = {}
        return {
            "started": self.budget.started,
            "rejected_since_batch": self._rejected_since_batch,
            "exhausted": self._exhausted,
            "seq": self._seq,
            "queued": [{"seq": s, "group": _group_state(g, images)} for s, g in queued],
            # Image files of the queued trajectories, once per prompt (digest -> base64).
            "images": images,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict`` into an executor that has not started."""
        if self._thread is not None:
            raise RuntimeError("RolloutExecutor.load_state_dict() must be called before start()")
        self.budget.started = int(state["started"])
        self._rejected_since_batch = int(state["rejected_since_batch"])
        self._exhausted = bool(state["exhausted"])
        self._seq = int(state["seq"])
        cache: dict[str, Any] = {}
        for item in state["queued"]:
            g = item["group"]
            trajs = [Trajectory.from_state(t, state.get("images", {}), cache) for t in g["trajectories"]]
            self._out.put((int(item["seq"]), TrajectoryGroup(trajs, g.get("group_id", ""), g.get("sample_uid", ""))))

    def ready(self, n: int) -> bool:
        """Whether ``get_batch(n)`` would return (or raise) without waiting
        for a rollout: ``n`` finished groups are queued, or the executor
        failed or ran out of data. A hint: a queued group may still turn
        out too stale when taken."""
        return self._out.qsize() >= n or self._error is not None or self.exhausted

    def get_batch(
        self,
        n: int,
        timeout: float | None = None,
        stop: threading.Event | None = None,
        on_wait: Callable[[], None] | None = None,
    ) -> list[TrajectoryGroup]:
        """Block until ``n`` groups are ready (first finished first, returned in
        admission order). Raises if episodes keep failing or the data ran out
        before ``n`` groups. Returns ``[]`` once ``stop`` is set (an
        interrupted run); however it returns early, the groups it had taken
        go back to the front of the queue, so ``state_dict`` still holds them.
        ``on_wait`` is called about every half second while it waits, on the
        caller's thread (the fleet's tick: a server that joined gets its
        weights while the trainer has nothing else to do)."""
        groups: list[tuple[int, TrajectoryGroup]] = []
        try:
            got = self._collect(groups, n, timeout, stop, on_wait)
        finally:
            if len(groups) < n and groups:
                with self._out.mutex:
                    self._out.queue.extendleft(reversed(groups))
        if not got:
            return []
        self._rejected_since_batch = 0
        taken = sorted(groups, key=lambda x: x[0])
        self._last_batch = taken
        return [g for _, g in taken]

    def give_back(self) -> None:
        """Put the groups the last ``get_batch`` returned back at the front of
        the queue, in order, for a caller that took them but stops before
        training on them (an interrupt while it waits for another policy's
        batch): ``state_dict`` holds them again and the next ``get_batch``
        returns them. Once per batch; a no-op after that."""
        taken, self._last_batch = self._last_batch, []
        if taken:
            with self._out.mutex:
                self._out.queue.extendleft(reversed(taken))

    def _collect(
        self,
        groups: list[tuple[int, TrajectoryGroup]],
        n: int,
        timeout: float | None,
        stop: threading.Event | None,
        on_wait: Callable[[], None] | None = None,
    ) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        next_wait_call = time.monotonic() + 0.5
        while len(groups) < n:
            if on_wait is not None and time.monotonic() >= next_wait_call:
                on_wait()
                next_wait_call = time.monotonic() + 0.5
            if stop is not None and stop.is_set():
                return False
            if self._error is not None:
                raise self._error
            if self.exhausted:
                if self._error is not None:  # set by the loop thread since the check above
                    raise self._error
                raise ArealError(f"the dataset ran out: {len(groups)} of {n} groups for this batch")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout}s for {n} rollout groups, got {len(groups)}")
            try:
                seq, g = self._out.get(timeout=0.1)
            except queue.Empty:
                continue
            if self._too_stale(g):
                # Admission bounds staleness only in admission order; a slow
                # rollout can finish after later ones and reach the trainer a
                # version too late. Drop it and free its slot.
                self.stats.stale_dropped += 1
                loop = self._loop
                if loop is not None and loop.is_running():
                    loop.call_soon_threadsafe(self.budget.release)
                else:
                    self.budget.release()
                continue
            groups.append((seq, g))
        return True

    def _too_stale(self, group: TrajectoryGroup) -> bool:
        return any(t.staleness(self._version) > self.budget.max_staleness for t in group.trajectories)

    # -- event loop side -----------------------------------------------------------
    def _thread_main(self) -> None:
        # A KernelEventLoop: what workflows (agents) leave on it, tasks and
        # unclosed clients' connections, is ended before it closes.
        self._loop = KernelEventLoop()
        try:
            self._loop.run_until_complete(self._run())
        except BaseException as e:  # surfaced to the controller by get_batch
            self._error = e
        finally:
            try:
                close = getattr(self.engine, "aclose", None)
                if close is not None:
                    # Only this loop's sessions: other loops (the agent proxy's, an
                    # evaluation's) close their own, on their own loop.
                    self._loop.run_until_complete(close(current_loop_only=True))
            except Exception as e:
                log.warning("closing the inference client's sessions failed", error=f"{type(e).__name__}: {e}")
            close_loop(self._loop, "rollout executor")

    async def _run(self) -> None:
        tasks: set[asyncio.Task] = set()
        while not self._stop.is_set():
            # After a fatal error nothing more is admitted: the run ends on it, and
            # the records left are not burnt on episodes that would fail alike.
            if not self._paused.is_set() and not self._exhausted and self._error is None:
                for _ in range(self.budget.capacity(self._version)):
                    record = self.next_record()
                    if record is None:
                        self._exhausted = True
                        break
                    self.budget.admit()
                    self.stats.admitted += 1
                    self._seq += 1
                    tasks.add(asyncio.create_task(self._episode(record, self._seq)))
            if not tasks:
                await asyncio.sleep(0.01)
                continue
            _, tasks = await asyncio.wait(tasks, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _episode(self, record: Any, seq: int) -> None:
        t0 = time.monotonic()
        try:
            group = await self.workflow.arun_episode(self.engine, record)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.budget.finish(kept=False)
            self.stats.failed += 1
            log.warning("rollout episode failed", error=f"{type(e).__name__}: {e}")
            if self.stats.failed > self.max_failures:
                self._error = (
                    e
                    if isinstance(e, ArealError) or _from_plugin(e)
                    else ArealError(f"{self.stats.failed} rollout episodes failed; last error: {type(e).__name__}: {e}")
                )
            return
        self.stats.latencies.append(time.monotonic() - t0)
        if group is None:
            self.budget.finish(kept=False)
            self.stats.rejected += 1
            return
        self.stats.rewards.extend(group.rewards)
        self.stats.add_sample_metrics(group)
        if self.keep is not None and not self.keep(group):
            if self._rejected_since_batch < self.retry_budget * self.budget.batch_size:
                self._rejected_since_batch += 1
                self.budget.finish(kept=False)
                self.stats.rejected += 1
                return
            self.stats.accepted_unfiltered += 1
        if isinstance(record, dict) and record.get("_sample_uid") is not None:
            group.sample_uid = str(record["_sample_uid"])
        self.budget.finish(kept=True)
        self.stats.accepted += 1
        self._out.put((seq, group))


def _from_plugin(exc: Exception) -> bool:
    """Raised by plugin code (a workflow, or what it calls): surfaced as is,
    with its traceback, so the run can name the plugin (see plugins.blame)."""
    from areal_kernel.plugins.blame import blame

    try:
        return blame(exc) is not None
    except Exception:
        return False


def staleness_histogram(groups: list[TrajectoryGroup], version: int) -> dict[int, int]:
    hist: collections.Counter[int] = collections.Counter()
    for g in groups:
        for t in g.trajectories:
            hist[t.staleness(version)] += 1
    return dict(sorted(hist.items()))


def _group_state(g: TrajectoryGroup, images: dict[str, list[str]]) -> dict[str, Any]:
    return {
        "trajectories": [t.to_state(images) for t in g.trajectories],
        "group_id": g.group_id,
        "sample_uid": g.sample_uid,
    }
