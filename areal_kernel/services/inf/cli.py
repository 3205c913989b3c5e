"""``areal inf run|register|deregister|models|ps|status|logs|stop``.

Each command is a short-lived process: it finds the gateway through
``$AREAL_HOME/inf/gateway.json`` and talks to it over HTTP (with the admin
token the state file holds, when the gateway requires one). Every mistake is
one ``areal: error: ...`` line (the CLI's ``ArealError`` handling).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

from areal_kernel.errors import ArealError, ConfigError
from areal_kernel.services.inf.state import (
    LOCK_NAME,
    LOG_NAME,
    STATE_NAME,
    check_model_name,
    gateway_alive,
    inf_home,
    kill_leftovers,
    load_config,
    read_state,
    remove_state,
)

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
    p.add_argument("-n", "--lines", type=int, default=40, help="lines to show first (default 40)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing what is appended (Ctrl-C ends)")
    p.set_defaults(func=cmd_logs)

    p = cmds.add_parser("stop", help="stop the gateway and every replica (registered models stay in config.toml)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before what is left is killed")
    p.set_defaults(func=cmd_stop)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


# -- talking to the gateway ------------------------------------------------------------


@contextlib.contextmanager
def _locked(home: Path) -> Iterator[None]:
    """One `run`/`stop` at a time on a service directory."""
    home.mkdir(parents=True, exist_ok=True)
    with open(home / LOCK_NAME, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def _running_state(home: Path) -> dict[str, Any]:
    state = read_state(home)
    if state is None:
        raise ArealError(
            f"the inference service is not running (no {home / STATE_NAME}); start it with `areal inf run`"
        )
    if not gateway_alive(state):
        raise ArealError(
            f"the inference service is not running: {home / STATE_NAME} names gateway pid {state['pid']}, which is "
            "gone (a stale state file); `areal inf run` replaces it, `areal inf stop` cleans up"
        )
    return state


def _call(
    state: dict[str, Any], method: str, path: str, body: Any = None, timeout: float = 30.0, what: str = "the gateway"
) -> Any:
    url = f"http://{_connect_host(state['host'])}:{state['port']}{path}"
    headers = {"Content-Type": "application/json"}
    if state.get("admin_token"):
        headers["Authorization"] = f"Bearer {state['admin_token']}"
    data = json.dumps(body).encode() if body is not None else (b"" if method != "GET" else None)
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            msg = json.loads(raw)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            msg = raw.decode(errors="replace")[:500] or f"HTTP {e.code}"
        raise ArealError(msg) from None
    except (urllib.error.URLError, OSError) as e:
        raise ArealError(f"{what} (pid {state['pid']}) at {url} does not answer: {e}") from None


# -- commands --------------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    from areal_kernel.utils.network import port_is_free

    home = inf_home()
    with _locked(home):
        state = read_state(home)
        if state is not None:
            if gateway_alive(state):
                raise ArealError(
                    f"the inference service already runs (gateway pid {state['pid']}, {state.get('url')}); "
                    "`areal inf stop` stops it"
                )
            killed = kill_leftovers(state)
            remove_state(home)
            left = f"; stopped {len(killed)} leftover process group(s)" if killed else ""
            print(
                f"areal inf: removed a stale state file ({home / STATE_NAME}: gateway pid {state['pid']} is gone){left}",
                file=sys.stderr,
            )
        cfg = load_config(home)  # a broken config.toml is reported here, not in the gateway's log
        host = args.host or cfg.gateway.host
        port = args.port or cfg.gateway.port
        if not 1 <= port <= 65535:
            raise ConfigError(f"--port {port}: must be in 1..65535")
        if not port_is_free(port, host, reuse_addr=True):
            raise ArealError(
                f"--port {port}: {host}:{port} is already in use by another process; choose another port "
                "(areal inf run --port N)"
            )
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        token = args.admin_token or os.environ.get("AREAL_INF_ADMIN_TOKEN")
        if token:
            env["AREAL_INF_ADMIN_TOKEN"] = token
        # Let the gateway import this very package even when it is not installed.
        pkg_root = str(Path(__file__).resolve().parents[3])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH", "")) if p)
        cmd = [sys.executable, "-m", GATEWAY_MODULE, "--home", str(home), "--host", host, "--port", str(port)]
        log_path = home / LOG_NAME
        offset = log_path.stat().st_size if log_path.exists() else 0
        with open(log_path, "ab") as logf:
            logf.write(
                f"\n=== areal inf run: gateway on {host}:{port} ({time.strftime('%Y-%m-%d %H:%M:%S')})\n".encode()
            )
            logf.flush()
            proc = subprocess.Popen(
                cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=str(home),
                start_new_session=True,  # its own session: it outlives this command and its terminal
            )  # fmt: skip
        deadline = time.monotonic() + args.timeout
        while True:
            rc = proc.poll()
            if rc is not None:
                raise ArealError(_gateway_failure(log_path, offset, rc))
            state = read_state(home)
            if state is not None and state.get("pid") == proc.pid:
                try:
                    _call(state, "GET", "/health", timeout=2.0)
                    break
                except ArealError:
                    pass
            if time.monotonic() > deadline:
                kill_leftovers({"pid": proc.pid})
                raise ArealError(f"the gateway did not start listening within {args.timeout:g} s; see {log_path}")
            time.sleep(0.1)
    n = len(cfg.models)
    restoring = f"; starting {n} registered model(s): {', '.join(cfg.models)} (areal inf status)" if n else ""
    print(f"areal inf: gateway on http://{host}:{port} (pid {proc.pid}){restoring}")
    if state.get("admin_token") and not token:
        print(f"areal inf: control routes need the admin token stored in {home / STATE_NAME}")
    return 0


def _gateway_failure(log_path: Path, offset: int, rc: int) -> str:
    """The gateway's own one-line reason (``error: ...``) when it exited at start."""
    try:
        with open(log_path, errors="replace") as f:
            f.seek(offset)
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in reversed(lines):
        if line.startswith("error: "):
            return line[len("error: ") :]
    tail = "\n".join(lines[-20:])
    return f"the gateway exited with code {rc} while starting; its log ({log_path}):\n{tail}"


