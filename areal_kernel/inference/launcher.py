"""The one subprocess server launcher every inference backend builds on.

A backend says *what* to run (``command``, ``environment``); this class owns
*how*: a free port per server, each server in its own session (process
group) so one ``killpg`` takes down everything it spawned, the wait for its
health route, the tail of its log in every error, retries when another
process took the port first, stopping, and restarting one server on its old
address (what ``areal_kernel.inference.supervisor`` does when a server dies).

No torch and no backend package is imported here: servers are separate
processes, started from whatever interpreter and module the backend names.
"""

from __future__ import annotations

import abc
import atexit
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import http.client
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from areal_kernel.api.engine import ServerInfo, ServerLauncher
from areal_kernel.api.scheduler import ROLLOUT, Placement, ProcessHandle, spawn_local
from areal_kernel.errors import ServerError
from areal_kernel.inference.admin_auth import admin_token_for, bearer_header
from areal_kernel.inference.guard import EXEC_FAILED_EXIT, guarded_command
from areal_kernel.utils.network import find_free_port, is_loopback, port_is_free

if TYPE_CHECKING:
    from areal_kernel.environments import ResolvedPython
from areal_kernel.utils.procs import tail_file  # noqa: F401  (a stable name of this module: docs/api.md)

# Exit code a server may use to say "my port is taken" (the embedded server
# does); servers that cannot choose their exit code are recognised by the
# messages below in their log.
PORT_IN_USE_EXIT = 98
PORT_CLASH_MESSAGES = ("address already in use", "errno 98", "is already in use")


def http_ok(url: str, headers: dict[str, str] | None = None, timeout_s: float = 2.0) -> bool:
    """True when ``GET url`` answers 200 (connection errors and other statuses: False)."""
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
        # HTTPException: something that is not an HTTP server holds the port
        # (another process bound it between our probe and the server's bind);
        # not healthy, and the server's own port clash is retried.
        return False


@dataclass
class ServerProcess:
    """One started server: its process (on whichever node its scheduler
    placed it), where it listens and logs, and what is needed to start it
    again on the same address."""

    index: int  # position in ``launcher.servers``; also names the log file
    handle: ProcessHandle
    info: ServerInfo
    cmd: list[str]
    log_path: str
    port: int
    model_path: str
    device_ids: list[int] = field(default_factory=list)


