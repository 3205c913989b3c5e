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
from typing import Any, Callable, Sequence

# The trainer's own reader of samples.jsonl, for the tests' comparisons.
from areal_kernel.trainer.recovery import read_samples
from areal_kernel.utils import prefork

__all__ = [
    "EXACT_SERVER",
    "assert_bit_equal",
    "check_policies_resume",
    "interrupt_after_step",
    "kill_after_checkpoint",
    "load_weights",
    "read_samples",
    "run_train",
    "trained_steps",
]


# The overrides that make a run's embedded server repeatable bit for bit: one
# sequence per forward, and every prompt prefilled whole. A row's logprobs
# (the loss's behaviour policy) then do not depend on which other rows shared
# its batch, nor on whether the prompts' shared prefix was in the server's
# cache; both follow timing and what the server saw before, and differ
# between a run and its resumption (whose server starts empty). Otherwise
# they differ in their last bits (measured 1e-8 to 1e-4 after a few steps).
# With them a resumed run ends bit for bit where the uninterrupted one did, so
# the recovery tests compare with ``torch.equal``.
EXACT_SERVER = ("rollout.embedded.max_batch_size=1", "rollout.embedded.prefix_cache=false")


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


def assert_bit_equal(got: dict[str, Any], want: dict[str, Any], what: str = "weight") -> None:
    """Every tensor of ``want`` in ``got``, equal bit for bit (a resumed run
    against an uninterrupted one); the first that is not is named with how
    far it is off."""
    import torch

    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for k, t in want.items():
        if not torch.equal(got[k], t):
            gap = float((got[k].double() - t.double()).abs().max())
            raise AssertionError(f"{what} {k} differs after the resume by up to {gap:.3g}")


def check_policies_resume(
    args_for: Callable[[str], list[str]],
    root: str,
    policies: Sequence[str],
    damage: Callable[[str], None] | None = None,
    checkpoint_step: int = 3,
) -> None:
    """A multi-policy run (``policies:``) killed with ``kill -9`` after global
    step 4 was trained but before its checkpoint (the newest is step
    ``checkpoint_step``'s: 3, or 2 where policies step together, two global
    steps at a time),
    then the same command (``recover: auto``), against an uninterrupted run:
    every step trains the same sample ids with the same adapter, and every
    policy's exported adapter ends bit for bit where the uninterrupted run's
    did, and training moved it.

    ``args_for(run_dir)``: the ``areal`` arguments of a 4-step run with two
    policies taking turns, recovery checkpoints every step (``save_every:
    1``), synchronous (``max_staleness: 0``) and seeded; the servers
    embedded ones, whose adapter updates cut no generation (checked), one
    row per forward, prompts prefilled whole (``EXACT_SERVER``: without it the adapters differ in
    their last bits, up to 4e-5 where ``lora_B`` moved by 0.12).

    ``damage(run_dir)``, for negative controls: called on the killed run's
    directory before the resume (to spoil its newest checkpoint, say); the
    check must then fail."""
    import json

    ref_dir, run_dir = os.path.join(root, "reference"), os.path.join(root, "killed")
    ref = run_train(args_for(ref_dir))
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    # An adapter's update interrupts that adapter's rows alone, and with
    # max_staleness 0 a policy has none running when its update lands: no
    # generation of either policy was cut.
    with open(os.path.join(ref_dir, "metrics.jsonl")) as f:
        cut = [json.loads(line).get("rollout/interruptions") for line in f if line.strip()]
    cut = [c for c in cut if c is not None]
    assert len(cut) == 8 and cut[-1] == 0, cut
    kill_after_checkpoint(args_for(run_dir), run_dir, step=checkpoint_step)
    assert not os.path.exists(os.path.join(run_dir, "result.json"))
    assert [s["step"] for s in read_samples(run_dir)] == [1, 2, 3, 4]  # step 4 trained after the checkpoint
    if damage is not None:
        damage(run_dir)

    resumed = run_train(args_for(run_dir))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resuming from step {checkpoint_step} " in resumed.stdout, resumed.stdout[-2000:]
    with open(os.path.join(run_dir, "result.json")) as f:
        result = json.load(f)
    assert result["resumed_from_step"] == checkpoint_step and result["steps"] == 8
    got, want = read_samples(run_dir), read_samples(ref_dir)
    assert [s["step"] for s in got] == list(range(1, 9))  # the killed run's step 4 was redone, not kept twice
    assert [(s["uids"], {x["adapter"] for x in s["samples"]}) for s in got] == [
        (s["uids"], {x["adapter"] for x in s["samples"]}) for s in want
    ]
    for name in policies:
        a = load_weights(os.path.join(ref_dir, "checkpoints", f"final-{name}"))
        b = load_weights(os.path.join(run_dir, "checkpoints", f"final-{name}"))
        assert set(a) == set(b) and a
        travel = max(float(t.abs().max()) for k, t in a.items() if "lora_B" in k)  # lora_B starts at 0
        gap = max(float((a[k] - b[k]).abs().max()) for k in a)
        print(f"\n{name}: resumed vs uninterrupted, largest difference {gap:.3g}; lora_B moved {travel:.3g}")
        assert travel > 1e-3, (name, travel)  # training moved the adapter, so equality below means something
        assert gap == 0, (name, gap, travel)
