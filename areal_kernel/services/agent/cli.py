"""``areal agent run|ps|status|logs|stop`` (``areal agent serve`` is the training side).

Each command is a short-lived process: it finds the service through
``$AREAL_HOME/agent/service.json`` and talks to it over HTTP (with the admin
token the state file holds, when the service requires one). Every mistake
is one ``areal: error: ...`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from areal_kernel.errors import ArealError, ConfigError
from areal_kernel.services.agent.spec import (
    ADMIN_TOKEN_ENV,
    LOG_NAME,
    RECORDS_NAME,
    SESSION_LOG,
    SPEC_NAME,
    STATE_NAME,
    AgentRunSpec,
    agent_home,
)
from areal_kernel.services.inf.cli import _call, _locked, _parse_settings, _table, follow_file
from areal_kernel.services.inf.state import gateway_alive, kill_leftovers, read_state, remove_state, write_atomic

SERVICE_MODULE = "areal_kernel.services.agent.service"
WHAT = "the agent service"


def add_commands(cmds: Any) -> None:
    """Add ``run``, ``ps``, ``status``, ``logs`` and ``stop`` to ``areal agent``'s subparsers."""
    p = cmds.add_parser(
        "run",
        help="start an agent service (detached): N workers of an agent class behind the agent proxy",
        description="Runs N worker processes of an agent class (async run(record, *, base_url, api_key) -> "
        "reward) behind the kernel's agent proxy, on records from --records or --dataset. The model is started "
        "by the service (--model-path, --backend, as `areal inf register` does), or --proxy names a training "
        "run's `areal agent serve` proxy (online RL). Finished sessions go to $AREAL_HOME/agent/sessions.jsonl.",
    )
    p.add_argument("--agent", required=True, help="'pkg.module:Class' or 'path/to/file.py:Class'")
    p.add_argument("--agent-kwargs", default="{}", help="keyword arguments for the agent class, a JSON object")
    p.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
    p.add_argument("--model-name", default="areal", help="the model id agents use (default 'areal')")
    p.add_argument("--model-path", default=None, help="HF model directory or a registered model name")
    p.add_argument(
        "--backend", default=None, help="inference backend and replicas: embedded (default), embedded:d2, ..."
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="weights dtype (default float32)")
    p.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                   help="a backend setting (its config section); repeatable")  # fmt: skip
    p.add_argument("--max-restarts", type=int, default=3, help="restarts allowed per model replica (default 3)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="cap on one answer's tokens (default 256)")
    p.add_argument("--proxy", default=None, help="online RL: root URL of a training run's `areal agent serve` proxy")
    p.add_argument("--proxy-token", default=None, help="that proxy's admin token (also AREAL_AGENT_PROXY_TOKEN)")
    p.add_argument("--records", default=None, help="a .jsonl file of records, or '-' for stdin")
    p.add_argument("--dataset", default=None, help="a config file whose dataset section supplies the records")
    p.add_argument("--epochs", type=int, default=1, help="passes over the records (0: until stopped; default 1)")
    p.add_argument("--session-timeout", type=float, default=600.0, help="one session's limit in seconds")
    p.add_argument("--host", default="127.0.0.1", help="control address (beyond loopback an admin token is required)")
    p.add_argument("--port", type=int, default=8100, help="control port (default 8100; 0: a free one)")
    p.add_argument("--admin-token", default=None, help="bearer token for control routes (also AREAL_AGENT_ADMIN_TOKEN)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for the model and workers")
    p.set_defaults(func=cmd_run)

    p = cmds.add_parser("ps", help="processes of the agent service: service, model replicas, workers")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ps)

    p = cmds.add_parser("status", help="workers, sessions open/finished, reward mean, tokens/s")
    p.add_argument("--json", action="store_true")
    p.add_argument("--watch", action="store_true", help="print the status again every --interval seconds")
    p.add_argument("--interval", type=float, default=2.0)
    p.set_defaults(func=cmd_status)

    p = cmds.add_parser("logs", help="the service's log, or a worker's")
    p.add_argument("--worker", type=int, default=None, help="worker index (none: the service's log)")
    p.add_argument("-n", "--lines", type=int, default=40, help="lines to show first (default 40)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing what is appended (Ctrl-C ends)")
    p.set_defaults(func=cmd_logs)

    p = cmds.add_parser("stop", help="stop the service, its workers and model replicas")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before what is left is killed")
    p.set_defaults(func=cmd_stop)


