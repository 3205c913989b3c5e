"""Start and stop embedded server processes (no torch in this process).

Each server is ``python -m areal_kernel.inference.embedded.server`` in its own
session (process group), so ``stop`` can kill it with everything it spawned.
"""
from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from areal_kernel.api.engine import ServerInfo, ServerLauncher
from areal_kernel.errors import ServerError
from areal_kernel.inference.embedded.ports import find_free_port

SERVER_MODULE = "areal_kernel.inference.embedded.server"
PORT_IN_USE_EXIT = 98  # same value as server.PORT_IN_USE_EXIT (server imports nothing heavy, but keep this torch-free)
ADMIN_TOKEN_ENV = "AREAL_EMBEDDED_ADMIN_TOKEN"
LOG_TAIL_LINES = 30


class EmbeddedServerConfig(BaseModel):
    """Settings of embedded inference servers (``rollout.embedded`` section)."""

    model_config = ConfigDict(extra="forbid")

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # bf16 is slower than fp32 on CPUs without avx512_bf16/AMX
    max_batch_size: int = Field(64, ge=1)
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    seed: int = 0
    startup_timeout_s: float = Field(120.0, gt=0)
    host: str = Field(
        "127.0.0.1",
        description="Bind address. Anything but a loopback name needs an admin token (generated when unset).",
    )
    port: int | None = Field(
        None, ge=1, le=65535, description="First server's port (server i uses port+i); unset: a free port each."
    )
    admin_token: str | None = Field(
        None, description="Bearer token for control routes (pause, resume, weight updates, version)."
    )
    extra_env: dict[str, str] = Field(default_factory=dict)
    stop_grace_s: float = Field(5.0, ge=0)
    port_retries: int = Field(3, ge=0)


@dataclass
class _Proc:
    popen: subprocess.Popen
    info: ServerInfo
    cmd: list[str]
    log_path: str
    model_path: str = ""
    port: int = 0


def _tail(path: str, n: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=n))
    except OSError as e:
        return f"(no log: {e})"


def _healthy(address: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}/health", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def is_loopback(host: str) -> bool:
    """Only these names count as private; any other address (even 127.0.0.2)
    is treated as reachable by others and needs an admin token."""
    return host in LOOPBACK_HOSTS


