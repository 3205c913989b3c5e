"""Inference servers dying mid-rollout (real server processes, a tiny random
Llama, the real client, supervisor and rollout executor): in-flight requests
continue elsewhere or on the automatically restarted server, with every
admitted record yielding exactly one group, and a restarted server serves the
current weights. ``kill -9`` of the server's process group is the fault."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from areal_kernel.api.engine import WeightUpdateMeta
from areal_kernel.api.io import GenerationConfig, ModelRequest, StopReason, Trajectory, TrajectoryGroup
from areal_kernel.errors import ServerError
from areal_kernel.testing.procs import live_processes
from areal_kernel.testing.waits import embedded_info, embedded_running, wait_until
from areal_kernel.utils import prefork

os.environ.setdefault("OMP_NUM_THREADS", "1")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    from areal_kernel.testing.models import make_tiny_llama

    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny")), hidden=64, layers=2, seed=3)


class Stack:
    """Launcher + client + supervisor over ``n`` embedded servers."""

    def __init__(self, model_dir: str, run_dir: str, n: int, max_restarts: int = 3) -> None:
        from areal_kernel.inference.client import RemoteInferenceEngine
        from areal_kernel.inference.embedded.backend import EmbeddedProtocol
        from areal_kernel.inference.embedded.launcher import EmbeddedLauncher, EmbeddedServerConfig
        from areal_kernel.inference.supervisor import ServerSupervisor

        self.launcher = EmbeddedLauncher(EmbeddedServerConfig(max_batch_size=32, stop_grace_s=2), run_dir=run_dir)
        self.infos = self.launcher.launch(model_dir, n_servers=n, devices_per_server=0)
        self.client = RemoteInferenceEngine(
            [i.address for i in self.infos], EmbeddedProtocol(), request_timeout_s=120, down_probe_s=0.5
        )
        self.restarted: list[tuple[str, int]] = []
        self.supervisor = ServerSupervisor(
            self.launcher, self.client, max_restarts=max_restarts, poll_s=0.1,
            on_restart=lambda a, v: self.restarted.append((a, v)),
        ).start()  # fmt: skip

    def kill(self, i: int) -> int:
        pid = self.launcher.servers[i].pid
        os.killpg(pid, signal.SIGKILL)
        return pid

    def wait_restarts(self, n: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.restarted) < n:
            assert self.supervisor.error is None, str(self.supervisor.error)
            assert time.monotonic() < deadline, f"no restart within {timeout}s; log:\n{self.launcher.log_tail(0)}"
            time.sleep(0.1)

    def close(self) -> None:
        self.supervisor.stop()
        self.client.destroy()
        self.launcher.stop()


def wait_generating(stack: Stack, i: int, timeout: float = 30.0) -> None:
    """Until server ``i`` itself reports a running generation (the client's
    in-flight count only says a request was sent)."""
    address = stack.infos[i].address
    wait_until(lambda: embedded_running(address) >= 1, timeout_s=timeout, what=f"a generation running on {address}")


class TokenWorkflow:
    """A minimal user workflow: ``n`` samples of a token prompt, reward =
    output length parity. Counts how often each record's episode starts."""

    def __init__(self, n: int = 2, max_new_tokens: int = 48) -> None:
        self.n = n
        self.gconfig = GenerationConfig(max_new_tokens=max_new_tokens, temperature=1.0)
        self.starts: dict[str, int] = {}
        self.lock = threading.Lock()

    async def arun_episode(self, engine, record):
        with self.lock:
            self.starts[record["id"]] = self.starts.get(record["id"], 0) + 1
        resps = await asyncio.gather(
            *(engine.agenerate(ModelRequest(record["ids"], self.gconfig, rid=f"{record['id']}-{k}")) for k in range(self.n))
        )
        trajs = []
        for k, r in enumerate(resps):
            assert r.stop_reason in (StopReason.STOP, StopReason.LENGTH), r.stop_reason
            assert r.stop_reason == StopReason.STOP or r.output_len == self.gconfig.max_new_tokens
            trajs.append(Trajectory.from_response(r, float(r.output_len % 2), group_id=record["id"], sample_id=str(k)))
        return TrajectoryGroup(trajs, group_id=record["id"])


