"""Plumbing shared by the kernel's detached services (``areal inf``, ``areal agent``).

Each service is one process started by its CLI in its own session, so it
outlives the command. It lives in a directory under ``$AREAL_HOME`` and
announces itself in a state file there (pid, process start time, address,
admin token, the process groups it started) which it writes itself and
removes when it stops; a state file whose pid is gone (or now belongs to
another process: the start time differs) is *stale*. When it cannot start it
prints one ``error: ...`` line to its log and exits; the CLI that started it
shows that line as its own error.

``DetachedService`` holds what differs between the services (names, files,
wording of their messages); the functions are the same for every service.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import http.client
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from areal_kernel.errors import ArealError, ConfigError

LOCK_NAME = "lock"
ERROR_PREFIX = "error: "  # a service's reason for not starting, one line in its log


def service_home(name: str) -> Path:
    """``$AREAL_HOME/<name>``, or ``~/.areal/<name>``."""
    base = os.environ.get("AREAL_HOME") or os.path.join(os.path.expanduser("~"), ".areal")
    return Path(base).expanduser().absolute() / name


def write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# -- processes ----------------------------------------------------------------------------


def process_start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), None when
    it does not exist. With the pid it names one process even after pid reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return int(fields[19])  # field 22 of proc(5), counted from field 3


def process_alive(pid: int, start_time: int | None) -> bool:
    """``pid`` runs and is the same process as when ``start_time`` was read
    (a zombie counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    if stat[stat.rfind(")") + 2 :].split()[0] == "Z":
        return False
    return start_time is None or process_start_time(pid) == start_time


def group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is in process group ``pgid``."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        rest = stat[stat.rfind(")") + 2 :].split()
        if rest[0] != "Z" and int(rest[2]) == pgid:
            return True
    return False


def kill_groups(pgids: list[int], grace_s: float = 5.0) -> None:
    """SIGTERM the process groups, SIGKILL what is left after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pgids:
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 10.0)
        while time.monotonic() < deadline and any(group_alive(pid) for pid in pgids):
            time.sleep(0.1)


def spawn_logged(cmd: list[str], log_path: Path, header: str, env: dict[str, str], cwd: str) -> subprocess.Popen:
    """Start ``cmd`` writing to ``log_path`` (appended, after ``header``) as the
    leader of its own session: it outlives its starter's terminal, and is
    stopped (and killed) as one process group, never by name."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as logf:
        logf.write(header.encode())
        logf.flush()
        return subprocess.Popen(
            cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=cwd,
            start_new_session=True,
        )  # fmt: skip


def connect_host(host: str) -> str:
    """Where to reach a server bound to ``host`` from this machine."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


# -- state files --------------------------------------------------------------------------


def read_state(path: Path) -> dict[str, Any] | None:
    """A service's state file; None when there is none."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: unreadable state file ({e}); remove it if no gateway runs") from None
    if not isinstance(data, dict) or not isinstance(data.get("pid"), int):
        raise ConfigError(f"{path}: not a gateway state file (no pid); remove it if no gateway runs")
    return data


def remove_state(path: Path, pid: int | None = None) -> None:
    """Remove the state file (only if it still names ``pid``, when given)."""
    try:
        if pid is not None:
            current = json.loads(path.read_text(encoding="utf-8"))
            if current.get("pid") != pid:
                return
        path.unlink()
    except (OSError, ValueError):
        pass


def state_alive(state: dict[str, Any]) -> bool:
    """Whether the service a state file names still runs."""
    return process_alive(int(state["pid"]), state.get("start_time"))


def kill_leftovers(state: dict[str, Any], grace_s: float = 5.0) -> list[int]:
    """Kill the process groups a state file names that still run (the service
    and every process it started, each the leader of its own group), checked
    by start time so a reused pid is never hit. Returns the pids signalled."""
    groups: list[tuple[int, int | None]] = [(int(state["pid"]), state.get("start_time"))]
    for replicas in (state.get("replicas") or {}).values():
        for r in replicas:
            if isinstance(r, dict) and isinstance(r.get("pid"), int):
                groups.append((r["pid"], r.get("start_time")))
    # A group whose leader died may still hold its children (vLLM's engine
    # processes); its pid is then unused, so the group is still ours.
    live = [
        pid for pid, st in groups if process_alive(pid, st) or (process_start_time(pid) is None and group_alive(pid))
    ]
    kill_groups(live, grace_s)
    return live


