"""Start and stop vLLM server processes (no vLLM import in this process).

Each server is ``python -m vllm.entrypoints.openai.api_server`` (the
``vllm serve`` console script of the CPU distribution looks up metadata of a
distribution named ``vllm`` and fails; the module entry point takes the same
flags) in its own session, so ``stop`` takes down the API server *and* the
engine-core/worker processes it spawned with one ``killpg``.
"""
from __future__ import annotations

import atexit
import json
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
from areal_kernel.platforms import Platform
from areal_kernel.utils.network import find_free_port

from areal_vllm.config import VLLMServerConfig

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
WORKER_EXTENSION = "areal_vllm.worker_ext.AReaLWorkerExtension"
LOG_TAIL_LINES = 40
_PORT_CLASH = ("Address already in use", "address already in use", "Errno 98")


@dataclass
class _Proc:
    popen: subprocess.Popen
    info: ServerInfo
    cmd: list[str]
    log_path: str
    index: int


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


class VLLMLauncher(ServerLauncher):
    """Launch ``n_servers`` vLLM servers and wait until each answers ``/health``.

    ``dtype`` must be resolved by the caller (the backend takes it from
    ``model.dtype`` when the section leaves it unset)."""

    def __init__(self, config: VLLMServerConfig | None = None, run_dir: str | None = None) -> None:
        self.config = config or VLLMServerConfig()
        self.run_dir = os.path.abspath(run_dir or tempfile.mkdtemp(prefix="areal-vllm-"))
        os.makedirs(self.run_dir, exist_ok=True)
        self._procs: list[_Proc] = []
        self._counter = 0
        self._tmpdirs: list[str] = []
        atexit.register(self.stop)  # never leave orphan servers (they hold ~4 GB each)

    @property
    def servers(self) -> list[ServerInfo]:
        return [p.info for p in self._procs]

    # -- command and environment -------------------------------------------------
    def command(self, model_path: str, port: int, tp: int) -> list[str]:
        c = self.config
        cmd = [
            sys.executable, "-m", SERVER_MODULE,
            "--model", model_path,
            "--host", c.host,
            "--port", str(port),
            "--dtype", c.dtype or "auto",
            "--max-model-len", str(c.max_model_len),
            "--seed", str(c.seed),
            "--tensor-parallel-size", str(tp),
            "--logprobs-mode", c.logprobs_mode,
            # /inference/v1/generate: token ids in, ids + logprobs + weight_versions out.
            "--enable-scale-out",
            # Registers our weight-transfer engine inside every worker process.
            "--worker-extension-cls", WORKER_EXTENSION,
            "--weight-transfer-config", json.dumps({"backend": c.weight_transfer_backend}),
        ]  # fmt: skip
        if c.enforce_eager:
            cmd.append("--enforce-eager")
        if not self._platform().host_memory:  # a fraction of device memory; host RAM is sized below
            cmd += ["--gpu-memory-utilization", str(c.gpu_memory_utilization)]
        if c.max_num_seqs is not None:
            cmd += ["--max-num-seqs", str(c.max_num_seqs)]
        if c.enable_prefix_caching is not None:
            cmd.append("--enable-prefix-caching" if c.enable_prefix_caching else "--no-enable-prefix-caching")
        return cmd + list(c.extra_args)

    @staticmethod
    def _platform() -> Platform:
        from areal_kernel.platforms import current_platform

        return current_platform()

    def environment(self, index: int, n_servers: int, device_ids: list[int]) -> dict[str, str]:
        from areal_kernel.platforms import current_platform

        c = self.config
        env = dict(os.environ)
        env["OMP_NUM_THREADS"] = "1"
        # The RL routes (/pause, /resume, weight transfer, /collective_rpc,
        # /update_weight_version) are only mounted in dev mode.
        env["VLLM_SERVER_DEV_MODE"] = "1"
        env["VLLM_NO_USAGE_STATS"] = "1"
        env["DO_NOT_TRACK"] = "1"
        if c.offline:
            env["HF_HUB_OFFLINE"] = "1"
            env["TRANSFORMERS_OFFLINE"] = "1"
        # Per-server scratch and caches: servers must not share compile caches
        # or temp files with each other or with other runs.
        scratch = os.path.join(self.run_dir, f"vllm-{index}")
        os.makedirs(os.path.join(scratch, "cache"), exist_ok=True)
        env["TMPDIR"] = self._short_tmpdir(index)
        env["XDG_CACHE_HOME"] = os.path.join(scratch, "cache")
        env["VLLM_CACHE_ROOT"] = os.path.join(scratch, "cache", "vllm")
        platform = current_platform()
        if platform.host_memory:  # vLLM's CPU backend: KV cache in host RAM, cores shared
            env["VLLM_CPU_KVCACHE_SPACE"] = f"{c.kv_cache_space_gb:g}"
            ncores = os.cpu_count() or 1
            if n_servers > 1 and c.cpu_bind_cores:
                # Without pinning every server binds the same cores.
                per = max(1, ncores // n_servers)
                lo = (index * per) % ncores
                env["VLLM_CPU_OMP_THREADS_BIND"] = f"{lo}" if per == 1 else f"{lo}-{lo + per - 1}"
                env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        # Device placement goes through the platform layer (CUDA_VISIBLE_DEVICES,
        # ASCEND_RT_VISIBLE_DEVICES, ...), never a hard-coded variable.
        env.update(platform.visible_devices_env_for(device_ids))
        env.update(c.extra_env)
        return env

    def _short_tmpdir(self, index: int) -> str:
        """A private TMPDIR with a short path: vLLM puts ZeroMQ ipc sockets
        there, and a unix socket path must fit in 107 bytes, which a run
        directory deep in a project (or pytest's tmp_path) easily exceeds."""
        base = tempfile.gettempdir()
        if len(base) > 40 and os.path.isdir("/tmp"):
            base = "/tmp"
        path = tempfile.mkdtemp(prefix=f"avllm{index}-", dir=base)
        self._tmpdirs.append(path)
        return path

    # -- lifecycle -------------------------------------------------------------------
    def _start(self, model_path: str, index: int, n_servers: int, device_ids: list[int], tp: int) -> _Proc:
        port = find_free_port(self.config.host)
        cmd = self.command(model_path, port, tp)
        log_path = os.path.join(self.run_dir, f"vllm-server-{index}.log")
        with open(log_path, "ab") as logf:
            logf.write(f"\n=== areal-vllm: {' '.join(cmd)}\n".encode())
            logf.flush()
            popen = subprocess.Popen(
                cmd,
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.environment(index, n_servers, device_ids),
                start_new_session=True,
            )
        info = ServerInfo(f"{self.config.host}:{port}", popen.pid, log_path, list(device_ids))
        return _Proc(popen, info, cmd, log_path, index)

    def _failure(self, p: _Proc, why: str) -> ServerError:
        return ServerError(
            f"vLLM server {p.index} {why}\n  command: {' '.join(p.cmd)}\n  log: {p.log_path}\n"
            f"--- last {LOG_TAIL_LINES} log lines ---\n{_tail(p.log_path)}"
        )

    def launch(self, model_path: str, n_servers: int, devices_per_server: int) -> list[ServerInfo]:
        if n_servers < 1:
            raise ServerError(f"n_servers must be >= 1, got {n_servers}")
        if devices_per_server < 0:
            raise ServerError(f"devices_per_server must be >= 0, got {devices_per_server}")
        if not os.path.isdir(model_path):
            raise ServerError(f"model path {model_path!r} is not a directory (expected an HF model directory)")
        tp = self.config.tensor_parallel_size or max(1, devices_per_server)
        if devices_per_server and tp != devices_per_server:
            raise ServerError(
                f"rollout.vllm.tensor_parallel_size={tp} but each server was given {devices_per_server} devices "
                f"(the t*p of rollout.backend); make them agree"
            )
        device_sets = [list(range(i * devices_per_server, (i + 1) * devices_per_server)) for i in range(n_servers)]
        # Start all first so they load in parallel, then wait for each.
        pending = [self._start(model_path, i + self._counter, n_servers, d, tp) for i, d in enumerate(device_sets)]
        self._counter += n_servers
        ready: list[_Proc] = []
        try:
            for p in pending:
                ready.append(self._wait_ready(p, model_path, n_servers, tp))
        except BaseException:
            # All or nothing: whatever came up is stopped as well.
            self._procs.extend(ready + [p for p in pending if p not in ready])
            self.stop()
            raise
        self._procs.extend(ready)
        return [p.info for p in ready]

    def _wait_ready(self, p: _Proc, model_path: str, n_servers: int, tp: int) -> _Proc:
        retries = self.config.port_retries
        deadline = time.monotonic() + self.config.startup_timeout_s
        while True:
            rc = p.popen.poll()
            if rc is not None:
                if retries > 0 and any(s in _tail(p.log_path) for s in _PORT_CLASH):
                    # Someone took the port between our probe and the server's bind.
                    retries -= 1
                    self._kill(p)
                    p = self._start(model_path, p.index, n_servers, p.info.device_ids, tp)
                    continue
                self._kill(p)  # the engine core may outlive the API server
                raise self._failure(p, f"exited with code {rc} before becoming healthy")
            if _healthy(p.info.address):
                return p
            if time.monotonic() > deadline:
                self._kill(p)
                raise self._failure(p, f"not healthy after {self.config.startup_timeout_s:.0f} s (startup_timeout_s)")
            time.sleep(0.5)

    def _kill(self, p: _Proc) -> None:
        try:
            os.killpg(p.popen.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            p.popen.wait(self.config.stop_grace_s)
        except subprocess.TimeoutExpired:
            pass
        # The leader may be gone while its engine core still runs: SIGKILL the
        # whole group whatever the leader did.
        try:
            os.killpg(p.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.popen.wait()

    def stop(self) -> None:
        procs, self._procs = self._procs, []
        for p in procs:  # SIGTERM all first so they shut down in parallel
            try:
                os.killpg(p.popen.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in procs:
            self._kill(p)
        import shutil

        tmpdirs, self._tmpdirs = self._tmpdirs, []
        for d in tmpdirs:
            shutil.rmtree(d, ignore_errors=True)