def test_killed_server_fails_over_and_restarts_no_record_lost_or_duplicated(tiny_dir, tmp_path):
    from areal_kernel.rollout.executor import RolloutExecutor

    stack = Stack(tiny_dir, str(tmp_path / "run"), n=2)
    try:
        records = [{"id": f"r{i}", "ids": [3 + i % 50, 7, 11 + i % 13, 5]} for i in range(24)]
        it = iter(records)
        wf = TokenWorkflow()
        ex = RolloutExecutor(stack.client, wf, lambda: next(it, None), batch_size=4, max_staleness=100, max_concurrent=12)
        ex.start()
        try:
            wait_generating(stack, 0)
            old_pid = stack.kill(0)
            groups = []
            for _ in range(6):
                groups += ex.get_batch(4, timeout=120)
        finally:
            ex.stop()
        ids = [g.group_id for g in groups]
        assert sorted(ids) == sorted(r["id"] for r in records)  # every record once: none lost, none twice
        assert all(n == 1 for n in wf.starts.values()) and len(wf.starts) == 24  # no episode re-run
        assert ex.stats.admitted == 24 and ex.stats.failed == 0
        assert stack.client.stats["failovers"] >= 1
        stack.wait_restarts(1)
        assert stack.restarted == [(stack.infos[0].address, 0)]
        assert stack.launcher.servers[0].address == stack.infos[0].address
        assert stack.launcher.servers[0].pid != old_pid
        assert "restarting server" in open(stack.launcher.servers[0].log_path).read()
    finally:
        stack.close()