def _running_state(home: Path) -> dict[str, Any]:
    state = read_state(home, STATE_NAME)
    if state is None:
        raise ArealError(f"the agent service is not running (no {home / STATE_NAME}); start it with `areal agent run`")
    if not gateway_alive(state):
        raise ArealError(
            f"the agent service is not running: {home / STATE_NAME} names pid {state['pid']}, which is gone (a stale "
            "state file); `areal agent run` replaces it, `areal agent stop` cleans up"
        )
    return state


def _status(home: Path) -> dict[str, Any]:
    return _call(_running_state(home), "GET", "/admin/status", what=WHAT)


def _remove_stale(home: Path, state: dict[str, Any]) -> str:
    killed = kill_leftovers(state)
    remove_state(home, name=STATE_NAME)
    left = f"; stopped {len(killed)} leftover process group(s)" if killed else ""
    return f"areal agent: removed a stale state file ({home / STATE_NAME}: service pid {state['pid']} is gone){left}"


def _spec(args: argparse.Namespace, home: Path) -> AgentRunSpec:
    from areal_kernel.agent.workflow import load_agent_class

    try:
        kwargs = json.loads(args.agent_kwargs)
    except ValueError as e:
        raise ConfigError(f"--agent-kwargs: not JSON ({e})") from None
    if not isinstance(kwargs, dict):
        raise ConfigError("--agent-kwargs: must be a JSON object of keyword arguments")
    agent = args.agent
    mod, sep, cls = agent.rpartition(":")
    if sep and mod.endswith(".py"):
        agent = f"{os.path.abspath(os.path.expanduser(mod))}:{cls}"  # workers run elsewhere
    try:
        load_agent_class(agent)
    except ConfigError as e:
        raise ConfigError(str(e).replace("workflow.agent.agent", "--agent", 1)) from None
    model_path = args.model_path
    if model_path and os.path.exists(os.path.expanduser(model_path)):
        model_path = os.path.abspath(os.path.expanduser(model_path))
    records = args.records
    if records and records != "-":
        records = os.path.abspath(os.path.expanduser(records))
        if not os.path.isfile(records):
            raise ConfigError(f"--records {args.records}: no such file")
    dataset = args.dataset
    if dataset:
        dataset = os.path.abspath(os.path.expanduser(dataset))
        if not os.path.isfile(dataset):
            raise ConfigError(f"--dataset {args.dataset}: no such config file")
    raw = {
        "agent": agent, "agent_kwargs": kwargs, "workers": args.workers, "model_name": args.model_name,
        "backend": args.backend or (None if args.proxy else "embedded"), "model_path": model_path,
        "dtype": args.dtype, "args": _parse_settings(args.settings), "max_restarts": args.max_restarts,
        "max_new_tokens": args.max_new_tokens, "proxy_url": args.proxy,
        "proxy_token": args.proxy_token or os.environ.get("AREAL_AGENT_PROXY_TOKEN"),
        "records": records, "dataset": dataset, "epochs": args.epochs, "session_timeout_s": args.session_timeout,
        "cwd": os.getcwd(), "host": args.host, "port": args.port,
    }  # fmt: skip
    try:
        spec = AgentRunSpec.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        loc = "--" + str(err["loc"][0]).replace("_", "-") if err["loc"] else ""
        msg = str(err["msg"]).removeprefix("Value error, ")
        raise ConfigError(msg if msg.startswith("--") else f"{loc}: {msg}") from None
    if spec.records == "-":
        home.mkdir(parents=True, exist_ok=True)
        path = home / RECORDS_NAME
        write_atomic(path, sys.stdin.read(), mode=0o600)
        spec.records = str(path)
    if spec.records:
        from areal_kernel.services.agent.service import read_jsonl

        read_jsonl(Path(spec.records), "--records" if args.records != "-" else "--records - (stdin)")
    return spec


