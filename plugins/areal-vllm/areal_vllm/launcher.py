"""Start and stop vLLM server processes (no vLLM import in this process).

Each server is ``python -m vllm.entrypoints.openai.api_server`` (the
``vllm serve`` console script of the CPU distribution looks up metadata of a
distribution named ``vllm`` and fails; the module entry point takes the same
flags). Process plumbing (ports, a session per server so one ``killpg``
takes down the API server *and* its engine-core/worker processes, health
wait, log tail, stop, restart) is the kernel's ``SubprocessLauncher``.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import shutil
import tempfile

from areal_kernel.environments import ResolvedPython
from areal_kernel.errors import ServerError
from areal_kernel.inference.admin_auth import ADMIN_MIDDLEWARE, ADMIN_TOKEN_ENV
from areal_kernel.inference.launcher import SubprocessLauncher
from areal_kernel.platforms import Platform

from areal_vllm.config import VLLMServerConfig


def _shared_inductor_cache() -> str:
    """torch inductor's default cache directory for this user, as torch
    computes it from the launcher's own (not a server's private) TMPDIR."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (some containers)
        user = str(os.getuid())
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


SERVER_MODULE = "vllm.entrypoints.openai.api_server"
WORKER_EXTENSION = "areal_vllm.worker_ext.AReaLWorkerExtension"


class VLLMLauncher(SubprocessLauncher):
    """Launch ``n_servers`` vLLM servers and wait until each answers ``/health``.

    ``dtype`` must be resolved by the caller (the backend takes it from
    ``model.dtype`` when the section leaves it unset)."""

    server_name = "vLLM server"
    settings_path = "rollout.vllm"
    run_dir_prefix = "areal-vllm-"
    poll_s = 0.5
    server_packages = ("areal_vllm",)

    def __init__(self, config: VLLMServerConfig | None = None, run_dir: str | None = None) -> None:
        self.config = config or VLLMServerConfig()
        self._tmpdirs: list[str] = []
        self._tp = self.config.tensor_parallel_size or 1
        self.role_environment = self.config  # rollout.vllm.python: the servers' interpreter
        super().__init__(
            run_dir, host=self.config.host,
            startup_timeout_s=self.config.startup_timeout_s, stop_grace_s=self.config.stop_grace_s,
            port_retries=self.config.port_retries, admin_token=self.config.admin_token,
        )  # fmt: skip

    def log_name(self, index: int) -> str:
        return f"vllm-server-{index}.log"

    @property
    def python(self) -> ResolvedPython:
        """The servers' interpreter (``rollout.vllm.python``, resolved and
        probed once by the base class); vLLM always has one."""
        resolved = super().python
        assert resolved is not None  # role_environment is set in __init__
        return resolved

    def check_launch(self, model_path: str, n_servers: int, devices_per_server: int) -> None:
        tp = self.config.tensor_parallel_size or max(1, devices_per_server)
        if devices_per_server and tp != devices_per_server:
            raise ServerError(
                f"rollout.vllm.tensor_parallel_size={tp} but each server was given {devices_per_server} devices "
                f"(the t*p of rollout.backend); make them agree"
            )
        self._tp = tp
        self.python  # resolved before any server starts

    # -- command and environment -------------------------------------------------
    def command(self, model_path: str, port: int, index: int = 0, device_ids: list[int] | None = None) -> list[str]:
        c = self.config
        tp = self._tp
        cmd = [
            self.python.python, "-m", SERVER_MODULE,
            "--model", model_path,
            "--host", self.host_for(index),
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
        if self.admin_token:
            # vLLM's own --api-key (VLLM_API_KEY) guards only /v1, /v2,
            # /inference and /cohere paths; the RL control routes (/pause,
            # /collective_rpc, weight updates, ...) need the kernel's
            # middleware, which guards every path but /health.
            cmd += ["--middleware", ADMIN_MIDDLEWARE]
        if c.lora is not None:
            cmd += ["--enable-lora", "--max-lora-rank", str(c.lora.max_rank), "--max-loras", str(c.lora.max_loras)]
        return cmd + list(c.extra_args)

    @staticmethod
    def _platform() -> Platform:
        from areal_kernel.platforms import current_platform

        return current_platform()

    def environment(self, index: int, n_servers: int, device_ids: list[int]) -> dict[str, str]:
        c = self.config
        # Ours: this process's environment, OMP_NUM_THREADS=1 and the devices
        # made visible through the platform layer (CUDA_VISIBLE_DEVICES,
        # ASCEND_RT_VISIBLE_DEVICES, ...).
        env = super().environment(index, n_servers, device_ids)
        # vLLM in its own environment: the kernel and this plugin reach it on PYTHONPATH.
        self.server_pythonpath(env, self.python.python, self.python.foreign)
        # The RL routes (/pause, /resume, weight transfer, /collective_rpc,
        # /update_weight_version) are only mounted in dev mode.
        env["VLLM_SERVER_DEV_MODE"] = "1"
        if c.lora is not None:
            # /v1/load_lora_adapter and /v1/unload_lora_adapter exist only with this.
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        # The admin token through the environment (argv is world-readable in ps):
        # for the kernel's middleware and for vLLM's own API-key check.
        if self.admin_token:
            env[ADMIN_TOKEN_ENV] = self.admin_token
            env["VLLM_API_KEY"] = self.admin_token
        else:
            env.pop(ADMIN_TOKEN_ENV, None)
        env["VLLM_NO_USAGE_STATS"] = "1"
        env["DO_NOT_TRACK"] = "1"
        if c.offline:
            env["HF_HUB_OFFLINE"] = "1"
            env["TRANSFORMERS_OFFLINE"] = "1"
        # Per-server scratch and caches: servers must not share temp files or
        # vLLM's own caches with each other or with other runs.
        scratch = os.path.join(self.run_dir, f"vllm-{index}")
        os.makedirs(os.path.join(scratch, "cache"), exist_ok=True)
        # Except torch inductor's: vLLM's CPU worker compiles a few C++ kernels
        # (and a precompiled header) at every start, about 12 s of CPU in g++.
        # Its cache is keyed by the sources' hash and written atomically (what
        # lets torch share one per user by default), but it lives under TMPDIR,
        # which is private below: left there, every server start recompiled.
        if "TORCHINDUCTOR_CACHE_DIR" not in env:
            env["TORCHINDUCTOR_CACHE_DIR"] = _shared_inductor_cache()
        env["TMPDIR"] = self._short_tmpdir(index)
        env["XDG_CACHE_HOME"] = os.path.join(scratch, "cache")
        env["VLLM_CACHE_ROOT"] = os.path.join(scratch, "cache", "vllm")
        if self._platform().host_memory:  # vLLM's CPU backend: KV cache in host RAM, cores shared
            env["VLLM_CPU_KVCACHE_SPACE"] = str(c.kv_cache_space_gb)
            ncores = os.cpu_count() or 1
            if n_servers > 1 and c.cpu_bind_cores:
                # Without pinning every server binds the same cores.
                per = max(1, ncores // n_servers)
                lo = (index * per) % ncores
                env["VLLM_CPU_OMP_THREADS_BIND"] = f"{lo}" if per == 1 else f"{lo}-{lo + per - 1}"
                env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
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

    def cleanup(self) -> None:
        tmpdirs, self._tmpdirs = self._tmpdirs, []
        for d in tmpdirs:
            shutil.rmtree(d, ignore_errors=True)