def _parse_settings(items: list[str]) -> dict[str, Any]:
    from areal_kernel.config.overrides import parse_override

    out: dict[str, Any] = {}
    for text in items:
        if "=" not in text or not text.partition("=")[0].strip():
            raise ConfigError(f"--set {text!r}: must look like key=value (e.g. --set max_model_len=1024)")
        try:
            parts, value = parse_override(text)
        except ConfigError as e:
            raise ConfigError(str(e).replace("override", "--set", 1)) from None
        node = out
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {text!r}: '{part}' was already given a value, not settings")
            node = nxt
        node[parts[-1]] = value
    return out


def cmd_register(args: argparse.Namespace) -> int:
    home = inf_home()
    name = check_model_name(args.model_name)
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts {args.max_restarts}: must be >= 0")
    settings = _parse_settings(args.settings)
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
    state = _running_state(home)
    # Validation (and a first model conversion) happens in the gateway before it answers.
    _call(state, "POST", "/admin/models", body, timeout=600.0)
    if args.no_wait:
        print(f"areal inf: registered {name} ({args.backend}); starting — `areal inf status {name}` shows progress")
        return 0
    deadline = time.monotonic() + args.timeout
    while True:
        st = _call(state, "GET", f"/admin/models/{name}")
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
        f"http://{_connect_host(state['host'])}:{state['port']}/v1"
    )
    return 0


def cmd_deregister(args: argparse.Namespace) -> int:
    state = _running_state(inf_home())
    out = _call(state, "DELETE", f"/admin/models/{args.model}", timeout=600.0)
    print(f"areal inf: deregistered {out['name']} ({out['replicas_stopped']} replica(s) stopped)")
    return 0


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*map(str, r)).rstrip() for r in [header, *rows])


def _status(home: Path) -> dict[str, Any]:
    return _call(_running_state(home), "GET", "/admin/status")