def cmd_run(args: argparse.Namespace) -> int:
    from areal_kernel.utils.network import port_is_free

    home = agent_home()
    with _locked(home):
        state = read_state(home, STATE_NAME)
        if state is not None:
            if gateway_alive(state):
                raise ArealError(
                    f"the agent service already runs (pid {state['pid']}, {state.get('url')}); `areal agent stop` "
                    "stops it"
                )
            print(_remove_stale(home, state), file=sys.stderr)
        spec = _spec(args, home)
        if spec.port and not port_is_free(spec.port, spec.host, reuse_addr=True):
            raise ArealError(
                f"--port {spec.port}: {spec.host}:{spec.port} is already in use by another process; choose another "
                "port (areal agent run --port N)"
            )
        write_atomic(home / SPEC_NAME, spec.model_dump_json(indent=2) + "\n", mode=0o600)
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        token = args.admin_token or os.environ.get(ADMIN_TOKEN_ENV)
        if token:
            env[ADMIN_TOKEN_ENV] = token
        pkg_root = str(Path(__file__).resolve().parents[3])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH", "")) if p)
        log_path = home / LOG_NAME
        offset = log_path.stat().st_size if log_path.exists() else 0
        with open(log_path, "ab") as logf:
            logf.write(
                f"\n=== areal agent run: {spec.agent} x{spec.workers} ({time.strftime('%Y-%m-%d %H:%M:%S')})\n".encode()
            )
            logf.flush()
            proc = subprocess.Popen(
                [sys.executable, "-m", SERVICE_MODULE, "--home", str(home)], stdout=logf, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=env, cwd=str(home), start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + args.timeout
        while True:
            rc = proc.poll()
            if rc is not None:
                raise ArealError(_failure(log_path, offset, rc))
            state = read_state(home, STATE_NAME)
            if state is not None and state.get("pid") == proc.pid:
                try:
                    st = _call(state, "GET", "/admin/status", timeout=5.0, what=WHAT)
                    if st["service"]["state"] == "running":
                        break
                except ArealError:
                    pass
            if time.monotonic() > deadline:
                kill_leftovers(state if state is not None and state.get("pid") == proc.pid else {"pid": proc.pid})
                raise ArealError(f"the agent service did not start within {args.timeout:g} s; see {log_path}")
            time.sleep(0.2)
    svc = st["service"]
    print(f"areal agent: {spec.workers} worker(s) of {spec.agent} running (service pid {proc.pid}, {svc['url']}); "
          f"proxy {svc['proxy']}; sessions -> {home / SESSION_LOG}")  # fmt: skip
    return 0


def _failure(log_path: Path, offset: int, rc: int) -> str:
    try:
        with open(log_path, errors="replace") as f:
            f.seek(offset)
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in reversed(lines):
        if line.startswith("error: "):
            return line[len("error: ") :]
    return f"the agent service exited with code {rc} while starting; its log: {log_path}\n" + "\n".join(lines[-20:])


def _processes(st: dict[str, Any]) -> list[dict[str, Any]]:
    s = st["service"]
    rows = [{"kind": "service", "index": "-", "pid": s["pid"], "state": s["state"], "restarts": 0, "log": s["log"]}]
    for r in (st.get("model") or {}).get("replicas", []):
        rows.append({"kind": "replica", "index": r["index"], "pid": r["pid"], "state": r["health"],
                     "restarts": r["restarts"], "log": r["log"]})  # fmt: skip
    for w in st["workers"]:
        rows.append({"kind": "worker", "index": w["index"], "pid": w["pid"], "state": w["state"],
                     "restarts": w["restarts"], "log": w["log"]})  # fmt: skip
    return rows


def cmd_ps(args: argparse.Namespace) -> int:
    rows = _processes(_status(agent_home()))
    if args.json:
        print(json.dumps({"processes": rows}, indent=2))
    else:
        keys = ["kind", "index", "pid", "state", "restarts", "log"]
        print(_table([[r[k] for k in keys] for r in rows], [k.upper() for k in keys]))
    return 0


def _render(st: dict[str, Any]) -> str:
    s, n = st["service"], st["sessions"]
    mean = "-" if st["reward_mean"] is None else f"{st['reward_mean']:.3f}"
    model = f"model {s['model_name']} ({s['backend']})" if s["mode"] == "local" else "online RL"
    lines = [
        f"agent service {s['state']} (pid {s['pid']}, {s['url']}, up {s['uptime_s']:.0f} s): {s['agent']}; "
        f"{model}; proxy {s['proxy']}",
        f"sessions: {n['open']} open, {n['finished']} finished, {n['failed']} failed; reward mean {mean}; "
        f"{st['tokens_per_s']:.1f} tokens/s; records {st['records']['total']} ({st['records']['queued']} queued, "
        f"epoch {st['records']['epoch']})",
        "",
        _table(
            [
                [w["index"], w["pid"], w["state"], w["restarts"], w["sessions"], w["session"] or "-"]
                for w in st["workers"]
            ],
            ["WORKER", "PID", "STATE", "RESTARTS", "SESSIONS", "SESSION"],
        ),
    ]
    if s.get("error"):
        lines.insert(1, f"error: {s['error']}")
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    home = agent_home()
    try:
        while True:
            st = _status(home)
            print(json.dumps(st, indent=2) if args.json else _render(st), flush=True)
            if not args.watch:
                return 0
            time.sleep(max(0.2, args.interval))
            if not args.json:
                print()
    except KeyboardInterrupt:
        return 0


def cmd_logs(args: argparse.Namespace) -> int:
    home = agent_home()
    path = home / LOG_NAME
    if args.worker is not None:
        path = home / "workers" / f"worker-{args.worker}.log"
        if not path.exists():
            known = (
                sorted(p.stem for p in (home / "workers").glob("worker-*.log")) if (home / "workers").is_dir() else []
            )
            raise ArealError(f"--worker {args.worker}: no log of that worker in {home / 'workers'}; "
                             f"known: {', '.join(known) or 'none'}")  # fmt: skip
    if not path.exists():
        raise ArealError(f"{path}: no log yet")
    return follow_file(path, args.lines, args.follow)


def cmd_stop(args: argparse.Namespace) -> int:
    home = agent_home()
    with _locked(home):
        state = read_state(home, STATE_NAME)
        if state is None:
            print("areal agent: the agent service is not running", file=sys.stderr)
            return 0
        if not gateway_alive(state):
            print(_remove_stale(home, state))
            return 0
        try:
            _call(state, "POST", "/admin/shutdown", timeout=10.0, what=WHAT)
        except ArealError as e:
            print(f"areal agent: the service did not take the shutdown request ({e}); killing it", file=sys.stderr)
        deadline = time.monotonic() + args.timeout
        while gateway_alive(state) and time.monotonic() < deadline:
            time.sleep(0.1)
        latest = read_state(home, STATE_NAME) or state
        forced = kill_leftovers(latest) + kill_leftovers(state)
        remove_state(home, name=STATE_NAME)
    reps = state.get("replicas") or {}
    extra = f"; killed {len(set(forced))} process group(s) left after {args.timeout:g} s" if forced else ""
    print(f"areal agent: stopped the service (pid {state['pid']}), {len(reps.get('workers', []))} worker(s) and "
          f"{len(reps.get('model', []))} model replica(s){extra}")  # fmt: skip
    return 0
