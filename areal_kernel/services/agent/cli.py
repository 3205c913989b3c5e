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
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from areal_kernel.errors import ArealError, ConfigError
from areal_kernel.services.agent.spec import AGENT, LOG_NAME, RECORDS_NAME, SESSION_LOG, SPEC_NAME, AgentRunSpec
from areal_kernel.services.detached import (
    add_follow_options,
    add_stop_command,
    follow_file,
    interruptible,
    locked,
    parse_settings,
    print_processes,
    table,
    write_atomic,
)

SERVICE_MODULE = "areal_kernel.services.agent.service"


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
    add_follow_options(p)
    p.set_defaults(func=cmd_logs)
    add_stop_command(cmds, "stop the service, its workers and model replicas", cmd_stop)


def _status(home: Path) -> dict[str, Any]:
    return AGENT.call(AGENT.running_state(home), "GET", "/admin/status")


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
        "dtype": args.dtype, "args": parse_settings(args.settings), "max_restarts": args.max_restarts,
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
    home = AGENT.home()
    with locked(home):
        AGENT.check_not_running(home)
        spec = _spec(args, home)
        AGENT.check_port(spec.host, spec.port)
        write_atomic(home / SPEC_NAME, spec.model_dump_json(indent=2) + "\n", mode=0o600)

        def running(state: dict[str, Any]) -> dict[str, Any] | None:
            st = AGENT.call(state, "GET", "/admin/status", timeout=5.0)
            return st if st["service"]["state"] == "running" else None

        proc, _, st = AGENT.start(
            home, [SERVICE_MODULE, "--home", str(home)], f"{spec.agent} x{spec.workers}", args.admin_token, running,
            args.timeout,
        )  # fmt: skip
    svc = st["service"]
    print(f"areal agent: {spec.workers} worker(s) of {spec.agent} running (service pid {proc.pid}, {svc['url']}); "
          f"proxy {svc['proxy']}; sessions -> {home / SESSION_LOG}")  # fmt: skip
    return 0


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
    keys = ["kind", "index", "pid", "state", "restarts", "log"]
    return print_processes(_processes(_status(AGENT.home())), keys, args.json)


def _render(st: dict[str, Any]) -> str:
    s, n = st["service"], st["sessions"]
    mean = "-" if st["reward_mean"] is None else f"{st['reward_mean']:.3f}"
    model = f"model {s['model_name']} ({s['backend']})" if s["mode"] == "local" else "online RL"
    r = st["records"]
    epochs = f"epoch {r['epoch']}" + (
        f" of {r['epochs']}" if r.get("epochs") else ", repeating" if "epochs" in r else ""
    )
    lines = [
        f"agent service {s['state']} (pid {s['pid']}, {s['url']}, up {s['uptime_s']:.0f} s): {s['agent']}; "
        f"{model}; proxy {s['proxy']}",
        f"sessions: {n['open']} open, {n['finished']} finished, {n['failed']} failed; reward mean {mean}; "
        f"{st['tokens_per_s']:.1f} tokens/s; records {r['total']} ({r['queued']} queued, {epochs})",
        "",
        table(
            [
                [w["index"], w["pid"], w["state"], w["restarts"], w["sessions"], w["session"] or "-"]
                for w in st["workers"]
            ],
            ["WORKER", "PID", "STATE", "RESTARTS", "SESSIONS", "SESSION"],
        ),
    ]
    if r.get("done"):
        lines.insert(2, "done: every record ran; the workers are idle (`areal agent stop` ends the service)")
    if s.get("error"):
        lines.insert(1, f"error: {s['error']}")
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    home = AGENT.home()
    if args.watch:
        interruptible()
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
    home = AGENT.home()
    path = home / LOG_NAME
    if args.worker is not None:
        path = home / "workers" / f"worker-{args.worker}.log"
        if not path.exists():
            known = (
                sorted(p.stem for p in (home / "workers").glob("worker-*.log")) if (home / "workers").is_dir() else []
            )
            raise ArealError(f"--worker {args.worker}: no log of that worker in {home / 'workers'}; "
                             f"known: {', '.join(known) or 'none'}")  # fmt: skip
    return follow_file(path, args.lines, args.follow)


def cmd_stop(args: argparse.Namespace) -> int:
    stopped = AGENT.stop(AGENT.home(), args.timeout)
    if stopped is not None:
        state, extra = stopped
        reps = state.get("replicas") or {}
        print(f"areal agent: stopped the service (pid {state['pid']}), {len(reps.get('workers', []))} worker(s) and "
              f"{len(reps.get('model', []))} model replica(s){extra}")  # fmt: skip
    return 0
