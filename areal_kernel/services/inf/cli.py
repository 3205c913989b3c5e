"""``areal inf run|register|deregister|models|ps|status|logs|stop``.

Each command is a short-lived process: it finds the gateway through
``$AREAL_HOME/inf/gateway.json`` and talks to it over HTTP (with the admin
token the state file holds, when the gateway requires one). Every mistake is
one ``areal: error: ...`` line (the CLI's ``ArealError`` handling).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from areal_kernel.errors import ArealError, ConfigError
from areal_kernel.services.detached import (
    add_follow_options,
    add_stop_command,
    connect_host,
    follow_file,
    locked,
    parse_settings,
    print_processes,
    state_alive,
    table,
)
from areal_kernel.services.inf.state import INF, LOG_NAME, STATE_NAME, check_model_name, load_config

GATEWAY_MODULE = "areal_kernel.services.inf.gateway"


def add_parser(sub: Any) -> None:
    """Add ``areal inf ...`` to the ``areal`` command's subparsers."""
    inf = sub.add_parser(
        "inf",
        help="local inference service: serve registered models behind one OpenAI-compatible gateway",
        description="A local inference service (docs/services.md). State lives under $AREAL_HOME/inf "
        "(default ~/.areal/inf).",
    )
    cmds = inf.add_subparsers(dest="inf_command", metavar="INF_COMMAND")
    inf.set_defaults(func=lambda a: _usage(inf))

    p = cmds.add_parser("run", help="start the gateway (detached) and every model registered before")
    p.add_argument(
        "--host", default=None, help="bind address (default 127.0.0.1; beyond loopback an admin token is required)"
    )
    p.add_argument("--port", type=int, default=None, help="port (default 8000, or [gateway] port in config.toml)")
    p.add_argument(
        "--admin-token",
        default=None,
        help="bearer token for control routes (default: generated when not on loopback; also AREAL_INF_ADMIN_TOKEN)",
    )
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the gateway to listen")
    p.set_defaults(func=cmd_run)

    p = cmds.add_parser("register", help="start a model's replicas and route requests naming it to them")
    p.add_argument("--model-name", required=True, help="the name requests use ('model' in the OpenAI body)")
    p.add_argument(
        "--backend", required=True, help="inference backend and replicas: embedded, embedded:d2, vllm:d1t2, ..."
    )
    p.add_argument("--model-path", required=True, help="HF model directory or a registered model name")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="weights dtype (default float32)")
    p.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a backend setting (its config section, e.g. max_model_len=1024); repeatable",
    )
    p.add_argument("--max-restarts", type=int, default=3, help="restarts allowed per replica (default 3)")
    p.add_argument("--no-wait", action="store_true", help="return once validated; `areal inf status` shows progress")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for the replicas to be healthy")
    p.set_defaults(func=cmd_register)

    p = cmds.add_parser("deregister", help="stop a model's replicas and forget it")
    p.add_argument("model", help="registered model name")
    p.set_defaults(func=cmd_deregister)

    for name, helptext, func in (
        ("models", "registered models", cmd_models),
        ("ps", "processes: the gateway and every replica", cmd_ps),
    ):
        p = cmds.add_parser(name, help=helptext)
        p.add_argument("--json", action="store_true")
        p.set_defaults(func=func)

    p = cmds.add_parser("status", help="the service and its models (one model in detail with MODEL)")
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

    p = cmds.add_parser("logs", help="a replica's log (default: the gateway's)")
    p.add_argument("model", nargs="?", default=None, help="registered model name (none: the gateway's log)")
    p.add_argument("--replica", type=int, default=0, help="replica index (default 0)")
    add_follow_options(p)
    p.set_defaults(func=cmd_logs)
    add_stop_command(cmds, "stop the gateway and every replica (registered models stay in config.toml)", cmd_stop)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


