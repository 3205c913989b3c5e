"""Start and stop SGLang server processes (nothing SGLang is imported here).

Each server is ``python -m sglang.launch_server ...`` in its own session, so
``stop`` kills the whole process group (SGLang forks scheduler and
detokenizer processes that would survive a kill of the parent alone).
"""
from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass

from areal_kernel.api.engine import ServerInfo, ServerLauncher
from areal_kernel.errors import ServerError
from areal_kernel.utils.network import find_free_port

from areal_sglang.config import SGLangServerConfig

LOG_TAIL_LINES = 40
# What a server prints when another process took its port between our probe and its bind.
_PORT_CLASH = ("address already in use", "errno 98")


@dataclass
class _Proc:
    popen: subprocess.Popen
    info: ServerInfo
    cmd: list[str]
    log_path: str


def _tail(path: str, n: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=n))
    except OSError as e:
        return f"(no log: {e})"


def build_command(
    cfg: SGLangServerConfig, model_path: str, port: int, *, dtype: str, tp_size: int, seed: int,
    weight_version: int = 0, launch_prefix: list[str] | None = None,
) -> list[str]:
    """The argv of one server. ``launch_prefix`` replaces ``python -m sglang.launch_server``
    (tests use it to start a stand-in that speaks the same argv and wire format)."""
    prefix = launch_prefix or [cfg.python or sys.executable, "-m", "sglang.launch_server"]
    cmd = [
        *prefix,
        "--model-path", cfg.model_path or model_path,
        "--host", cfg.host,
        "--port", str(port),
        "--dtype", dtype,
        "--tp-size", str(tp_size),
        "--random-seed", str(seed),
        # Start at the kernel's version so /generate's meta_info.weight_version is an int from the start.
        "--weight-version", str(weight_version),
        "--log-level", cfg.log_level,
    ]  # fmt: skip
    if cfg.context_length is not None:
        cmd += ["--context-length", str(cfg.context_length)]
    if cfg.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", repr(cfg.mem_fraction_static)]
    if cfg.attention_backend is not None:
        cmd += ["--attention-backend", cfg.attention_backend]
    if not cfg.radix_cache:
        cmd.append("--disable-radix-cache")
    if cfg.enable_memory_saver:
        cmd.append("--enable-memory-saver")
    if cfg.skip_server_warmup:
        cmd.append("--skip-server-warmup")
    if cfg.api_key:
        cmd += ["--api-key", cfg.api_key]
    return cmd + list(cfg.extra_args)