# -- the CLI's side ----------------------------------------------------------------------------


@contextlib.contextmanager
def locked(home: Path) -> Iterator[None]:
    """One `run`/`stop` at a time on a service directory."""
    home.mkdir(parents=True, exist_ok=True)
    with open(home / LOCK_NAME, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def call(state: dict[str, Any], method: str, path: str, body: Any, timeout: float, what: str) -> Any:
    """One HTTP request to the service a state file names (with its admin
    token); a refusal or no answer is an ``ArealError`` saying why."""
    url = f"http://{connect_host(state['host'])}:{state['port']}{path}"
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
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        raise ArealError(f"{what} (pid {state['pid']}) at {url} does not answer: {e}") from None


def add_follow_options(p: Any) -> None:
    """``-n N`` and ``-f`` of a ``logs`` command (``follow_file``)."""
    p.add_argument("-n", "--lines", type=int, default=40, help="lines to show first (default 40)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing what is appended (Ctrl-C ends)")


def add_stop_command(cmds: Any, helptext: str, func: Callable[[Any], int]) -> None:
    """The ``stop`` command (``DetachedService.stop``)."""
    p = cmds.add_parser("stop", help=helptext)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before what is left is killed")
    p.set_defaults(func=func)


def parse_settings(items: list[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` flags (dotted keys nest) as one settings mapping."""
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


def table(rows: list[list[Any]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*map(str, r)).rstrip() for r in [header, *rows])


def print_processes(rows: list[dict[str, Any]], keys: list[str], as_json: bool) -> int:
    """``areal <service> ps``: one row a process, as a table or JSON."""
    if as_json:
        print(json.dumps({"processes": rows}, indent=2))
    else:
        print(table([[r[k] for k in keys] for r in rows], [k.upper() for k in keys]))
    return 0


def interruptible() -> None:
    """Let Ctrl-C (SIGINT) end a command that runs until interrupted
    (``logs -f``, ``status --watch``). A process started in the background
    by a non-interactive shell inherits SIGINT ignored, and Python then keeps
    ignoring it: such a watcher could only be killed."""
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)


def follow_file(path: Path, lines: int, follow: bool) -> int:
    """Print the last ``lines`` lines of ``path``; with ``follow``, then what
    is appended until Ctrl-C (a truncated file is read again from its start)."""
    from collections import deque

    if not path.exists():
        raise ArealError(f"{path}: no log yet")

    with open(path, "rb") as f:
        for line in deque(f, maxlen=max(0, lines)):
            sys.stdout.write(line.decode(errors="replace"))
        sys.stdout.flush()
        if not follow:
            return 0
        interruptible()
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


@dataclass(frozen=True)
class DetachedService:
    """One detached service: its command, files and the wording of its messages."""

    command: str  # `areal <command> ...`, $AREAL_HOME/<command>, the "areal <command>: " prefix
    title: str  # "the inference service": whether it runs
    process: str  # the process the CLI talks to: "<process> (pid 12) at URL does not answer"
    short: str  # "<short> pid 12 is gone", "the <short> did not take the shutdown request"
    pid_label: str  # "<title> already runs (<pid_label> 12, URL)", "... names <pid_label> 12"
    not_started: str  # "<not_started> within 60 s; see LOG"
    exited: str  # the start of a start failure without an error line; {rc} and {log} filled in
    state_name: str
    log_name: str
    token_env: str  # the admin token travels through the environment, never argv (world-readable in ps)

    def home(self) -> Path:
        return service_home(self.command)

    def read_state(self, home: Path) -> dict[str, Any] | None:
        return read_state(home / self.state_name)

    def write_state(self, home: Path, state: dict[str, Any]) -> None:
        write_atomic(home / self.state_name, json.dumps(state, indent=2) + "\n", mode=0o600)

    def remove_state(self, home: Path, pid: int | None = None) -> None:
        remove_state(home / self.state_name, pid)

    def publish_state(
        self,
        home: Path,
        last: Any,
        *,
        host: str,
        port: int,
        token: str | None,
        started: int,
        replicas: dict[str, list[dict[str, Any]]],
    ) -> dict[str, Any]:
        """Write this (the running service's) state file unless it would say
        what ``last`` (the state written before) says; returns the state.
        ``replicas`` names the processes it started, by kind, as
        ``{"pid", "start_time"}`` entries (``kill_leftovers`` kills them)."""
        state = {
            "pid": os.getpid(),
            "start_time": process_start_time(os.getpid()),
            "host": host,
            "port": port,
            "url": f"http://{host}:{port}",
            "admin_token": token,
            "started": started,
            "log": str(home / self.log_name),
            "replicas": replicas,
        }
        if state != last:
            self.write_state(home, state)
        return state

    def call(self, state: dict[str, Any], method: str, path: str, body: Any = None, timeout: float = 30.0) -> Any:
        return call(state, method, path, body, timeout, self.process)

    def running_state(self, home: Path) -> dict[str, Any]:
        """The state of the running service; an ``ArealError`` when it does not run."""
        path, run = home / self.state_name, f"areal {self.command} run"
        state = read_state(path)
        if state is None:
            raise ArealError(f"{self.title} is not running (no {path}); start it with `{run}`")
        if not state_alive(state):
            raise ArealError(
                f"{self.title} is not running: {path} names {self.pid_label} {state['pid']}, which is gone (a stale "
                f"state file); `{run}` replaces it, `areal {self.command} stop` cleans up"
            )
        return state

    def remove_stale(self, home: Path, state: dict[str, Any]) -> str:
        """Kill what a stale state file still names and remove it; says so."""
        killed = kill_leftovers(state)
        self.remove_state(home)
        left = f"; stopped {len(killed)} leftover process group(s)" if killed else ""
        path = home / self.state_name
        return (
            f"areal {self.command}: removed a stale state file ({path}: {self.short} pid {state['pid']} is gone){left}"
        )

    def check_not_running(self, home: Path) -> None:
        """Before a start, under ``locked(home)``: refuse when the service runs;
        a stale state file is cleaned up (and said so)."""
        state = self.read_state(home)
        if state is not None:
            if state_alive(state):
                raise ArealError(
                    f"{self.title} already runs ({self.pid_label} {state['pid']}, {state.get('url')}); "
                    f"`areal {self.command} stop` stops it"
                )
            print(self.remove_stale(home, state), file=sys.stderr)

    def check_port(self, host: str, port: int) -> None:
        """Refuse a port another process holds (0: the service picks a free one)."""
        from areal_kernel.utils.network import port_is_free

        if port and not port_is_free(port, host, reuse_addr=True):
            raise ArealError(
                f"--port {port}: {host}:{port} is already in use by another process; choose another port "
                f"(areal {self.command} run --port N)"
            )

    def start(
        self,
        home: Path,
        module_args: list[str],
        banner: str,
        admin_token: str | None,
        ready: Callable[[dict[str, Any]], Any],
        timeout: float,
    ) -> tuple[subprocess.Popen, dict[str, Any], Any]:
        """Start ``python -m <module_args>`` detached, under ``locked(home)``, and
        wait until it has written its state file and ``ready(state)`` returns
        something other than None (an ``ArealError`` from it: not yet).
        Returns the process, its state and what ``ready`` returned. A service
        that exits while starting fails with its own ``error:`` line."""
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        token = admin_token or os.environ.get(self.token_env)
        if token:
            env[self.token_env] = token
        # Let the service import this very package even when it is not installed.
        pkg_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH", "")) if p)
        log_path = home / self.log_name
        offset = log_path.stat().st_size if log_path.exists() else 0
        header = f"\n=== areal {self.command} run: {banner} ({time.strftime('%Y-%m-%d %H:%M:%S')})\n"
        proc = spawn_logged([sys.executable, "-m", *module_args], log_path, header, env, str(home))
        deadline = time.monotonic() + timeout
        while True:
            rc = proc.poll()
            if rc is not None:
                raise ArealError(self._start_failure(log_path, offset, rc))
            state = self.read_state(home)
            if state is not None and state.get("pid") != proc.pid:
                state = None  # not yet replaced: an earlier run's
            if state is not None:
                try:
                    out = ready(state)
                    if out is not None:
                        return proc, state, out
                except ArealError:
                    pass
            if time.monotonic() > deadline:
                kill_leftovers(state or {"pid": proc.pid})
                raise ArealError(f"{self.not_started} within {timeout:g} s; see {log_path}")
            time.sleep(0.1)

    def _start_failure(self, log_path: Path, offset: int, rc: int) -> str:
        """The service's own one-line reason (``error: ...``) when it exited at start."""
        try:
            with open(log_path, errors="replace") as f:
                f.seek(offset)
                lines = f.read().splitlines()
        except OSError:
            lines = []
        for line in reversed(lines):
            if line.startswith(ERROR_PREFIX):
                return line[len(ERROR_PREFIX) :]
        return self.exited.format(rc=rc, log=log_path) + "\n" + "\n".join(lines[-20:])

    def stop(self, home: Path, timeout: float) -> tuple[dict[str, Any], str] | None:
        """Ask the running service to stop, kill what is left after ``timeout``.
        Returns its last state and a note on what had to be killed; None (said
        why) when it did not run."""
        prefix = f"areal {self.command}:"
        with locked(home):
            state = self.read_state(home)
            if state is None:
                print(f"{prefix} {self.title} is not running", file=sys.stderr)
                return None
            if not state_alive(state):
                print(self.remove_stale(home, state))
                return None
            try:
                self.call(state, "POST", "/admin/shutdown", timeout=10.0)
            except ArealError as e:
                print(f"{prefix} the {self.short} did not take the shutdown request ({e}); killing it", file=sys.stderr)
            deadline = time.monotonic() + timeout
            while state_alive(state) and time.monotonic() < deadline:
                time.sleep(0.1)
            # Whatever is left (a service that hung, a process it failed to stop) is killed by process group.
            latest = self.read_state(home) or state
            forced = kill_leftovers(latest) + kill_leftovers(state)
            self.remove_state(home)
        extra = f"; killed {len(set(forced))} process group(s) left after {timeout:g} s" if forced else ""
        return state, extra

    # -- the service's side ------------------------------------------------------------------

    def admin_token(self, host: str, configured: str | None = None) -> str | None:
        """This service's admin token: handed over by the CLI, else configured,
        else generated when it listens beyond loopback."""
        from areal_kernel.inference.admin_auth import admin_token_for

        return admin_token_for([host], os.environ.pop(self.token_env, None) or configured)

    async def listen(self, app: Any, host: str, port: int, flag: str = "") -> Any:
        """Serve ``app`` on ``host:port``: its runner, or None when the address
        cannot be bound (said on an ``error:`` line, ``flag`` before it)."""
        import errno

        from aiohttp import web

        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as e:
            await runner.cleanup()
            why = "is already in use by another process" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e})"
            start_error(f"{flag}{host}:{port} {why}; choose another port (areal {self.command} run --port N)")
            return None
        return runner


def control_app(guard: Any, max_body: int, health: Callable[[], Any], status: Callable[[], Any], stop: Any) -> Any:
    """The service's aiohttp app with the routes every service has: ``GET
    /health``, ``GET /admin/status`` and ``POST /admin/shutdown`` (which sets
    the ``stop`` event); ``guard`` is its middleware."""
    from aiohttp import web

    async def health_route(_: web.Request) -> web.Response:
        return web.json_response(health())

    async def status_route(_: web.Request) -> web.Response:
        return web.json_response(status())

    async def shutdown_route(_: web.Request) -> web.Response:
        stop.set()
        return web.json_response({"ok": True})

    app = web.Application(middlewares=[guard], client_max_size=max_body)
    app.router.add_get("/health", health_route)
    app.router.add_get("/admin/status", status_route)
    app.router.add_post("/admin/shutdown", shutdown_route)
    return app


def start_error(message: str) -> None:
    """Say why this service cannot start, as the line its CLI shows."""
    print(f"{ERROR_PREFIX}{message}", file=sys.stderr, flush=True)