# -- commands --------------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    home = INF.home()
    with locked(home):
        INF.check_not_running(home)
        cfg = load_config(home)  # a broken config.toml is reported here, not in the gateway's log
        host = args.host or cfg.gateway.host
        port = args.port or cfg.gateway.port
        if not 1 <= port <= 65535:
            raise ConfigError(f"--port {port}: must be in 1..65535")
        INF.check_port(host, port)
        proc, state, _ = INF.start(
            home,
            [GATEWAY_MODULE, "--home", str(home), "--host", host, "--port", str(port)],
            f"gateway on {host}:{port}",
            args.admin_token,
            lambda st: INF.call(st, "GET", "/health", timeout=2.0),
            args.timeout,
        )
    n = len(cfg.models)
    restoring = f"; starting {n} registered model(s): {', '.join(cfg.models)} (areal inf status)" if n else ""
    shown = f"[{host}]" if ":" in host else host
    print(f"areal inf: gateway on http://{shown}:{port}/v1 (pid {proc.pid}){restoring}")
    if state.get("admin_token") and not (args.admin_token or os.environ.get(INF.token_env)):
        print(f"areal inf: control routes need the admin token stored in {home / STATE_NAME}")
    return 0


def cmd_register(args: argparse.Namespace) -> int:
    home = INF.home()
    name = check_model_name(args.model_name)
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts {args.max_restarts}: must be >= 0")
    settings = parse_settings(args.settings)
    # A path is the caller's: the gateway runs elsewhere (its cwd is the service directory).
    path = args.model_path
    if os.path.exists(os.path.expanduser(path)):
        path = os.path.abspath(os.path.expanduser(path))
    body = {
        "name": name,
        "backend": args.backend,
        "model_path": path,
        "dtype": args.dtype,
        "max_restarts": args.max_restarts,
        "args": settings,
    }
    state = INF.running_state(home)
    # Validation (and a first model conversion) happens in the gateway before it answers.
    INF.call(state, "POST", "/admin/models", body, timeout=600.0)
    if args.no_wait:
        print(f"areal inf: registered {name} ({args.backend}); starting — `areal inf status {name}` shows progress")
        return 0
    deadline = time.monotonic() + args.timeout
    while True:
        st = INF.call(state, "GET", f"/admin/models/{name}")
        if st["state"] == "ready":
            break
        if st["state"] == "failed":
            raise ArealError(f"register {name}: {st.get('error')}")
        if time.monotonic() > deadline:
            raise ArealError(
                f"register {name}: replicas not healthy after {args.timeout:g} s (still {st['state']}); "
                f"`areal inf logs {name}` shows why"
            )
        time.sleep(0.25)
    reps = st["replicas"]
    print(
        f"areal inf: {name} ready: {len(reps)} replica(s) of {args.backend} at "
        f'{", ".join(r["address"] for r in reps)}; requests with "model": "{name}" go to '
        f"http://{connect_host(state['host'])}:{state['port']}/v1"
    )
    return 0


def cmd_deregister(args: argparse.Namespace) -> int:
    state = INF.running_state(INF.home())
    out = INF.call(state, "DELETE", f"/admin/models/{args.model}", timeout=600.0)
    print(f"areal inf: deregistered {out['name']} ({out['replicas_stopped']} replica(s) stopped)")
    return 0


def _status(home: Path) -> dict[str, Any]:
    return INF.call(INF.running_state(home), "GET", "/admin/status")


def cmd_models(args: argparse.Namespace) -> int:
    st = _status(INF.home())
    models = [{k: m[k] for k in ("name", "backend", "state", "model_path")} for m in st["models"]]
    if args.json:
        print(json.dumps({"models": models}, indent=2))
    elif not models:
        print("no models registered (areal inf register --model-name NAME --backend embedded --model-path PATH)")
    else:
        print(
            table(
                [[m["name"], m["backend"], m["state"], m["model_path"]] for m in models],
                ["MODEL", "BACKEND", "STATE", "PATH"],
            )
        )
    return 0


def _processes(st: dict[str, Any]) -> list[dict[str, Any]]:
    g = st["gateway"]
    rows: list[dict[str, Any]] = [
        {"model": "-", "replica": "gateway", "pid": g["pid"], "address": f"{g['host']}:{g['port']}",
         "health": "healthy", "restarts": 0, "log": g["log"]}
    ]  # fmt: skip
    for m in st["models"]:
        for r in m["replicas"]:
            rows.append(
                {"model": m["name"], "replica": r["index"], "pid": r["pid"], "address": r["address"],
                 "health": r["health"], "restarts": r["restarts"], "log": r["log"]}
            )  # fmt: skip
    return rows


