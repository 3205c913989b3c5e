"""Recovery checkpoints of the RL trainer and the decision to resume.

A recovery checkpoint ``<run_dir>/recover/step<N>/`` (written atomically by
``areal_kernel.checkpoint``) holds:

- ``engine/``: the train engine's ``save_state`` (weights, optimizer, lr
  step, RNG states, version);
- ``critic/``: the value model's, when the estimator uses one;
- ``trainer_state.json``: the step, the data stream's position, the rollout
  executor's state (staleness accounting and the finished groups not yet
  trained on, in full), reward counters, the held-out accuracy measured
  before training, and the config the run was started with.

It is taken at a quiescent point (no rollout running: ``RolloutExecutor.drain``)
so that it is exact; the uninterrupted run drains at the same steps, which is
why a resumed run continues with exactly the state the uninterrupted one had.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from areal_kernel.api.io import SERVER_KEY, TrajectoryGroup
from areal_kernel.checkpoint import Checkpoint, CheckpointManager
from areal_kernel.errors import ConfigError
from areal_kernel.logging import get_logger

log = get_logger(__name__)

RECOVER_DIR = "recover"
STATE_FILE = "trainer_state.json"
STATE_FORMAT = 1
SAMPLES_FILE = "samples.jsonl"
# Testing aid, off unless set: hold the run after this step (see ``hold_after_step``).
HOLD_ENV = "AREAL_TEST_HOLD_AFTER_STEP"
HELD_MARKER = ".held-after-step{step}"

# Settings a resumed run may change without breaking exactness of what was
# already trained (how long to run, how to log, how to checkpoint, budgets).
_RESUMABLE_CHANGES = (
    "recover",
    "run_dir",
    "logging",
    "checkpoint",
    "scheduler",
    "trainer.max_steps",
    "trainer.eval_every",
    "trainer.eval_size",
    "trainer.max_skipped_steps",
    "reward.timeout_s",
    "reward.workers",
    "reward.max_failure_fraction",
    "rollout.restart",
    "rollout.max_server_restarts",
)


def recovery_manager(run_dir: str, keep_last: int) -> CheckpointManager:
    return CheckpointManager(os.path.join(run_dir, RECOVER_DIR), keep_last)


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Dotted config fields that differ and matter for an exact resume."""
    a, b = _flatten(saved), _flatten(current)
    changed = sorted(k for k in set(a) | set(b) if a.get(k, "<unset>") != b.get(k, "<unset>"))
    return [k for k in changed if not any(k.startswith(p) for p in _RESUMABLE_CHANGES)]


def read_state(ckpt: Checkpoint) -> dict[str, Any]:
    path = os.path.join(ckpt.path, STATE_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"recovery checkpoint {ckpt.path} is unreadable ({e}); delete it to resume from an older one"
        ) from None
    if state.get("format") != STATE_FORMAT:
        raise ConfigError(
            f"{path}: unsupported recovery format {state.get('format')!r} (this areal-kernel reads {STATE_FORMAT})"
        )
    return state


@dataclass(frozen=True)
class StartPlan:
    """Where a run starts: ``checkpoint`` and its trainer ``state`` when it
    resumes, else ``None`` and ``reason``, the sentence saying why it starts
    at step 0 (printed for the user)."""

    checkpoint: Checkpoint | None
    state: dict[str, Any] | None
    reason: str