class SubprocessLauncher(ServerLauncher):
    """Starts ``n`` server processes of one backend and keeps them running.

    Subclasses implement ``command`` and usually extend ``environment``;
    everything else has a working default:

    - ``server_name`` (``"vLLM server"``) and ``settings_path``
      (``"rollout.vllm"``) word the errors;
    - ``health_path`` / ``health_headers()``: the route polled until the
      server is ready (200) — the same route the client probes;
    - ``log_name(index)``: the log file, under ``run_dir``;
    - ``check_launch(...)``: reject a launch before anything starts;
    - ``is_port_clash(proc, rc)``: whether an early exit means "port taken";
    - ``cleanup()``: release what the subclass created (scratch dirs), after
      ``stop``;
    - ``start_failure_hint``: advice added when the command cannot be run.

    Thread safety: ``launch``/``stop`` run in the controller; ``exited`` and
    ``restart`` may run in a supervisor thread at the same time. A restart
    racing ``stop`` is abandoned, never leaves a process behind.
    """

    server_name: ClassVar[str] = "inference server"
    settings_path: ClassVar[str] = "rollout"
    health_path: ClassVar[str] = "/health"
    log_tail_lines: ClassVar[int] = 40
    poll_s: ClassVar[float] = 0.25
    # Appended when the command cannot even be executed (missing interpreter).
    start_failure_hint: ClassVar[str] = ""
    # Run each server under the parent guard (``areal_kernel.inference.guard``)
    # so it ends when the process that spawned it does (a killed controller,
    # a lost scheduler agent). Off only for servers that watch
    # ``PARENT_PID_ENV`` themselves (the embedded server).
    guard_parent: ClassVar[bool] = True
    # The name of the run directory made when none is given (server logs);
    # ``stop`` removes it again unless a server failed.
    run_dir_prefix: ClassVar[str] = "areal-servers-"
    # The plugin's top-level packages its servers import (``("areal_vllm",)``):
    # a server that runs from another Python environment
    # (``RoleEnvironment.python``) gets them, and the kernel, through
    # ``server_pythonpath`` without anything installed there.
    server_packages: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        run_dir: str | None,
        *,
        host: str = "127.0.0.1",
        startup_timeout_s: float = 600.0,
        stop_grace_s: float = 10.0,
        port_retries: int = 3,
        base_port: int | None = None,
        admin_token: str | None = None,
    ) -> None:
        self._own_run_dir = not run_dir
        self.run_dir = os.path.abspath(run_dir or tempfile.mkdtemp(prefix=self.run_dir_prefix))
        os.makedirs(self.run_dir, exist_ok=True)
        self._failed = False  # a server failed or crashed: its log stays
        self.host = host
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.port_retries = port_retries
        self.base_port = base_port  # server i listens on base_port + i; None: a free port each
        # The kernel's token rule for ``host`` (``secure_for_hosts`` applies it
        # again to the hosts a scheduler places servers on).
        self._admin_token = admin_token_for([host], admin_token)
        self._procs: list[ServerProcess] = []
        self._n_servers = 0
        self._lock = threading.RLock()
        self._stopping = False
        # Set by ``place``: where each server runs and who starts it there.
        self._scheduler: Any = None
        self._placements: list[Placement] | None = None
        # Servers given back on purpose (drained, or dead in an elastic fleet
        # above its minimum): their slots stay (indices name log files) but
        # nobody watches or restarts them.
        self._retired: set[int] = set()
        atexit.register(self.stop)  # never leave orphan servers (they hold memory and devices)

    # -- what a backend provides --------------------------------------------------
    @abc.abstractmethod
    def command(self, model_path: str, port: int, index: int, device_ids: list[int]) -> list[str]:
        """The argv of server ``index`` listening on ``port``."""

    def environment(self, index: int, n_servers: int, device_ids: list[int]) -> dict[str, str]:
        """The server's environment: this process's, single-threaded OpenMP,
        and its devices made visible through the platform layer."""
        from areal_kernel.platforms import current_platform

        env = dict(os.environ)
        env["OMP_NUM_THREADS"] = "1"
        env.update(current_platform().visible_devices_env_for(device_ids))
        return env

    # The backend's settings section when its servers may run from their own
    # Python environment (a ``config.sections.RoleEnvironment``: ``python``
    # and the registered environment's name); set by the backend's __init__.
    role_environment: Any = None

    @property
    def python(self) -> "ResolvedPython | None":
        """The servers' interpreter: ``role_environment.python`` resolved and
        probed once (``environments.resolve_python``; a missing or wrong one
        is one ``ConfigError`` naming ``<settings_path>.python``), or ``None``
        for a backend without a role environment."""
        if self.role_environment is None:
            return None
        if self.resolved_python is None:
            from areal_kernel.environments import resolve_python

            section = self.role_environment
            self._resolved_python = resolve_python(section.python, section.environment, f"{self.settings_path}.python")
        return self._resolved_python

    @property
    def resolved_python(self) -> "ResolvedPython | None":
        """``python`` if it was resolved already (by ``check_launch``), else
        ``None``: for code that must not start a probe (a bare ``command``)."""
        return getattr(self, "_resolved_python", None)

    def server_pythonpath(self, env: dict[str, str], python: str, foreign: bool) -> dict[str, str]:
        """Set ``env``'s PYTHONPATH for a server run by ``python``. The same
        environment as this process (``foreign`` false): unchanged. Another
        one: only a directory under the run directory linking the kernel,
        ``server_packages`` and the kernel's pure-Python dependencies that
        environment lacks (``environments.stage_packages``), or no
        PYTHONPATH at all without ``server_packages``; nothing of this
        process's PYTHONPATH, which would shadow the environment's own pins."""
        if not foreign:
            return env
        if not self.server_packages:  # the server imports nothing of ours
            env.pop("PYTHONPATH", None)
            return env
        from areal_kernel.environments import stage_packages

        staged = os.path.join(self.run_dir, "server-path")
        if getattr(self, "_staged_for", None) != python:
            stage_packages(staged, python, ["areal_kernel", *self.server_packages])
            self._staged_for = python
        env["PYTHONPATH"] = staged
        return env

    def health_headers(self) -> dict[str, str]:
        return bearer_header(self.admin_token)

    @property
    def admin_token(self) -> str | None:
        """The token clients send on control routes (``Authorization: Bearer``);
        ``None``: the servers bind loopback only and no token was configured.
        A backend passes it to its servers in ``command``/``environment`` and
        to its client in ``make_client``."""
        return self._admin_token

    def log_name(self, index: int) -> str:
        return f"server-{index}.log"

    def check_launch(self, model_path: str, n_servers: int, devices_per_server: int) -> None:
        """Raise ``ServerError`` for a launch that cannot work (before any process starts)."""

    def is_port_clash(self, proc: ServerProcess, returncode: int) -> bool:
        if returncode == PORT_IN_USE_EXIT:
            return True
        tail = proc.handle.log_tail(self.log_tail_lines).lower()
        return any(m in tail for m in PORT_CLASH_MESSAGES)

    def cleanup(self) -> None:
        """Release what the subclass created per run (called by ``stop``)."""

    def secure_for_hosts(self, hosts: list[str]) -> None:
        """Called by ``place`` with the addresses servers will bind: applies
        the kernel's token rule (``admin_token_for``), generating
        ``admin_token`` when any host is beyond loopback and none is set (a
        server reachable from other machines never has open control
        routes). Override only to do more, calling this."""
        self._admin_token = admin_token_for(hosts, self._admin_token)

    # -- placement (the scheduler contract) ----------------------------------------
    def place(self, scheduler: Any, placements: list[Placement]) -> None:
        """Run server ``i`` on ``placements[i]`` (its node, bind host and
        devices), started through ``scheduler.spawn`` with ports from
        ``scheduler.free_port``. Without ``place`` every server runs on this
        machine, bound to ``host``."""
        self._scheduler = scheduler
        self._placements = list(placements)
        self.secure_for_hosts([self.host_for(i) for i in range(len(self._placements))])

    def host_for(self, index: int) -> str:
        """The address server ``index`` binds and clients dial: its
        placement's host once placed, unless the backend's settings asked
        for a bind beyond loopback (that choice is the user's and stays)."""
        if self._placements is not None and index < len(self._placements) and is_loopback(self.host):
            return self._placements[index].host
        return self.host

    def placement_for(self, index: int, device_ids: list[int]) -> Placement:
        if self._placements is not None and index < len(self._placements):
            return self._placements[index]
        return Placement(ROLLOUT, index, "local", self.host, tuple(device_ids))

    # -- public API ----------------------------------------------------------------
    @property
    def servers(self) -> list[ServerInfo]:
        with self._lock:
            return [p.info for p in self._procs]

    @property
    def handles(self) -> list[ProcessHandle]:
        """The servers' processes, in index order."""
        with self._lock:
            return [p.handle for p in self._procs]

    def healthy(self, address: str) -> bool:
        return http_ok(f"http://{address}{self.health_path}", self.health_headers())

    def log_tail(self, index: int, n: int | None = None) -> str:
        with self._lock:
            if index >= len(self._procs):
                return ""
            handle = self._procs[index].handle
        return handle.log_tail(n or self.log_tail_lines)

    def launch(self, model_path: str, n_servers: int, devices_per_server: int) -> list[ServerInfo]:
        if n_servers < 1:
            raise ServerError(f"n_servers must be >= 1, got {n_servers}")
        if devices_per_server < 0:
            raise ServerError(f"devices_per_server must be >= 0, got {devices_per_server}")
        if not os.path.isdir(model_path):
            raise ServerError(f"model path {model_path!r} is not a directory (expected an HF model directory)")
        self.check_launch(model_path, n_servers, devices_per_server)
        if self._placements is not None and len(self._placements) < n_servers:
            raise ServerError(f"{n_servers} servers asked for but the scheduler placed {len(self._placements)}")
        if self.base_port:
            # A fixed port was asked for: a clash is the user's to resolve, not
            # something to retry around. Probe before spawning anything.
            for i in range(n_servers):
                port = self.base_port + i
                host = self.host_for(i)
                # A placement on another machine is probed there, by the server's own bind.
                here = self._scheduler is None or self._scheduler.on_this_machine(self.placement_for(i, []))
                if here and not port_is_free(port, host):
                    raise ServerError(
                        f"{self.settings_path}.port: {host}:{port} is already in use by another process"
                        + (f" (server {i} of {n_servers} uses port+{i})" if n_servers > 1 else "")
                        + "; choose a free port or leave it unset to pick free ports automatically"
                    )
        os.makedirs(self.run_dir, exist_ok=True)  # ``stop`` may have removed its own
        with self._lock:
            self._stopping = False
            first = len(self._procs)
        self._n_servers = n_servers
        if self._placements is not None:
            device_sets = [list(self._placements[i].devices) for i in range(n_servers)]
        else:
            device_sets = [list(range(i * devices_per_server, (i + 1) * devices_per_server)) for i in range(n_servers)]
        try:
            # Start all first so they load in parallel, then wait for each.
            for i, d in enumerate(device_sets):
                self._spawn(first + i, model_path, d, self._port_for(i))
            for i in range(n_servers):
                with self._lock:
                    p = self._procs[first + i]
                self._wait_ready(p, restart=False)
        except BaseException:
            self.stop()  # all or nothing
            raise
        with self._lock:
            return [p.info for p in self._procs[first:]]

    def exited(self) -> dict[int, int]:
        """Server index -> exit code of every server process that is gone
        although ``stop`` was not called (crashed, OOM-killed, ``kill -9``)."""
        with self._lock:
            if self._stopping:
                return {}
            procs = list(self._procs)
        # Polled outside the lock: a remote handle's poll is a network call.
        with self._lock:
            retired = set(self._retired)
        gone = {p.index: rc for p in procs if p.index not in retired and (rc := p.handle.poll()) is not None}
        self._failed = self._failed or bool(gone)
        return gone

    def add_server(self) -> ServerInfo:
        """Start one more server while the run goes on (an elastic fleet
        growing), with the model of the first launch, on a placement from the
        scheduler (``Scheduler.extra_placement``; on this machine without
        one), and wait until it is healthy. Its weights are its model
        directory's: bringing it to the run's current weights is the weight
        transport's job (``WeightTransport.admit``)."""
        with self._lock:
            if self._stopping or not self._procs:
                raise ServerError(f"cannot add a {self.server_name}: the launcher is not running")
            index = len(self._procs)
            model_path = self._procs[0].model_path
        devices: list[int] = []
        if self._scheduler is not None:
            placement = self._scheduler.extra_placement(ROLLOUT, index)
            with self._lock:
                assert self._placements is not None
                while len(self._placements) < index:  # keep placements index-aligned
                    self._placements.append(self._placements[-1])
                self._placements.append(placement)
            self.secure_for_hosts([self.host_for(i) for i in range(index + 1)])
            devices = list(placement.devices)
        port = self._port_for(index)
        self._n_servers = max(self._n_servers, index + 1)
        proc = self._spawn(index, model_path, devices, port)
        try:
            return self._wait_ready(proc, restart=False).info
        except BaseException:
            self.retire(index)
            raise

    def retire(self, index: int) -> None:
        """Give server ``index`` back: stop its process group (if it still
        runs) and stop watching it. ``exited`` no longer reports it, so no
        supervisor restarts it; its log stays."""
        with self._lock:
            if index >= len(self._procs):
                raise ServerError(f"no {self.server_name} {index} to retire")
            self._retired.add(index)
            proc = self._procs[index]
        self.kill(proc)

    def index_of(self, address: str) -> int | None:
        """The index of the server listening on ``address`` (None: not one of ours, or retired)."""
        with self._lock:
            for p in self._procs:
                if p.info.address == address and p.index not in self._retired:
                    return p.index
        return None

    def restart(self, index: int) -> ServerInfo:
        """Start server ``index`` again, on the same address, with the model
        and devices it was launched with, and wait until it is healthy. The
        old process group is killed first (a hung but alive server too). The
        new process serves the weights in its model directory: bringing it
        to the run's current weights is the client's job
        (``RemoteInferenceEngine.resync_server``)."""
        with self._lock:
            if self._stopping or index >= len(self._procs):
                raise ServerError(f"cannot restart {self.server_name} {index}: the launcher is stopped")
            old = self._procs[index]
        self.kill(old)
        _append(
            old.log_path,
            f"\n--- areal: restarting server on {old.info.address} (previous exit code {old.handle.returncode}) ---\n",
        )
        self._spawn(index, old.model_path, old.device_ids, old.port)
        with self._lock:
            p = self._procs[index]
        return self._wait_ready(p, restart=True).info

    def stop(self) -> None:
        """Stop every server (whole process groups): SIGTERM to all, then
        SIGKILL to what is left after ``stop_grace_s``."""
        with self._lock:
            self._stopping = True
            procs, self._procs = self._procs, []
        for p in procs:  # SIGTERM all first so they shut down in parallel
            if p.handle.poll() is None:
                p.handle.signal_group(signal.SIGTERM)
        for p in procs:
            self.kill(p)
        self.cleanup()
        if self._own_run_dir and not self._failed:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def kill(self, proc: ServerProcess) -> None:
        """Kill one server's whole process group and reap its leader. The
        leader may be gone while children it spawned (engine cores, workers)
        live on, so the group is SIGKILLed whatever the leader did."""
        if proc.handle.poll() is None:
            proc.handle.signal_group(signal.SIGTERM)
            try:
                proc.handle.wait(self.stop_grace_s)
            except subprocess.TimeoutExpired:
                pass
        proc.handle.signal_group(signal.SIGKILL)
        try:
            proc.handle.wait(10)
        except subprocess.TimeoutExpired:  # unkillable (D state): nothing more we can do
            pass
        # The leader reaped is not the group gone: a vLLM engine core SIGKILLed
        # with it can still be freeing its GBs. Stopped means nothing left
        # running (`areal inf deregister` returned once before that, and a
        # fresh-clone run under load saw the group still there).
        proc.handle.wait_group_gone(10)

    def failure(self, proc: ServerProcess, why: str) -> ServerError:
        """An error naming the server, its command, its log file and the log's last lines."""
        self._failed = True
        return ServerError(
            f"{self.server_name} {proc.index} ({proc.info.address}) {why}\n  command: {' '.join(proc.cmd)}\n"
            f"  log: {proc.log_path}\n--- last {self.log_tail_lines} log lines ---\n"
            f"{proc.handle.log_tail(self.log_tail_lines)}"
        )

    # -- internals -------------------------------------------------------------------
    def _port_for(self, i: int) -> int:
        if self.base_port:
            return self.base_port + i
        if self._scheduler is not None and self._placements is not None:
            return int(self._scheduler.free_port(self._placements[i]))
        return find_free_port(self.host)

    def _spawn(self, index: int, model_path: str, device_ids: list[int], port: int) -> ServerProcess:
        cmd = self.command(model_path, port, index, device_ids)
        # What runs: the server's argv, under the parent guard unless the server
        # watches its parent itself. ``cmd`` (in errors) stays the server's own.
        argv = guarded_command(cmd, grace_s=self.stop_grace_s) if self.guard_parent else cmd
        log_path = os.path.join(self.run_dir, self.log_name(index))
        with self._lock:
            if self._stopping:
                raise ServerError(f"start of {self.server_name} {index} abandoned: the launcher is stopped")
            env = self.environment(index, max(self._n_servers, index + 1), device_ids)
            placement = self.placement_for(index, device_ids)
            try:
                if self._scheduler is not None:
                    _append(log_path, f"\n=== areal: on {placement.node}: {' '.join(cmd)}\n")
                    handle = self._scheduler.spawn(placement, argv, env, log_path)
                else:
                    _append(log_path, f"\n=== areal: {' '.join(cmd)}\n")
                    handle = spawn_local(argv, env, log_path, placement)
            except OSError as e:
                hint = f"\n{self.start_failure_hint}" if self.start_failure_hint else ""
                raise ServerError(
                    f"cannot start {self.server_name} {index} ({e}); command: {' '.join(cmd)}{hint}"
                ) from None
            info = ServerInfo(f"{self.host_for(index)}:{port}", handle.pid, log_path, list(device_ids))
            proc = ServerProcess(index, handle, info, cmd, log_path, port, model_path, list(device_ids))
            # Tracked at once, so stop() (atexit, a signal, another thread) kills it even while we wait.
            if index < len(self._procs):
                self._procs[index] = proc
            else:
                self._procs.append(proc)
            return proc

    def _wait_ready(self, p: ServerProcess, restart: bool) -> ServerProcess:
        """Wait for ``p`` to answer its health route. A port clash is retried:
        on a restart on the same port (clients know the address, and the dead
        process's socket may linger a moment); on a launch without a fixed
        port on a new free port, ``port_retries`` times."""
        retries = self.port_retries
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            rc = p.handle.poll()
            if rc is not None:
                clash = self.is_port_clash(p, rc)
                if clash and restart and time.monotonic() < deadline:
                    time.sleep(0.5)
                    self.kill(p)
                    p = self._spawn(p.index, p.model_path, p.device_ids, p.port)
                    continue
                if clash and retries > 0 and not restart and not self.base_port:
                    # Someone took the port between our probe and the server's bind.
                    retries -= 1
                    self.kill(p)
                    p = self._spawn(p.index, p.model_path, p.device_ids, self._port_for(p.index))
                    continue
                self.kill(p)  # children may outlive the leader
                if rc == EXEC_FAILED_EXIT and self.guard_parent:
                    # The guard could not execute the command (it said why in the log).
                    hint = f"\n{self.start_failure_hint}" if self.start_failure_hint else ""
                    raise self.failure(p, f"could not be started (exit code {rc}){hint}")
                raise self.failure(p, f"exited with code {rc} before becoming healthy")
            with self._lock:
                if self._stopping:
                    raise ServerError(f"start of {self.server_name} {p.index} abandoned: the launcher is stopped")
            if self.healthy(p.info.address):
                return p
            if time.monotonic() > deadline:
                self.kill(p)
                raise self.failure(
                    p,
                    f"not healthy after {self.startup_timeout_s:g} s ({self.settings_path}.startup_timeout_s; "
                    "raise it for slow model loads)",
                )
            time.sleep(self.poll_s)


def _append(path: str, text: str) -> None:
    """Append a marker line to a server's log (where this machine can see it)."""
    try:
        with open(path, "a") as f:
            f.write(text)
    except OSError:
        pass
