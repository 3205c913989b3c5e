"""Helpers to test exact recovery of real ``areal train`` runs (used by the
kernel's and the plugins' tests; a train-engine plugin can prove with them
that a killed run resumes exactly)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

# The trainer's own reader of samples.jsonl, for the tests' comparisons.
from areal_kernel.trainer.recovery import read_samples
from areal_kernel.utils import prefork

__all__ = [
    "interrupt_after_step",
    "kill_after_checkpoint",
    "load_weights",
    "read_samples",
    "run_train",
    "trained_steps",
]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def run_train(args: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    """``areal <args>`` in a fresh process, output captured."""
    return prefork.run(
        [sys.executable, "-m", "areal_kernel.cli", *args], capture_output=True, text=True, env=_env(), timeout=timeout
    )


def kill_after_checkpoint(args: list[str], run_dir: str, step: int, timeout: float = 600) -> str:
    """Start ``areal <args>`` held after step ``step + 1`` (the trainer's
    ``AREAL_TEST_HOLD_AFTER_STEP`` testing aid: that step is trained and
    logged, its checkpoint not yet written), and SIGKILL its whole process
    group once it holds there. So recovery checkpoint ``step`` is the newest
    one whatever the timing, and the work of step ``step + 1`` is lost.
    Needs checkpoints at ``step`` (``checkpoint.save_every`` dividing it).
    Returns the run's output so far."""
    from areal_kernel.trainer.recovery import HELD_MARKER, HOLD_ENV

    held = step + 1
    marker = os.path.join(run_dir, HELD_MARKER.format(step=held))
    proc = prefork.popen(
        [sys.executable, "-m", "areal_kernel.cli", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**_env(), HOLD_ENV: str(held)},
        start_new_session=True,
    )  # fmt: skip
    # The output goes to a file-like pipe a thread drains, so a chatty run
    # cannot block on a full pipe before it reaches the hold.
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(proc.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reached = _wait_for_file(marker, proc, timeout)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    reader.join(30)
    if proc.stdout:
        proc.stdout.close()
    out = "".join(chunks)
    if os.path.exists(marker):
        os.unlink(marker)  # leave the run dir as a plain killed run leaves it
    if not reached:
        raise AssertionError(f"the run never held after step {held} (rc {proc.returncode}):\n{out[-3000:]}")
    if not os.path.isfile(os.path.join(run_dir, "recover", f"step{step}", "COMPLETE")):
        raise AssertionError(f"the run held after step {held} without recovery checkpoint {step}:\n{out[-3000:]}")
    return out


def trained_steps(run_dir: str) -> list[int]:
    """The steps ``metrics.jsonl`` has a training line for (a line torn by a kill is skipped)."""
    from areal_kernel.report.rundir import METRICS_FILE, STEP_KEY, read_jsonl

    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        return []
    return [int(rec["step"]) for rec in read_jsonl(path).rows if STEP_KEY in rec]


def interrupt_after_step(
    args: list[str], run_dir: str, step: int, sig: int = signal.SIGINT, timeout: float = 600
) -> subprocess.CompletedProcess:
    """Start ``areal <args>``; once ``metrics.jsonl`` has the line of step
    ``step``, send ``sig`` to its process group (as Ctrl-C in a terminal
    does) and wait for it to exit (SIGKILL past ``timeout``). Returns the
    exit code and the output (stdout and stderr together)."""
    proc = prefork.popen(
        [sys.executable, "-m", "areal_kernel.cli", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + timeout
    reached = False
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if step in trained_steps(run_dir):
                reached = True
                os.killpg(proc.pid, sig)
                break
            time.sleep(0.05)
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        raise AssertionError(f"the run did not exit within {timeout}s of its start:\n{out[-3000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    if not reached:
        raise AssertionError(f"the run never reached step {step} (rc {proc.returncode}):\n{out[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def _wait_for_file(path: str, proc: subprocess.Popen, timeout: float) -> bool:
    """Wait until ``path`` exists (True), or ``proc`` ends or ``timeout``
    passes (False). Polls the file system: the marker is the event."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            return True
        if proc.poll() is not None:
            return os.path.exists(path)
        time.sleep(0.05)
    return False


def load_weights(directory: str) -> dict[str, Any]:
    """Every tensor of the ``*.safetensors`` files in ``directory``."""
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out