def _port_free(host: str, port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class EmbeddedLauncher(ServerLauncher):
    """Launch ``n_servers`` embedded servers and wait until they are healthy."""

    def __init__(self, config: EmbeddedServerConfig | None = None, run_dir: str | None = None) -> None:
        config = config or EmbeddedServerConfig()
        if not is_loopback(config.host) and not config.admin_token:
            # Reachable from other machines: control routes must not be open.
            # The token reaches servers through the environment and clients
            # through ``launcher.admin_token``.
            import secrets

            config = config.model_copy(update={"admin_token": secrets.token_urlsafe(32)})
        self.config = config
        self.run_dir = run_dir or tempfile.mkdtemp(prefix="areal-embedded-")
        os.makedirs(self.run_dir, exist_ok=True)
        self._procs: list[_Proc] = []
        self._counter = 0
        # Guards _procs between the controller (launch/stop) and a supervisor
        # thread (exited/restart); _stopping makes a late restart a no-op.
        self._lock = threading.RLock()
        self._stopping = False
        atexit.register(self.stop)  # never leave orphan servers behind

    @property
    def admin_token(self) -> str | None:
        """What clients must send on control routes (None: routes are open, loopback only)."""
        return self.config.admin_token

    @property
    def servers(self) -> list[ServerInfo]:
        return [p.info for p in self._procs]

    def _command(self, model_path: str, port: int) -> list[str]:
        c = self.config
        return [
            sys.executable, "-m", SERVER_MODULE,
            "--model", model_path,
            "--host", c.host,
            "--port", str(port),
            "--dtype", c.dtype,
            "--max-batch-size", str(c.max_batch_size),
            "--seed", str(c.seed),
            "--attn-implementation", c.attn_implementation,
            "--parent-pid", str(os.getpid()),
        ]  # fmt: skip

    def _env(self, device_ids: list[int]) -> dict[str, str]:
        from areal_kernel.platforms import current_platform

        env = dict(os.environ)
        env["OMP_NUM_THREADS"] = "1"
        env.update(current_platform().visible_devices_env_for(device_ids))
        # The token goes through the environment, not argv: argv is world-readable in ps.
        if self.config.admin_token:
            env[ADMIN_TOKEN_ENV] = self.config.admin_token
        else:
            env.pop(ADMIN_TOKEN_ENV, None)
        # Let the child import this very package even when it is not installed.
        pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH", "")) if p)
        env.update(self.config.extra_env)
        return env

    def _start(self, model_path: str, device_ids: list[int], port: int | None = None, log_path: str | None = None) -> _Proc:
        idx = self._counter
        self._counter += 1
        if port is None:
            port = self.config.port + idx if self.config.port else find_free_port(self.config.host)
        cmd = self._command(model_path, port)
        log_path = log_path or os.path.join(self.run_dir, f"server-{idx}.log")
        with open(log_path, "ab") as logf:
            popen = subprocess.Popen(
                cmd,
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self._env(device_ids),
                start_new_session=True,
            )
        info = ServerInfo(f"{self.config.host}:{port}", popen.pid, log_path, list(device_ids))
        return _Proc(popen, info, cmd, log_path, model_path, port)

    def _failure(self, p: _Proc, why: str) -> ServerError:
        return ServerError(
            f"embedded server {why}\n  command: {' '.join(p.cmd)}\n  log: {p.log_path}\n"
            f"--- last {LOG_TAIL_LINES} log lines ---\n{_tail(p.log_path)}"
        )

    def launch(self, model_path: str, n_servers: int, devices_per_server: int) -> list[ServerInfo]:
        if n_servers < 1:
            raise ServerError(f"n_servers must be >= 1, got {n_servers}")
        if devices_per_server < 0:
            raise ServerError(f"devices_per_server must be >= 0, got {devices_per_server}")
        if not os.path.isdir(model_path):
            raise ServerError(f"model path {model_path!r} is not a directory (expected an HF model directory)")
        if self.config.port:
            # A fixed port was asked for: a clash is the user's to resolve, not
            # something to retry around. Probe before spawning anything.
            for i in range(n_servers):
                port = self.config.port + i
                if not _port_free(self.config.host, port):
                    raise ServerError(
                        f"rollout.embedded.port: {self.config.host}:{port} is already in use by another process"
                        + (f" (server {i} of {n_servers} uses port+{i})" if n_servers > 1 else "")
                        + "; choose a free port or leave it unset to pick free ports automatically"
                    )
        self._stopping = False
        device_sets = [list(range(i * devices_per_server, (i + 1) * devices_per_server)) for i in range(n_servers)]
        # Start all first so they load in parallel, then wait for each.
        pending = [self._start(model_path, d) for d in device_sets]
        ready: list[_Proc] = []
        try:
            for p in pending:
                ready.append(self._wait_ready(p, model_path))
        except BaseException:
            # Whatever made it up is stopped too: launch is all or nothing.
            self._procs.extend(ready + [p for p in pending if p not in ready])
            self.stop()
            raise
        self._procs.extend(ready)
        return [p.info for p in ready]

    def _wait_ready(self, p: _Proc, model_path: str, same_port: bool = False, slot: int | None = None) -> _Proc:
        retries = self.config.port_retries
        deadline = time.monotonic() + self.config.startup_timeout_s
        while True:
            rc = p.popen.poll()
            if rc == PORT_IN_USE_EXIT and same_port and time.monotonic() < deadline:
                # A restart must keep its address (clients know it): the old
                # process's socket may linger a moment, so retry the same port.
                time.sleep(0.5)
                with self._lock:
                    if self._stopping:
                        raise ServerError(f"restart of {p.info.address} abandoned: the launcher is stopped")
                    p = self._start(model_path, p.info.device_ids, port=p.port, log_path=p.log_path)
                    if slot is not None:
                        self._procs[slot] = p
                continue
            if rc == PORT_IN_USE_EXIT and retries > 0 and not self.config.port:
                # Someone took the port between our probe and the server's bind.
                retries -= 1
                p = self._start(model_path, p.info.device_ids)
                continue
            if rc is not None:
                raise self._failure(p, f"exited with code {rc} before becoming healthy")
            if _healthy(p.info.address):
                return p
            if time.monotonic() > deadline:
                self._kill(p)
                raise self._failure(p, f"not healthy after {self.config.startup_timeout_s:g} s (rollout.embedded.startup_timeout_s; raise it for slow model loads)")
            time.sleep(0.2)

    # -- supervision (used by areal_kernel.inference.supervisor) ------------------
    def exited(self) -> dict[int, int]:
        """Server index -> exit code of every server process that is gone
        although ``stop`` was not called (crashed, OOM-killed, kill -9)."""
        with self._lock:
            if self._stopping:
                return {}
            return {i: rc for i, p in enumerate(self._procs) if (rc := p.popen.poll()) is not None}

    def log_tail(self, i: int) -> str:
        with self._lock:
            return _tail(self._procs[i].log_path) if i < len(self._procs) else ""

    def restart(self, i: int) -> ServerInfo:
        """Start server ``i`` again on the same address (port) with the model
        it was launched with, and wait until it is healthy. The new process
        serves the base weights at version 0: bringing it to the current
        weights is the caller's job (see ``RemoteInferenceEngine.resync_server``)."""
        with self._lock:
            if self._stopping or i >= len(self._procs):
                raise ServerError(f"cannot restart server {i}: the launcher is stopped")
            old = self._procs[i]
        self._kill(old)  # a hung-but-alive one too; a no-op for a dead one
        with open(old.log_path, "a") as f:
            f.write(f"\n--- areal: restarting server on {old.info.address} (previous exit code {old.popen.returncode}) ---\n")
        with self._lock:
            if self._stopping:
                raise ServerError(f"cannot restart server {i}: the launcher is stopped")
            p = self._start(old.model_path, old.info.device_ids, port=old.port, log_path=old.log_path)
            # Tracked at once, so stop() kills it even while we wait below.
            self._procs[i] = p
        p = self._wait_ready(p, old.model_path, same_port=True, slot=i)
        with self._lock:
            if self._stopping:
                self._kill(p)
                raise ServerError(f"cannot restart server {i}: the launcher is stopped")
            self._procs[i] = p
        return p.info

    def _kill(self, p: _Proc) -> None:
        if p.popen.poll() is not None:
            return
        try:
            os.killpg(p.popen.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            p.popen.wait(self.config.stop_grace_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.popen.wait()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            procs, self._procs = self._procs, []
        for p in procs:  # SIGTERM all first so they shut down in parallel
            if p.popen.poll() is None:
                try:
                    os.killpg(p.popen.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in procs:
            self._kill(p)