def plan_start(cfg: Any, run_dir: str) -> StartPlan:
    """Resume from the newest complete recovery checkpoint, or start at step 0
    (and say why). Refuses (``ConfigError``) rather than overwrite an
    unfinished run's checkpoints or resume one with a different config."""
    mgr = recovery_manager(run_dir, cfg.checkpoint.keep_last)
    gone = mgr.discard_partials()
    if gone:
        log.info("removed partial recovery checkpoints of a killed save", paths=gone)
    latest = mgr.latest()
    if latest is None:
        earlier = any(os.path.exists(os.path.join(run_dir, n)) for n in ("metrics.jsonl", SAMPLES_FILE, "config.yaml"))
        if not earlier:
            return StartPlan(None, None, f"a new run in {run_dir}")
        if cfg.recover == "off":
            return StartPlan(None, None, f"recover: off ({run_dir} holds no recovery checkpoint either)")
        return StartPlan(
            None,
            None,
            f"no recovery checkpoint in {mgr.root} (the earlier run in {run_dir} stopped before writing one"
            + (", and wrote it only partly" if gone else "")
            + ")",
        )
    finished = os.path.isfile(os.path.join(run_dir, "result.json"))
    if finished:
        # The run that wrote these completed (its HF checkpoint is the result):
        # its recovery checkpoints cannot be resumed and would confuse a new run.
        log.info("run_dir holds a completed run; starting a new one", run_dir=run_dir, removed=mgr.root)
        shutil.rmtree(mgr.root, ignore_errors=True)
        return StartPlan(
            None, None, f"{run_dir} holds a completed run (result.json); its recovery checkpoints were removed"
        )
    if cfg.recover == "off":
        raise ConfigError(
            f"recover: off, but {run_dir} holds an unfinished run (recovery checkpoint {latest.path}); starting over "
            f"would overwrite it. Resume it with recover=auto, or use another run_dir (or delete {mgr.root})"
        )
    state = read_state(latest)
    changed = config_changes(state.get("config", {}), cfg.dump())
    if changed:
        shown = ", ".join(changed[:6]) + (" ..." if len(changed) > 6 else "")
        raise ConfigError(
            f"cannot resume {latest.path}: the config differs from the interrupted run's in {shown}. "
            f"Restore those fields to resume, or start a new run in another run_dir (or with recover=off after deleting {mgr.root})"
        )
    return StartPlan(latest, state, f"resuming from step {latest.step} (recovery checkpoint {latest.path})")


def set_aside_logs(run_dir: str, names: tuple[str, ...]) -> list[str]:
    """A run starting at step 0 in a run_dir that holds an earlier run's logs:
    rename each ``name`` to ``name.prev`` (replacing an older ``.prev``), so
    the two runs' lines do not mix. Returns the names moved."""
    moved = []
    for name in names:
        path = os.path.join(run_dir, name)
        if os.path.exists(path):
            os.replace(path, path + ".prev")
            moved.append(name)
    return moved


def truncate_jsonl(path: str, max_step: int) -> int:
    """Keep only the records of ``path`` with ``step <= max_step`` (and drop a
    line torn by a kill); rewritten atomically. Returns the lines dropped."""
    if not os.path.isfile(path):
        return 0
    kept, dropped = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                dropped += 1
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] > max_step:
                dropped += 1
                continue
            kept.append(line if line.endswith("\n") else line + "\n")
    if dropped:
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return dropped