def cmd_models(args: argparse.Namespace) -> int:
    st = _status(inf_home())
    models = [{k: m[k] for k in ("name", "backend", "state", "model_path")} for m in st["models"]]
    if args.json:
        print(json.dumps({"models": models}, indent=2))
    elif not models:
        print("no models registered (areal inf register --model-name NAME --backend embedded --model-path PATH)")
    else:
        print(
            _table(
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
    rows = _processes(_status(inf_home()))
    if args.json:
        print(json.dumps({"processes": rows}, indent=2))
    else:
        keys = ["model", "replica", "pid", "address", "health", "restarts", "log"]
        print(_table([[r[k] for k in keys] for r in rows], [k.upper() for k in keys]))
    return 0


def _age(t: float) -> str:
    s = int(time.time() - t)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def cmd_status(args: argparse.Namespace) -> int:
    st = _status(inf_home())
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
            print(_table([[r[k] for k in keys] for r in m["replicas"]], ["REPLICA", *[k.upper() for k in keys[1:]]]))
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
        print(_table(rows, ["MODEL", "BACKEND", "STATE", "HEALTHY", "RESTARTS", "REQUESTS", "ERROR"]))
    else:
        print("no models registered")
    return 0


def _log_path(home: Path, model: str | None, replica: int) -> Path:
    if model is None:
        return home / LOG_NAME
    state = read_state(home)
    if state is not None and gateway_alive(state):
        st = _call(state, "GET", "/admin/status")
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
        known = sorted(p.name for p in (home / "models").iterdir()) if (home / "models").is_dir() else []
        raise ArealError(
            f"no logs for a model named '{model}' under {home / 'models'}; known: {', '.join(known) or 'none'}"
        )
    found = sorted(mdir.rglob(f"*server-{replica}.log"))
    if not found:
        raise ArealError(f"--replica {replica}: no log of replica {replica} of '{model}' under {mdir}")
    return found[0]


def cmd_logs(args: argparse.Namespace) -> int:
    path = _log_path(inf_home(), args.model, args.replica)
    if not path.exists():
        raise ArealError(f"{path}: no log yet")
    return follow_file(path, args.lines, args.follow)


def follow_file(path: Path, lines: int, follow: bool) -> int:
    """Print the last ``lines`` lines of ``path``; with ``follow``, then what
    is appended until Ctrl-C (a truncated file is read again from its start)."""
    from collections import deque

    with open(path, "rb") as f:
        for line in deque(f, maxlen=max(0, lines)):
            sys.stdout.write(line.decode(errors="replace"))
        sys.stdout.flush()
        if not follow:
            return 0
        try:
            while True:
                chunk = f.read()
                if chunk:
                    sys.stdout.write(chunk.decode(errors="replace"))
                    sys.stdout.flush()
                    continue
                if path.exists() and path.stat().st_size < f.tell():
                    f.seek(0)  # truncated: start over
                time.sleep(0.2)
        except KeyboardInterrupt:
            return 0


def cmd_stop(args: argparse.Namespace) -> int:
    home = inf_home()
    with _locked(home):
        state = read_state(home)
        if state is None:
            print("areal inf: the inference service is not running", file=sys.stderr)
            return 0
        if not gateway_alive(state):
            killed = kill_leftovers(state)
            remove_state(home)
            left = f"; stopped {len(killed)} leftover process group(s)" if killed else ""
            print(
                f"areal inf: removed a stale state file ({home / STATE_NAME}: gateway pid {state['pid']} is gone){left}"
            )
            return 0
        try:
            _call(state, "POST", "/admin/shutdown", timeout=10.0)
        except ArealError as e:
            print(f"areal inf: the gateway did not take the shutdown request ({e}); killing it", file=sys.stderr)
        deadline = time.monotonic() + args.timeout
        while gateway_alive(state) and time.monotonic() < deadline:
            time.sleep(0.1)
        # Whatever is left (a gateway that hung, a replica it failed to stop) is killed by process group.
        latest = read_state(home) or state
        forced = kill_leftovers(latest) + kill_leftovers(state)
        remove_state(home)
    n = sum(len(v) for v in (state.get("replicas") or {}).values())
    extra = f"; killed {len(set(forced))} process group(s) left after {args.timeout:g} s" if forced else ""
    print(f"areal inf: stopped the gateway (pid {state['pid']}) and {n} replica(s){extra}")
    return 0