def _perturbed_weights(model_dir: str, out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from areal_kernel.weights.disk import save_state_dict_dir

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.neg_()  # a very different model: greedy outputs change
    save_state_dict_dir(list(model.named_parameters()), out)


def test_restarted_server_serves_the_current_weight_version(tiny_dir, tmp_path):
    stack = Stack(tiny_dir, str(tmp_path / "run"), n=1)
    prompt = [5, 9, 17, 4, 21]
    greedy = GenerationConfig(max_new_tokens=12, greedy=True)

    async def gen(reqs):
        try:
            return await asyncio.gather(*(stack.client.agenerate(r) for r in reqs))
        finally:
            await stack.client.aclose(current_loop_only=True)

    try:
        base = asyncio.run(gen([ModelRequest(prompt, greedy)]))[0]
        wdir = str(tmp_path / "weights" / "v1")
        _perturbed_weights(tiny_dir, wdir)
        stack.client.update_weights(WeightUpdateMeta(kind="disk", version=1, path=wdir))
        updated = asyncio.run(gen([ModelRequest(prompt, greedy)]))[0]
        assert updated.output_ids != base.output_ids and set(updated.output_versions) == {1}

        async def killed_mid_rollout():
            sampled = GenerationConfig(max_new_tokens=400, temperature=1.0)
            tasks = [asyncio.create_task(stack.client.agenerate(ModelRequest(prompt, sampled))) for _ in range(6)]
            # The kill must land while the server generates: wait for the server
            # to say so (off the loop, which must keep sending the requests).
            await asyncio.to_thread(wait_generating, stack, 0)
            stack.kill(0)
            try:
                return await asyncio.gather(*tasks)
            finally:
                await stack.client.aclose(current_loop_only=True)

        resps = asyncio.run(killed_mid_rollout())
        for r in resps:
            assert r.stop_reason == StopReason.STOP or r.output_len == 400
            assert set(r.output_versions) == {1}  # never base-model tokens, never a wrong stamp
        assert stack.client.stats["failovers"] >= 1
        stack.wait_restarts(1)
        address = stack.infos[0].address
        assert stack.restarted == [(address, 1)]
        assert stack.launcher.servers[0].address == address
        assert embedded_info(address)["weight_version"] == 1
        again = asyncio.run(gen([ModelRequest(prompt, greedy)]))[0]
        assert again.output_ids == updated.output_ids and set(again.output_versions) == {1}
    finally:
        stack.close()


def test_restart_budget_exhausted_gives_a_clear_error(tiny_dir, tmp_path):
    stack = Stack(tiny_dir, str(tmp_path / "run"), n=1, max_restarts=1)
    address = stack.infos[0].address
    try:
        stack.kill(0)
        stack.wait_restarts(1)
        stack.kill(0)
        deadline = time.monotonic() + 30
        while stack.supervisor.error is None:
            assert time.monotonic() < deadline, "supervisor never gave up"
            time.sleep(0.05)
        msg = str(stack.supervisor.error)
        assert address in msg and "rollout.max_server_restarts=1" in msg and "exit" in msg
        assert "listening on http://" in msg  # the server's log tail
        with pytest.raises(ServerError, match="max_server_restarts"):
            stack.supervisor.check()

        async def one():
            try:
                return await stack.client.agenerate(ModelRequest([1, 2, 3], GenerationConfig(max_new_tokens=4)))
            finally:
                await stack.client.aclose(current_loop_only=True)

        with pytest.raises(ServerError, match=address):
            asyncio.run(one())
        assert len(stack.restarted) == 1
    finally:
        stack.close()


def _server_pids(parent_pid: int) -> list[int]:
    """Embedded servers started by ``parent_pid`` (they carry ``--parent-pid``)."""
    return [
        p.pid
        for p in live_processes(
            lambda p: p.runs("areal_kernel.inference.embedded.server") and p.arg_after("--parent-pid") == str(parent_pid)
        )
    ]


def test_areal_train_survives_a_killed_server(tmp_path):
    """``areal train`` (one server, disk weight updates) whose server is
    killed after the first step: the server is restarted with the current
    weights and every step still trains a full batch."""
    from areal_kernel.testing.models import make_tiny_chat_llama

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    model = make_tiny_chat_llama(tmp_path / "model")
    run_dir = str(tmp_path / "run")
    steps = 3
    cmd = [
        sys.executable, "-m", "areal_kernel.cli", "train", os.path.join(repo, "examples", "grpo_arithmetic.yaml"),
        f"model.path={model}", f"run_dir={run_dir}", f"trainer.max_steps={steps}", "trainer.batch_size=2",
        "trainer.eval_size=0", "rollout.gconfig.n_samples=4", "rollout.gconfig.max_new_tokens=24",
        "rollout.max_staleness=1", "weight_update.mode=disk", "algorithm.dynamic_filter=false",
        "logging.sinks=[jsonl]",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log_path = tmp_path / "train.log"
    with open(log_path, "wb") as logf:
        proc = prefork.popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=repo, start_new_session=True)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    try:
        deadline = time.monotonic() + 240
        killed = None
        while proc.poll() is None and time.monotonic() < deadline:
            if killed is None and os.path.exists(metrics) and '"perf/step_s"' in open(metrics).read():
                pids = _server_pids(proc.pid)
                assert len(pids) == 1, pids
                os.killpg(pids[0], signal.SIGKILL)
                killed = pids[0]
            time.sleep(0.05)
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = log_path.read_text(errors="replace")
    assert rc == 0, out[-4000:]
    assert "held-out evaluation was off" in out and "before nan" not in out  # trainer.eval_size=0
    assert killed is not None, "the run finished before a server could be killed"
    rows = [json.loads(line) for line in open(metrics)]
    step_rows = [r for r in rows if "perf/step_s" in r]
    assert [r["step"] for r in step_rows] == list(range(1, steps + 1))
    assert all(r["batch/sequences"] == 2 * 4 for r in step_rows)  # every batch full
    assert all(r["rollout/staleness_max"] <= 1 for r in step_rows)
    plain = re.sub(r"\x1b\[[0-9;]*m", "", out)
    m = re.search(r"inference server restarted.*?weight_version=(\d+)", plain)
    assert m, plain[-4000:]
    assert int(m.group(1)) >= 1  # killed after step 1: the restart got the trained weights, not the base model
    assert "restarting server" in open(os.path.join(run_dir, "server-0.log")).read()


def test_the_checkpoint_named_is_the_newest_when_the_error_is_shown():
    """The trainer finishes the step it is in after a server is given up and
    may write a newer recovery checkpoint, removing the one that was newest
    then (``checkpoint.keep_last=1``): the message names the newest one when
    it is shown (test_vllm_restart.py caught the stale name on a real run)."""
    from areal_kernel.inference.supervisor import ServerGaveUp

    newest = ["/run/recover/step3"]
    err = ServerGaveUp("inference server 127.0.0.1:1 exited", lambda: newest[0], "--- last lines of its log ---\nx")
    assert isinstance(err, ServerError)
    assert "last recovery checkpoint: /run/recover/step3 (areal train" in str(err)
    newest[0] = "/run/recover/step4"
    assert "last recovery checkpoint: /run/recover/step4 (areal train" in str(err)
    assert str(err).startswith("inference server 127.0.0.1:1 exited\n") and str(err).endswith("\nx")

    def broken() -> str:
        raise OSError("gone")

    # A failing hint does not hide the error; without a checkpoint it says none.
    assert "last recovery checkpoint: (unknown: OSError: gone)" in str(ServerGaveUp("h", broken, "t"))
    assert "last recovery checkpoint: none\nt" in str(ServerGaveUp("h", lambda: None, "t"))