def _healthy(address: str, api_key: str | None, timeout: float = 5.0) -> bool:
    req = urllib.request.Request(f"http://{address}/health")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class SGLangLauncher(ServerLauncher):
    """Launch ``n_servers`` SGLang servers, each on its own device set, and wait for /health."""

    def __init__(
        self,
        config: SGLangServerConfig | None = None,
        run_dir: str | None = None,
        *,
        dtype: str = "auto",
        seed: int = 0,
        launch_prefix: list[str] | None = None,
    ) -> None:
        self.config = config or SGLangServerConfig()
        self.run_dir = run_dir or tempfile.mkdtemp(prefix="areal-sglang-")
        os.makedirs(self.run_dir, exist_ok=True)
        self.dtype = self.config.dtype or dtype
        self.seed = self.config.seed if self.config.seed is not None else seed
        self.launch_prefix = launch_prefix
        self._procs: list[_Proc] = []
        self._counter = 0
        atexit.register(self.stop)  # never leave GPU-holding orphans behind

    @property
    def servers(self) -> list[ServerInfo]:
        return [p.info for p in self._procs]

    def _env(self, device_ids: list[int]) -> dict[str, str]:
        from areal_kernel.platforms import current_platform

        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        # Each server sees only its own devices, numbered from 0 (so no --base-gpu-id).
        env.update(current_platform().visible_devices_env_for(device_ids))
        env.update(self.config.extra_env)
        return env

    def _start(self, model_path: str, device_ids: list[int], tp_size: int) -> _Proc:
        idx = self._counter
        self._counter += 1
        port = find_free_port(self.config.host)
        cmd = build_command(self.config, model_path, port, dtype=self.dtype, tp_size=tp_size, seed=self.seed,
                            launch_prefix=self.launch_prefix)
        log_path = os.path.join(self.run_dir, f"sglang-{idx}.log")
        with open(log_path, "ab") as logf:
            try:
                popen = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self._env(device_ids), start_new_session=True)
            except OSError as e:
                raise ServerError(f"cannot start SGLang server ({e}); command: {' '.join(cmd)}\n"
                                  "set rollout.sglang.python to an interpreter that has sglang installed") from None
        return _Proc(popen, ServerInfo(f"{self.config.host}:{port}", popen.pid, log_path, list(device_ids)), cmd, log_path)

    def _failure(self, p: _Proc, why: str) -> ServerError:
        return ServerError(
            f"SGLang server {why}\n  command: {' '.join(p.cmd)}\n  log: {p.log_path}\n"
            f"--- last {LOG_TAIL_LINES} log lines ---\n{_tail(p.log_path)}"
        )

    def launch(self, model_path: str, n_servers: int, devices_per_server: int) -> list[ServerInfo]:
        if n_servers < 1:
            raise ServerError(f"n_servers must be >= 1, got {n_servers}")
        if devices_per_server < 0:
            raise ServerError(f"devices_per_server must be >= 0, got {devices_per_server}")
        tp = self.config.tp_size or max(1, devices_per_server)
        if devices_per_server and tp > devices_per_server:
            raise ServerError(
                f"rollout.sglang.tp_size={tp} needs {tp} devices per server but the allocation gives "
                f"{devices_per_server}; raise t in rollout.backend (e.g. sglang:d1t{tp}) or lower tp_size"
            )
        device_sets = [list(range(i * devices_per_server, (i + 1) * devices_per_server)) for i in range(n_servers)]
        pending = [self._start(model_path, d, tp) for d in device_sets]  # load in parallel
        ready: list[_Proc] = []
        try:
            for p in pending:
                ready.append(self._wait_ready(p, model_path, tp))
        except BaseException:
            self._procs.extend(ready + [p for p in pending if p not in ready])
            self.stop()  # all or nothing
            raise
        self._procs.extend(ready)
        return [p.info for p in ready]

    def _wait_ready(self, p: _Proc, model_path: str, tp: int) -> _Proc:
        retries = self.config.port_retries
        deadline = time.monotonic() + self.config.startup_timeout_s
        while True:
            rc = p.popen.poll()
            if rc is not None:
                if retries > 0 and any(s in _tail(p.log_path).lower() for s in _PORT_CLASH):
                    retries -= 1
                    p = self._start(model_path, p.info.device_ids, tp)
                    continue
                raise self._failure(p, f"exited with code {rc} before becoming healthy")
            if _healthy(p.info.address, self.config.api_key):
                return p
            if time.monotonic() > deadline:
                self._kill(p)
                raise self._failure(p, f"not healthy after {self.config.startup_timeout_s:.0f} s "
                                       "(rollout.sglang.startup_timeout_s)")
            time.sleep(0.25)

    def _kill(self, p: _Proc) -> None:
        if p.popen.poll() is not None:
            self._reap_group(p)
            return
        try:
            os.killpg(p.popen.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            p.popen.wait(self.config.stop_grace_s)
        except subprocess.TimeoutExpired:
            pass
        self._reap_group(p)

    def _reap_group(self, p: _Proc) -> None:
        # The leader may be gone while its children (scheduler, detokenizer) live on.
        try:
            os.killpg(p.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            p.popen.wait(5)
        except subprocess.TimeoutExpired:
            pass

    def stop(self) -> None:
        procs, self._procs = self._procs, []
        for p in procs:  # SIGTERM all first so they shut down in parallel
            if p.popen.poll() is None:
                try:
                    os.killpg(p.popen.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in procs:
            self._kill(p)
