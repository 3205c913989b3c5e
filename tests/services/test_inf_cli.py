"""`areal inf` without models, through the real CLI: a stale state file and
the processes it names, a port in use, an admin token beyond loopback, a
broken config.toml, and commands while nothing runs. Each bad input is one
`areal: error:` line."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import urllib.error
import urllib.request
from typing import Any

from areal_kernel.utils.network import find_free_port


def _get(url: str, token: str | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_commands_while_nothing_runs(inf_cli: Any) -> None:
    for cmd in (["status"], ["ps"], ["models"], ["deregister", "m"]):
        assert "the inference service is not running (no " in inf_cli.fails(*cmd)
    assert "not running" in inf_cli("stop").stderr


def test_stale_state_file_is_reported_then_cleaned_up_with_what_it_left(inf_cli: Any) -> None:
    """A gateway killed with -9 leaves gateway.json behind, naming a dead pid,
    and maybe replicas still running (their own process groups)."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = subprocess.Popen(["sleep", "300"], start_new_session=True)  # a replica the dead gateway left
    try:
        inf_cli.home.mkdir(parents=True, exist_ok=True)
        state = {
            "pid": dead.pid, "start_time": None, "host": "127.0.0.1", "port": 9,
            "replicas": {"m": [{"pid": orphan.pid, "start_time": None}]},
        }  # fmt: skip
        (inf_cli.home / "gateway.json").write_text(json.dumps(state))
        line = inf_cli.fails("status")
        assert f"names gateway pid {dead.pid}, which is gone (a stale state file)" in line
        assert orphan.poll() is None
        out = inf_cli("stop").stdout
        assert "removed a stale state file" in out and "stopped 1 leftover process group(s)" in out
        assert orphan.wait(10) == -signal.SIGTERM
        assert inf_cli.state() is None
        # `run` replaces a stale file too, and says so.
        (inf_cli.home / "gateway.json").write_text(json.dumps({**state, "replicas": {}}))
        proc = inf_cli("run", "--port", str(find_free_port()))
        assert "removed a stale state file" in proc.stderr and "gateway on http://127.0.0.1:" in proc.stdout
        assert inf_cli.state()["pid"] != dead.pid
        assert inf_cli.json("status")["models"] == []
        inf_cli("stop")
    finally:
        if orphan.poll() is None:
            os.killpg(orphan.pid, signal.SIGKILL)
            orphan.wait()


def test_port_in_use(inf_cli: Any) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        line = inf_cli.fails("run", "--port", str(port))
    assert f"--port {port}: 127.0.0.1:{port} is already in use by another process" in line
    assert inf_cli.state() is None


def test_broken_config_file_is_named(inf_cli: Any) -> None:
    cfg = inf_cli.home / "config.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    try:
        cfg.write_text("[gateway]\nport = 'eighty'\n")
        line = inf_cli.fails("run")
        assert f"{cfg} is invalid: gateway.port: Input should be a valid integer" in line
        cfg.write_text("[gateway\n")
        assert f"{cfg}: invalid TOML" in inf_cli.fails("run")
    finally:
        cfg.unlink()


def test_admin_token_required_beyond_loopback(inf_cli: Any) -> None:
    port = find_free_port("0.0.0.0")
    out = inf_cli("run", "--host", "0.0.0.0", "--port", str(port)).stdout
    assert "control routes need the admin token stored in" in out
    try:
        token = inf_cli.state()["admin_token"]
        assert token and len(token) >= 32
        assert oct((inf_cli.home / "gateway.json").stat().st_mode & 0o777) == "0o600"
        base = f"http://127.0.0.1:{port}"
        code, body = _get(f"{base}/admin/status")
        assert code == 401 and "needs 'Authorization: Bearer <admin token>'" in body["error"]["message"]
        assert _get(f"{base}/admin/status", "wrong")[0] == 401
        assert _get(f"{base}/admin/status", token)[0] == 200
        assert _get(f"{base}/v1/models") == (200, {"object": "list", "data": []})  # inference routes stay open
        # The CLI reads the token from the state file.
        assert inf_cli.json("status")["gateway"]["admin_token_required"] is True
    finally:
        inf_cli("stop")
    assert inf_cli.state() is None


def test_run_prints_the_openai_base_url_and_unknown_routes_answer_openai_errors(inf_cli: Any) -> None:
    port = find_free_port()
    out = inf_cli("run", "--port", str(port)).stdout
    try:
        # What an OpenAI client takes as base_url, as the README shows it.
        assert f"gateway on http://127.0.0.1:{port}/v1 (pid" in out, out
        code, body = _get(f"http://127.0.0.1:{port}/v1/nope")
        assert code == 404 and body["error"]["code"] == "unknown_route", body
        assert (
            "GET /v1/nope: no such route" in body["error"]["message"]
            and "/v1/chat/completions" in body["error"]["message"]
        )
        code, body = _get(f"http://127.0.0.1:{port}/v1/chat/completions")  # a GET where only POST is served
        assert code == 405 and body["error"]["code"] == "method_not_allowed", body
    finally:
        inf_cli("stop")


def test_logs_of_an_unknown_model_name_only_registered_ones(inf_cli: Any) -> None:
    # What a deregistered model leaves: its logs, no entry in config.toml.
    old = inf_cli.home / "models" / "old"
    old.mkdir(parents=True, exist_ok=True)
    (old / "server-0.log").write_text("served once\n")
    line = inf_cli.fails("logs", "nope")
    assert "no logs for a model named 'nope'" in line and "registered models: none" in line, line
    assert "logs kept of deregistered models: old" in line, line
    assert "served once" in inf_cli("logs", "old").stdout  # its logs stay readable