class SamplesLog:
    """``<run_dir>/samples.jsonl``: the sample ids trained at each step (one
    line per step, flushed): the record of what the run trained on. Each
    line: ``step``, ``version`` (the weights the step produced), ``uids``
    (one per prompt group) and ``samples``, one entry per trained sequence
    with its provenance (``provenance``)."""

    def __init__(self, run_dir: str) -> None:
        self.path = os.path.join(run_dir, SAMPLES_FILE)
        self._f = open(self.path, "a", encoding="utf-8")

    def log(self, step: int, version: int, uids: list[str], samples: list[dict[str, Any]] | None = None) -> None:
        line: dict[str, Any] = {"step": step, "version": version, "uids": uids}
        if samples is not None:
            line["samples"] = samples
        self._f.write(json.dumps(line) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def provenance(groups: list[TrajectoryGroup]) -> list[dict[str, Any]]:
    """Per trained sequence: its group's ``uid``, ``sample`` id, ``reward``,
    the weight ``versions`` of its generated tokens (distinct, ascending;
    several when a generation was interrupted by an update), the ``server``
    that generated it (``Trajectory.metadata[SERVER_KEY]``; null when the
    workflow did not record it), ``adapter`` when the workflow recorded one,
    and ``tokens`` (generated)."""
    out: list[dict[str, Any]] = []
    for g in groups:
        for t in g.trajectories:
            entry: dict[str, Any] = {
                "uid": g.sample_uid,
                "sample": t.sample_id,
                "reward": t.reward,
                "versions": sorted({v for v, m in zip(t.versions, t.loss_mask) if m}),
                "server": t.metadata.get(SERVER_KEY),
                "tokens": sum(1 for m in t.loss_mask if m),
            }
            if "adapter" in t.metadata:
                entry["adapter"] = t.metadata["adapter"]
            out.append(entry)
    return out


def read_samples(run_dir: str) -> list[dict[str, Any]]:
    """``<run_dir>/samples.jsonl``: one ``{"step", "version", "uids", ...}`` per trained step."""
    with open(os.path.join(run_dir, SAMPLES_FILE), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def hold_step_from_env() -> int | None:
    """The step named by ``AREAL_TEST_HOLD_AFTER_STEP`` (a testing aid), or
    None when it is unset or empty: production runs never hold."""
    raw = os.environ.get(HOLD_ENV, "").strip()
    if not raw:
        return None
    try:
        step = int(raw)
    except ValueError:
        step = 0
    if step < 1:
        raise ConfigError(f"{HOLD_ENV}={raw!r}: expected a step number >= 1 (a testing aid; unset it for real runs)")
    return step


PAUSE_ENV = "AREAL_TEST_PAUSE_AFTER_STEPS"
PAUSED_MARKER = ".paused-after-step{step}"


def pause_steps_from_env() -> set[int]:
    """The steps named by ``AREAL_TEST_PAUSE_AFTER_STEPS`` (``"3,6"``; a
    testing aid), empty when unset: production runs never pause."""
    raw = os.environ.get(PAUSE_ENV, "").strip()
    if not raw:
        return set()
    try:
        steps = {int(x) for x in raw.split(",") if x.strip()}
    except ValueError:
        steps = {0}
    if any(s < 1 for s in steps):
        raise ConfigError(f"{PAUSE_ENV}={raw!r}: expected step numbers >= 1 like '3,6' (a testing aid)")
    return steps


def pause_after_step(run_dir: str, step: int, tick: Callable[[], None] | None) -> None:
    """Testing aid for fleet tests: once step ``step`` is logged, create
    ``<run_dir>/.paused-after-step<step>`` and wait until the test removes
    it, running the fleet's ``tick`` meanwhile (a server the test adds or
    drains then joins or leaves before the next step, at a known point)."""
    marker = os.path.join(run_dir, PAUSED_MARKER.format(step=step))
    log.warning("%s: pausing after step %d until %s is removed (testing aid)", PAUSE_ENV, step, marker)
    with open(marker, "w") as f:
        f.write(f"{os.getpid()}\n")
    while os.path.exists(marker):
        if tick is not None:
            tick()
        time.sleep(0.1)


def hold_after_step(run_dir: str, step: int) -> None:
    """Testing aid for kill-and-resume tests: once step ``step`` is logged
    (metrics and ``samples.jsonl``) and before its checkpoint could be
    written, create ``<run_dir>/.held-after-step<step>`` and block this
    thread for good, so the test SIGKILLs the run at a known point instead of
    racing a poll against the checkpoint writer. Called only when
    ``AREAL_TEST_HOLD_AFTER_STEP`` names this step."""
    log.warning("%s=%d: holding the run after step %d until it is killed (testing aid)", HOLD_ENV, step, step)
    with open(os.path.join(run_dir, HELD_MARKER.format(step=step)), "w") as f:
        f.write(f"{os.getpid()}\n")
    threading.Event().wait()  # never set: only the test's kill ends the process