def cmd_ps(args: argparse.Namespace) -> int:
    keys = ["model", "replica", "pid", "address", "health", "restarts", "log"]
    return print_processes(_processes(_status(INF.home())), keys, args.json)


def _age(t: float) -> str:
    s = int(time.time() - t)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def cmd_status(args: argparse.Namespace) -> int:
    st = _status(INF.home())
    if args.model is not None:
        found = [m for m in st["models"] if m["name"] == args.model]
        if not found:
            known = ", ".join(m["name"] for m in st["models"]) or "none"
            raise ArealError(f"no model named '{args.model}' is registered; registered: {known}")
        m = found[0]
        if args.json:
            print(json.dumps(m, indent=2))
            return 0
        print(f"model {m['name']}: {m['state']}  backend {m['backend']}  path {m['model_dir'] or m['model_path']}")
        if m["args"]:
            print(f"  settings: {json.dumps(m['args'])}")
        if m["error"]:
            print(f"  error: {m['error']}")
        print(f"  requests: {m['requests']}")
        keys = ["index", "pid", "address", "health", "restarts", "log"]
        if m["replicas"]:
            print(table([[r[k] for k in keys] for r in m["replicas"]], ["REPLICA", *[k.upper() for k in keys[1:]]]))
        return 0
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    g = st["gateway"]
    token = "admin token required" if g["admin_token_required"] else "loopback, no admin token"
    print(f"gateway {g['url']}/v1  pid {g['pid']}  up {_age(g['started'])}  ({token})")
    rows = []
    for m in st["models"]:
        reps = m["replicas"]
        healthy = sum(r["health"] == "healthy" for r in reps)
        rows.append([m["name"], m["backend"], m["state"], f"{healthy}/{len(reps)}", sum(r["restarts"] for r in reps),
                     m["requests"], (m["error"] or "").splitlines()[0][:80] if m["error"] else ""])  # fmt: skip
    if rows:
        print(table(rows, ["MODEL", "BACKEND", "STATE", "HEALTHY", "RESTARTS", "REQUESTS", "ERROR"]))
    else:
        print("no models registered")
    return 0


def _log_path(home: Path, model: str | None, replica: int) -> Path:
    if model is None:
        return home / LOG_NAME
    state = INF.read_state(home)
    if state is not None and state_alive(state):
        st = INF.call(state, "GET", "/admin/status")
        for m in st["models"]:
            if m["name"] == model:
                reps = m["replicas"]
                if not 0 <= replica < len(reps):
                    raise ArealError(
                        f"--replica {replica}: model '{model}' has {len(reps)} replica(s) (0..{len(reps) - 1})"
                    )
                return Path(reps[replica]["log"])
    # The gateway is gone (or does not know it): the logs stay on disk.
    mdir = home / "models" / model
    if not mdir.is_dir():
        registered = sorted(load_config(home).models)
        on_disk = sorted(p.name for p in (home / "models").iterdir()) if (home / "models").is_dir() else []
        gone = [m for m in on_disk if m not in registered]
        kept = f"; logs kept of deregistered models: {', '.join(gone)}" if gone else ""
        raise ArealError(
            f"no logs for a model named '{model}' under {home / 'models'}; registered models: "
            f"{', '.join(registered) or 'none'}{kept}"
        )
    found = sorted(mdir.rglob(f"*server-{replica}.log"))
    if not found:
        raise ArealError(f"--replica {replica}: no log of replica {replica} of '{model}' under {mdir}")
    return found[0]


def cmd_logs(args: argparse.Namespace) -> int:
    path = _log_path(INF.home(), args.model, args.replica)
    return follow_file(path, args.lines, args.follow)


def cmd_stop(args: argparse.Namespace) -> int:
    stopped = INF.stop(INF.home(), args.timeout)
    if stopped is not None:
        state, extra = stopped
        n = sum(len(v) for v in (state.get("replicas") or {}).values())
        print(f"areal inf: stopped the gateway (pid {state['pid']}) and {n} replica(s){extra}")
    return 0
