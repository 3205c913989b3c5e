"""Helpers to test exact recovery of real ``areal train`` runs (used by the
kernel's and the plugins' tests; a train-engine plugin can prove with them
that a killed run resumes exactly)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def run_train(args: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    """``areal <args>`` in a fresh process, output captured."""
    return subprocess.run(
        [sys.executable, "-m", "areal_kernel.cli", *args], capture_output=True, text=True, env=_env(), timeout=timeout
    )


def kill_after_checkpoint(args: list[str], run_dir: str, step: int, timeout: float = 600) -> str:
    """Start ``areal <args>``; once recovery checkpoint ``step`` is complete
    and step ``step + 1`` has trained (so work after the checkpoint is lost),
    SIGKILL its whole process group. Returns the run's output so far."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal_kernel.cli", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), start_new_session=True,
    )  # fmt: skip
    marker = os.path.join(run_dir, "recover", f"step{step}", "COMPLETE")
    samples = os.path.join(run_dir, "samples.jsonl")
    deadline = time.monotonic() + timeout
    reached = False
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if os.path.isfile(marker) and os.path.isfile(samples):
                with open(samples) as f:
                    if sum(1 for _ in f) >= step + 1:
                        reached = True
                        break
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        out = proc.stdout.read() if proc.stdout else ""
        if proc.stdout:
            proc.stdout.close()
    if not reached:
        raise AssertionError(
            f"the run never reached checkpoint {step} + one step (rc {proc.returncode}):\n{out[-3000:]}"
        )
    return out


def trained_steps(run_dir: str) -> list[int]:
    """The steps ``metrics.jsonl`` has a training line for (a line torn by a kill is skipped)."""
    steps = []
    try:
        with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and "perf/step_s" in rec:
                    steps.append(int(rec["step"]))
    except FileNotFoundError:
        pass
    return steps


def interrupt_after_step(
    args: list[str], run_dir: str, step: int, sig: int = signal.SIGINT, timeout: float = 600
) -> subprocess.CompletedProcess:
    """Start ``areal <args>``; once ``metrics.jsonl`` has the line of step
    ``step``, send ``sig`` to its process group (as Ctrl-C in a terminal
    does) and wait for it to exit (SIGKILL past ``timeout``). Returns the
    exit code and the output (stdout and stderr together)."""
    proc = subprocess.Popen(
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


def read_samples(run_dir: str) -> list[dict[str, Any]]:
    """``samples.jsonl``: one ``{"step", "version", "uids"}`` per trained step."""
    with open(os.path.join(run_dir, "samples.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def load_weights(directory: str) -> dict[str, Any]:
    """Every tensor of the ``*.safetensors`` files in ``directory``."""
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out
