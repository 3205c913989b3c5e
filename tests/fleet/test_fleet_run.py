"""An elastic rollout fleet through a real ``areal train`` (docs/elastic.md).

One GRPO run with ``weight_update.mode: broadcast`` (weights in memory over
gloo every step) starts with one embedded server of its own (A), and while
it trains:

- after step 3, a second server (B, started by the test outside the run) is
  announced with ``areal fleet add``; the run brings it to the current
  weights over a weight group of the trainer and B alone, then admits
  rollouts to it. The same pause also sends the bad requests a user can
  make: a duplicate add, an unreachable address, a server of another model,
  a request without the run's token: each answered with one line, the run
  goes on;
- after step 5, A is killed with SIGKILL: the supervisor restarts it, and
  the fleet re-forms the weight group with the new process and sends it the
  weights; it is not a fatal error as it was before;
- after step 8, A is drained with ``areal fleet drain`` and released (its
  process stopped); draining B, the last server, is refused.

Checked: every step's batch is full and no sample id repeats; the weight
delivery check (``monitor.weights.action: error``) ran on both servers
after every update while both were in (a mismatch would have stopped the
run); the counters (joins, drains, restarts, group re-forms); and the run
learns as the fixed fleet does: the tiny model's ``char_share`` reward in
steps 9-12 clears ``TINY_CHARS``'s bar, which fixed-fleet runs of the same
task clear and their ``lr=0`` controls do not (areal_kernel.testing.learning).

The steps are fixed by a testing aid: ``AREAL_TEST_PAUSE_AFTER_STEPS``
makes the trainer wait after those steps (running the fleet's tick) until
the test removes a marker file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from areal_kernel.testing.learning import TINY_CHARS, TINY_LR, TINY_OVERRIDES, step_rows
from areal_kernel.utils import prefork

os.environ.setdefault("OMP_NUM_THREADS", "1")

pytestmark = pytest.mark.slow

STEPS = 12
BATCH = 4
SAMPLES = 8


def _status(areal: Callable[..., subprocess.CompletedProcess], run_dir: str) -> dict:
    proc = areal("fleet", "status", run_dir, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _wait_paused(run_dir: str, step: int, proc: subprocess.Popen, timeout: float = 300) -> Path:
    marker = Path(run_dir) / f".paused-after-step{step}"
    deadline = time.monotonic() + timeout
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"the run did not pause after step {step} (rc {proc.poll()}):\n{out[-4000:]}")
        time.sleep(0.1)
    return marker


def _wait_state(
    areal: Callable[..., subprocess.CompletedProcess], run_dir: str, address: str, state: str, timeout: float = 120
) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = _status(areal, run_dir)
        found = {s["address"]: s for s in st["servers"]}
        if address in found and found[address]["state"] == state:
            return found[address]
        assert time.monotonic() < deadline, f"{address} never became {state}: {st}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """The run's model (tiny random Llama, byte-level tokenizer) and another
    one (three layers instead of two) that must not join."""
    from areal_kernel.models.tiny import make_tiny_byte_chat_llama

    root = tmp_path_factory.mktemp("fleet-models")
    return make_tiny_byte_chat_llama(root / "run"), make_tiny_byte_chat_llama(root / "other", layers=3)


def test_servers_join_restart_and_leave_a_broadcast_run(
    models: tuple[str, str], tmp_path: Path, run_areal: Callable[..., subprocess.CompletedProcess]
) -> None:
    from areal_kernel.inference.embedded.launcher import EmbeddedLauncher, EmbeddedServerConfig

    model, other_model = models
    run_dir = str(tmp_path / "run")
    outside = EmbeddedLauncher(EmbeddedServerConfig(dtype="float32"), run_dir=str(tmp_path / "outside"))
    try:
        b_addr, other_addr = (
            outside.launch(model, n_servers=1, devices_per_server=0)[0].address,
            outside.launch(other_model, n_servers=1, devices_per_server=0)[0].address,
        )
        args = [
            "train", "grpo_arithmetic", f"model.path={model}", f"run_dir={run_dir}", f"trainer.max_steps={STEPS}",
            f"trainer.batch_size={BATCH}", f"rollout.gconfig.n_samples={SAMPLES}", "trainer.eval_size=0",
            "logging.sinks=[jsonl]", *TINY_OVERRIDES, f"actor.torch.lr={TINY_LR}", "weight_update.mode=broadcast",
            "monitor.weights.action=error", "algorithm.dynamic_filter=false", "rollout.drain_timeout_s=5",
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "AREAL_TEST_PAUSE_AFTER_STEPS": "3,5,8"}
        proc = prefork.popen(
            [sys.executable, "-m", "areal_kernel.cli", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
        )  # fmt: skip
        try:
            # -- after step 3: B joins; bad requests are refused, the run goes on
            marker = _wait_paused(run_dir, 3, proc)
            (a_addr,) = [s["address"] for s in _status(run_areal, run_dir)["servers"]]
            added = run_areal("fleet", "add", run_dir, b_addr, "--wait", "60")
            assert added.returncode == 0, added.stderr
            b = _wait_state(run_areal, run_dir, b_addr, "active")
            assert b["owner"] == "added" and b["weight_version"] == 3, b
            refusals = {
                "duplicate": (run_areal("fleet", "add", run_dir, b_addr), "already in the fleet"),
                "unreachable": (run_areal("fleet", "add", run_dir, "127.0.0.1:9"), "does not answer"),
                "another model": (run_areal("fleet", "add", run_dir, other_addr), "num_hidden_layers: 3"),
                "bad address": (run_areal("fleet", "add", run_dir, "nowhere"), "expected host:port"),
                "no token": (
                    run_areal("fleet", "status", run_dir, "--token", "wrong"),
                    "needs 'Authorization: Bearer <the run's token>'",
                ),
                "unknown server": (run_areal("fleet", "drain", run_dir, "127.0.0.1:1"), "is not in the fleet"),
            }
            for what, (res, words) in refusals.items():
                lines = res.stderr.strip().splitlines()
                assert res.returncode != 0 and len(lines) == 1 and words in lines[0], (what, res.stderr)
            marker.unlink()

            # -- after step 5: A killed; restarted and given the weights through the group
            marker = _wait_paused(run_dir, 5, proc)
            (a_before,) = [s for s in _status(run_areal, run_dir)["servers"] if s["address"] == a_addr]
            os.killpg(a_before["pid"], signal.SIGKILL)
            deadline = time.monotonic() + 120
            while True:  # a new process, active, at the current version
                (a,) = [s for s in _status(run_areal, run_dir)["servers"] if s["address"] == a_addr]
                if a["pid"] != a_before["pid"] and a["state"] == "active":
                    break
                assert time.monotonic() < deadline, f"A never came back: {a}"
                time.sleep(0.2)
            assert a["weight_version"] == 5, a
            marker.unlink()

            # -- after step 8: A drained and released; B, the last one, cannot go
            marker = _wait_paused(run_dir, 8, proc)
            drained = run_areal("fleet", "drain", run_dir, a_addr, "--wait", "60")
            assert drained.returncode == 0, drained.stderr
            last = run_areal("fleet", "drain", run_dir, b_addr)
            assert last.returncode != 0 and "fewer than the minimum 1" in last.stderr, last.stderr
            st = _status(run_areal, run_dir)
            assert [s["address"] for s in st["servers"]] == [b_addr], st
            marker.unlink()

            out, _ = proc.communicate(timeout=600)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
        assert proc.returncode == 0, out[-4000:]
    finally:
        outside.stop()

    steps = step_rows(run_dir)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    # Every batch full; no sample id trained twice.
    assert all(r["batch/sequences"] == BATCH * SAMPLES for r in steps), [r["batch/sequences"] for r in steps]
    with open(os.path.join(run_dir, "samples.jsonl"), encoding="utf-8") as f:
        logged = [json.loads(line) for line in f]
    uids = [u for rec in logged for u in rec["uids"]]
    assert len(uids) == STEPS * BATCH and len(set(uids)) == len(uids)
    # Who generated what: A alone before B joined, B among steps 4-8, B alone
    # once A's last rollouts (started before its drain) are trained.
    served = {rec["step"]: {s["server"] for s in rec["samples"]} for rec in logged}
    assert all(served[k] == {a_addr} for k in (1, 2, 3)), served
    assert b_addr in set().union(*(served[k] for k in range(4, 9))), served
    assert served[11] == served[12] == {b_addr}, served
    # Both servers verified after every update while both were in; one after A left.
    servers = [int(r["monitor/weights_servers"]) for r in steps]
    assert servers[:3] == [1, 1, 1] and servers[3:8] == [2] * 5 and servers[8:] == [1] * 4, servers
    assert all(r["monitor/weights_mismatch"] == 0 for r in steps)
    final = steps[-1]
    assert final["rollout/joins"] == 1 and final["rollout/drains"] == 1, final
    assert final["rollout/server_restarts"] == 1, final
    # Formed at start, for B's first weights, with B, for A's new process, with both, without A.
    assert final["weights/group_reforms"] >= 4, final
    print(f"\n{TINY_CHARS.describe(steps)}")
    TINY_CHARS.assert_learned(steps)
