"""The fleet's rules without a training run: what a config may ask for, what
``areal fleet`` says without a run, and the elastic policy's decisions.

The policy runs on real objects: the kernel's ``RemoteInferenceEngine``
(its servers need not answer for membership decisions) and a real embedded
launcher; a grow it decides on really starts a server through the local
scheduler in ``test_elastic_local_run_grows_when_the_trainer_waits``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from areal_kernel.config.loader import validate_config
from areal_kernel.errors import ConfigError
from areal_kernel.inference.client import RemoteInferenceEngine
from areal_kernel.inference.embedded.backend import EmbeddedProtocol
from areal_kernel.inference.embedded.launcher import EmbeddedLauncher, EmbeddedServerConfig
from areal_kernel.inference.fleet import Fleet, FleetError, identity_mismatch, model_identity
from areal_kernel.plugins import get_registry
from areal_kernel.testing.learning import step_rows
from areal_kernel.utils import prefork

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _rollout(**elastic: int | float) -> object:
    cfg = validate_config({"rollout": {"elastic": elastic or {"min": 1, "max": 3}, "drain_timeout_s": 5}})
    return cfg.rollout


def test_elastic_range_must_hold_the_starting_fleet() -> None:
    reg = get_registry()
    with pytest.raises(
        ConfigError, match=r"rollout.elastic: the run starts with 3 server\(s\).*outside \[min=1, max=2\]"
    ):
        validate_config({"rollout": {"backend": "embedded:d3", "elastic": {"min": 1, "max": 2}}}, registry=reg)
    with pytest.raises(ConfigError, match=r"max \(1\) must be >= min \(2\)"):
        validate_config({"rollout": {"elastic": {"min": 2, "max": 1}}})
    ok = validate_config({"rollout": {"backend": "embedded:d2", "elastic": {"min": 1, "max": 3}}}, registry=reg)
    assert ok.rollout.elastic is not None and ok.rollout.elastic.max == 3


def test_fleet_command_without_a_running_job_says_so(tmp_path: Path, run_areal: Any) -> None:
    proc = run_areal("fleet", "status", str(tmp_path))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert f"{tmp_path}: no running job there (fleet.json is missing" in lines[0]


def test_identity_names_the_field_that_differs(areal_tiny_chat_model_dir: str, tmp_path: Path) -> None:
    from areal_kernel.models.tiny import make_tiny_byte_chat_llama

    ours = model_identity(areal_tiny_chat_model_dir)
    assert ours["vocab_size"] == 49152 and ours["tokenizer"] is not None
    assert identity_mismatch(ours, model_identity(areal_tiny_chat_model_dir)) == []
    other = model_identity(make_tiny_byte_chat_llama(tmp_path / "byte"))
    diff = identity_mismatch(ours, other)
    assert any(d.startswith("vocab_size: 259 (the run's model: 49152)") for d in diff), diff
    assert any(d.startswith("tokenizer:") for d in diff), diff


def _fleet(
    tmp_path: Path, areal_tiny_model_dir: str, n: int = 3, **elastic: int | float
) -> tuple[Fleet, RemoteInferenceEngine]:
    client = RemoteInferenceEngine([f"127.0.0.1:{9100 + i}" for i in range(n)], EmbeddedProtocol())
    launcher = EmbeddedLauncher(EmbeddedServerConfig(dtype="float32"), run_dir=str(tmp_path / "servers"))
    return Fleet(client, launcher, areal_tiny_model_dir, _rollout(**elastic)), client


def test_drains_keep_the_minimum(tmp_path: Path, areal_tiny_model_dir: str) -> None:
    fleet, client = _fleet(tmp_path, areal_tiny_model_dir, n=3, min=2, max=3)
    try:
        out = fleet.request_drain("127.0.0.1:9102")
        assert out["state"] == "draining" and client.servers[2].draining and not client.servers[2].up
        with pytest.raises(FleetError, match="already draining"):
            fleet.request_drain("127.0.0.1:9102")
        with pytest.raises(
            FleetError, match=r"1 server\(s\) would be left, fewer than the minimum 2 \(rollout.elastic.min\)"
        ):
            fleet.request_drain("127.0.0.1:9101")
        with pytest.raises(FleetError, match="is not in the fleet"):
            fleet.request_drain("127.0.0.1:9199")
        # Idle: the next tick releases it (it was not started by this launcher: nothing to stop).
        fleet.tick()
        assert [s.address for s in client.servers] == ["127.0.0.1:9100", "127.0.0.1:9101"]
        assert fleet.stats["drains"] == 1
    finally:
        client.destroy()


def test_elastic_policy_shrinks_on_stale_drops_and_grows_on_waits(tmp_path: Path, areal_tiny_model_dir: str) -> None:
    fleet, client = _fleet(tmp_path, areal_tiny_model_dir, n=2, min=1, max=3, patience=2, cooldown_steps=1)
    try:
        # One step of stale drops is not enough (patience 2); two in a row drain the newest server.
        fleet.observe_step(1, wait_s=0.0, step_s=1.0, stale_dropped_total=3)
        assert not any(s.draining for s in client.servers)
        fleet.observe_step(2, wait_s=0.0, step_s=1.0, stale_dropped_total=5)
        assert [s.draining for s in client.servers] == [False, True] and fleet.stats["shrinks"] == 1
        # No drops since (the total stays 5): no more shrinking, and within the cooldown nothing happens.
        fleet.observe_step(3, wait_s=0.9, step_s=1.0, stale_dropped_total=5)
        fleet.observe_step(4, wait_s=0.9, step_s=1.0, stale_dropped_total=5)
        assert fleet.stats["shrinks"] == 1 and fleet.stats["grows"] == 1
        # The grow ran: this launcher never launched, so the start fails with a line, the run goes on.
        for _ in range(100):
            if fleet._policy.starting == 0:
                break
            time.sleep(0.05)
        assert any("could not start a server" in e["event"] for e in fleet.events), fleet.events
    finally:
        client.destroy()


@pytest.mark.slow
def test_elastic_local_run_grows_when_the_trainer_waits(tmp_path: Path, run_areal: Any) -> None:
    """A real run under the local scheduler with ``rollout.elastic: {min: 1,
    max: 2}``: the trainer waits for rollouts (one server), so the policy
    starts a second server (a process of the run, logging in run_dir), the
    fleet admits it with the current weights (broadcast), and both serve."""
    from areal_kernel.models.tiny import make_tiny_byte_chat_llama

    model = make_tiny_byte_chat_llama(tmp_path / "model")
    run_dir = tmp_path / "run"
    args = [
        sys.executable, "-m", "areal_kernel.cli", "train", "grpo_arithmetic", f"model.path={model}",
        f"run_dir={run_dir}", "trainer.max_steps=6", "trainer.eval_size=0", "logging.sinks=[jsonl]",
        "reward.type=char_share", "weight_update.mode=broadcast", "monitor.weights.action=error",
        # The trainer of the tiny model waits for rollouts most of every step; a low
        # fraction and patience 1 make the policy act at once, so the run stays short.
        "rollout.elastic.min=1", "rollout.elastic.max=2", "rollout.elastic.grow_wait_fraction=0.05",
        "rollout.elastic.patience=1",
    ]  # fmt: skip
    # A step of the tiny model is shorter than a server's start: the run pauses
    # after step 3 (a testing aid; the fleet's tick runs meanwhile) until the
    # second server is in, so the steps after it show both serving.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AREAL_TEST_PAUSE_AFTER_STEPS": "3"}
    run = prefork.popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                        start_new_session=True)  # fmt: skip
    try:
        marker = run_dir / ".paused-after-step3"
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert run.poll() is None and time.monotonic() < deadline, "the run did not pause after step 3"
            time.sleep(0.1)
        while True:
            st = run_areal("fleet", "status", str(run_dir), "--json")
            states = [s["state"] for s in json.loads(st.stdout)["servers"]]
            if states == ["active", "active"]:
                break
            assert time.monotonic() < deadline, f"the fleet did not grow: {st.stdout}"
            time.sleep(0.2)
        marker.unlink()
        out, _ = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, 9)
            run.wait(30)
    proc = subprocess.CompletedProcess(args, run.returncode, out, "")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = step_rows(str(run_dir))
    assert steps[-1]["rollout/grows"] == 1 and steps[-1]["rollout/joins"] == 1, steps[-1]
    grown = [r["step"] for r in steps if r["rollout/servers"] == 2]
    assert grown and grown[-1] == 6, [r["rollout/servers"] for r in steps]
    # Verified on both after the join; the new server was the run's own process.
    assert all(r["monitor/weights_servers"] == 2 for r in steps if r["step"] > grown[0]), steps
    logs = sorted(p.name for p in run_dir.iterdir() if p.name.startswith("server") and p.name.endswith(".log"))
    assert len(logs) == 2, logs
    with open(run_dir / "samples.jsonl", encoding="utf-8") as f:
        servers = {s["server"] for line in f for s in json.loads(line)["samples"]}
    assert len(servers) == 2, servers


def test_a_server_dying_inside_a_broadcast_stops_with_one_clear_error(
    areal_tiny_model_dir: str, tmp_path: Path
) -> None:
    """The limit docs/elastic.md states: between updates a dead server is
    handled (the group re-forms without it), but one that dies after the
    group formed and before the transfer (here: killed behind the client's
    back, so the client still counts it) makes the transfer fail: the error
    is one ``ServerError`` that says what happened and how to resume."""
    import signal

    from areal_kernel.engine.torch_engine import TorchTrainEngine
    from areal_kernel.errors import ServerError
    from areal_kernel.trainer.weight_sync import BroadcastTransport

    launcher = EmbeddedLauncher(EmbeddedServerConfig(dtype="float32"), run_dir=str(tmp_path / "servers"))
    engine = TorchTrainEngine({"lr": 1e-3})
    client = None
    try:
        infos = launcher.launch(areal_tiny_model_dir, n_servers=2, devices_per_server=0)
        engine.initialize(areal_tiny_model_dir, 4)
        client = RemoteInferenceEngine([i.address for i in infos], EmbeddedProtocol())
        transport = BroadcastTransport(engine, client, str(tmp_path / "run"), bucket_bytes=1 << 20)
        transport.group_timeout_s = 10.0  # the dead member surfaces within it
        transport.setup()
        assert transport.update(1)["weights/mb"] > 0  # a clean update first
        launcher.handles[1].signal_group(signal.SIGKILL)
        launcher.handles[1].wait(30)
        with pytest.raises(ServerError, match=r"in-memory weight update to version 2 failed: .*recover: auto") as err:
            transport.update(2)
        assert len(str(err.value).splitlines()) == 1, str(err.value)
    finally:
        if client is not None:
            client.destroy()
        engine.destroy()
        launcher.stop()
