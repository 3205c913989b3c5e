"""``areal agent run|ps|status|logs|stop`` through the real CLI in subprocesses:
two workers of examples/agent_openai.py's agent class behind the agent proxy,
on a tiny random Llama served by two embedded replicas the service starts
itself. Sessions finish with rewards, a session's turns stay on one replica,
a killed worker is restarted, `stop` leaves no process; bad input (unknown
agent class, port in use, a stale state file) gets one clear line."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import openai  # noqa: F401  the example agent the workers run uses it (requirements-test.txt)
import pytest
from areal_kernel.testing.procs import live_processes, wait_gone

AGENT = "examples/agent_openai.py:ArithmeticAgent"


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("records") / "arith.jsonl"
    path.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"What is {i} + 2?", "answer": i + 2}) + "\n"
                            for i in range(4)))  # fmt: skip
    return path


def _alive(cli: Any) -> list[Any]:
    home = f"AREAL_HOME={cli.areal_home}"
    return live_processes(lambda p: p.pid != os.getpid() and p.environ_has(home))


def _wait(cli: Any, what: str, ok: Any, timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        st = cli.json("status")
        if ok(st):
            return st
        assert time.monotonic() < deadline, f"{what}; status: {json.dumps(st)[:2000]}"
        time.sleep(0.3)


def test_bad_input_gets_one_clear_line(agent_cli: Any, records: Path) -> None:
    line = agent_cli.fails("run", "--agent", "examples/agent_openai.py:NoSuchAgent", "--model-path", "x",
                           "--records", str(records))  # fmt: skip
    assert "--agent" in line and "has no attribute 'NoSuchAgent'" in line, line
    line = agent_cli.fails("run", "--agent", "no_such_pkg.mod:Agent", "--model-path", "x", "--records", str(records))
    assert "--agent: cannot import 'no_such_pkg.mod'" in line, line
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        line = agent_cli.fails("run", "--agent", AGENT, "--model-path", "x", "--records", str(records),
                               "--port", str(port))  # fmt: skip
    assert f"--port {port}" in line and "already in use" in line, line
    assert not (agent_cli.home / "service.json").exists()
    # A state file naming a process that is gone (the service was killed without cleaning up).
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    agent_cli.home.mkdir(parents=True, exist_ok=True)
    (agent_cli.home / "service.json").write_text(json.dumps({"pid": gone.pid, "start_time": 1, "host": "127.0.0.1",
                                                             "port": 1, "replicas": {}}))  # fmt: skip
    line = agent_cli.fails("status")
    assert "stale state file" in line and str(gone.pid) in line, line
    out = agent_cli("stop").stdout
    assert "removed a stale state file" in out and not (agent_cli.home / "service.json").exists()


def test_workers_finish_rewarded_sessions_and_a_killed_worker_is_restarted(
    agent_cli: Any, records: Path, areal_tiny_chat_model_dir: str
) -> None:
    out = agent_cli("run", "--agent", AGENT, "--agent-kwargs", '{"max_tokens": 6}', "--workers", "2",
                    "--model-path", areal_tiny_chat_model_dir, "--backend", "embedded:d2", "--records", str(records),
                    "--epochs", "0", "--max-new-tokens", "6", "--port", "0", "--timeout", "300").stdout  # fmt: skip
    assert "2 worker(s) of" in out, out
    # Both workers take sessions (one may finish several before the other's first: sessions are short).
    st = _wait(agent_cli, "sessions never finished on both workers",
               lambda s: s["sessions"]["finished"] >= 6 and all(w["sessions"] > 0 for w in s["workers"]))  # fmt: skip
    assert st["service"]["state"] == "running" and st["service"]["mode"] == "local"
    assert st["sessions"]["failed"] == 0 and st["sessions"]["rewarded"] == st["sessions"]["finished"]
    assert isinstance(st["reward_mean"], float) and st["tokens"] > 0 and st["tokens_per_s"] > 0
    assert [w["state"] for w in st["workers"]] == ["running", "running"]
    assert all(w["sessions"] > 0 for w in st["workers"]), st["workers"]
    table = agent_cli("status").stdout
    assert "reward mean" in table and "tokens/s" in table and "WORKER" in table
    watch = subprocess.Popen([sys.executable, "-m", "areal_kernel.cli", "agent", "status", "--watch", "--interval",
                              "0.1"], stdout=subprocess.PIPE, text=True, env=agent_cli.env)  # fmt: skip
    assert watch.stdout is not None
    shown = 0
    while shown < 2:  # the status is printed again and again until Ctrl-C
        line = watch.stdout.readline()
        assert line, "status --watch ended by itself"
        shown += line.startswith("agent service running")
    watch.send_signal(signal.SIGINT)
    assert watch.wait(timeout=30) == 0
    watch.stdout.close()

    # The session log: rewarded, token-exact rows; every session's turns on one replica.
    lines = [json.loads(x) for x in (agent_cli.home / "sessions.jsonl").read_text().splitlines()]
    assert len(lines) >= 6
    replicas = {r["address"] for r in st["model"]["replicas"]}
    assert len(replicas) == 2
    for entry in lines:
        assert entry["error"] is None and entry["reward"] in (0.0, 1.0), entry
        assert entry["rows"] and entry["rows"][0]["reward"] == entry["reward"]
        assert len(entry["servers"]) == 1 and entry["servers"][0] in replicas, entry["servers"]
        row = entry["rows"][0]
        assert len(row["input_ids"]) == len(row["loss_mask"]) == len(row["logprobs"])
    assert any(e["turns"] == 2 for e in lines), "no agent ever asked a second turn"

    ps = agent_cli.json("ps")["processes"]
    assert [p["kind"] for p in ps] == ["service", "replica", "replica", "worker", "worker"]
    victim = next(p for p in ps if p["kind"] == "worker" and p["index"] == 0)
    os.killpg(victim["pid"], 9)
    assert wait_gone(victim["pid"])
    done_before = st["sessions"]["finished"]
    st = _wait(agent_cli, "worker 0 was not restarted",
               lambda s: s["workers"][0]["restarts"] == 1 and s["workers"][0]["state"] == "running"
               and s["workers"][0]["pid"] != victim["pid"] and s["sessions"]["finished"] > done_before + 2)  # fmt: skip
    assert "--worker 9: no log of that worker" in agent_cli.fails("logs", "--worker", "9")
    log0 = agent_cli("logs", "--worker", "0", "-n", "200").stdout
    assert log0.count("=== worker 0 starting") >= 2, log0

    pids = [p["pid"] for p in agent_cli.json("ps")["processes"]]
    out = agent_cli("stop").stdout
    assert "stopped the service" in out and "2 worker(s) and 2 model replica(s)" in out, out
    assert not (agent_cli.home / "service.json").exists()
    assert not [p for p in _alive(agent_cli) if p.pid in pids or p.pgid in pids]
    assert not _alive(agent_cli)
    line = agent_cli.fails("status")
    assert "not running" in line and "areal agent run" in line, line


def test_when_the_records_run_out_status_says_done_and_the_log_has_every_session(
    agent_cli: Any, records: Path, areal_tiny_chat_model_dir: str
) -> None:
    agent_cli("run", "--agent", AGENT, "--agent-kwargs", '{"max_tokens": 6}', "--workers", "2",
              "--model-path", areal_tiny_chat_model_dir, "--records", str(records), "--epochs", "1",
              "--port", "0", "--timeout", "300")  # fmt: skip
    try:
        st = _wait(agent_cli, "the records never ran out", lambda s: s["records"]["done"])
        assert st["sessions"]["finished"] + st["sessions"]["failed"] == 4 and st["sessions"]["open"] == 0
        assert st["records"] == {"total": 4, "queued": 0, "epoch": 1, "epochs": 1, "done": True}
        text = agent_cli("status").stdout
        assert "epoch 1 of 1" in text and "done: every record ran" in text, text
        # This run's part of the service log (a module's tests share one AREAL_HOME; each run appends).
        log = agent_cli("logs", "-n", "500").stdout.rsplit("=== areal agent run:", 1)[-1]
        finished = [line for line in log.splitlines() if "session finished" in line]
        assert len(finished) == 4 and all("reward=" in line and "record=r" in line for line in finished), log
        assert "every record ran" in log, log
        for i in range(2):  # the openai client's per-request httpx lines stay out of the workers' logs
            worker_log = agent_cli("logs", "--worker", str(i), "-n", "500").stdout
            assert "running" in worker_log and "HTTP Request" not in worker_log, worker_log
    finally:
        agent_cli("stop")
