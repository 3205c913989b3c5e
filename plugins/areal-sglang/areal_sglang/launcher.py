"""Start and stop SGLang server processes (nothing SGLang is imported here).

Each server is ``python -m sglang.launch_server ...``; process plumbing
(ports, a session per server so ``stop`` kills the scheduler and
detokenizer processes SGLang forks too, health wait, log tail, stop,
restart) is the kernel's ``SubprocessLauncher``.
"""

from __future__ import annotations

import sys

from areal_kernel.environments import ResolvedPython
from areal_kernel.errors import ServerError
from areal_kernel.inference.launcher import SubprocessLauncher

from areal_sglang.config import SGLangServerConfig


def build_command(
    cfg: SGLangServerConfig,
    model_path: str,
    port: int,
    *,
    dtype: str,
    tp_size: int,
    seed: int,
    weight_version: int = 0,
    launch_prefix: list[str] | None = None,
    host: str | None = None,
    api_key: str | None = None,
    python: str | None = None,
) -> list[str]:
    """The argv of one server. ``launch_prefix`` replaces ``python -m sglang.launch_server``
    (tests use it to start a stand-in that speaks the same argv and wire format);
    ``host`` (default ``cfg.host``) is the bind address its scheduler placed it on;
    ``api_key`` (default ``cfg.api_key``) the launcher's admin token;
    ``python`` the resolved interpreter (default ``cfg.python``, else this one)."""
    prefix = launch_prefix or [python or cfg.python or sys.executable, "-m", "sglang.launch_server"]
    cmd = [
        *prefix,
        "--model-path", cfg.model_path or model_path,
        "--host", host or cfg.host,
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
    if cfg.device is not None:
        cmd += ["--device", cfg.device]
    if cfg.attention_backend is not None:
        cmd += ["--attention-backend", cfg.attention_backend]
    if not cfg.radix_cache:
        cmd.append("--disable-radix-cache")
    if cfg.enable_memory_saver:
        cmd.append("--enable-memory-saver")
    if cfg.skip_server_warmup:
        cmd.append("--skip-server-warmup")
    # SGLang reads its key from argv only. With --api-key alone every route
    # but /health*, /ready* and /metrics* needs it (weight updates included).
    key = api_key or cfg.api_key
    if key:
        cmd += ["--api-key", key]
    if cfg.lora is not None:
        cmd += ["--enable-lora", "--max-lora-rank", str(cfg.lora.max_rank)]
        cmd += ["--lora-target-modules", *cfg.lora.target_modules]
        cmd += ["--max-loras-per-batch", str(cfg.lora.max_loras_per_batch)]
    return cmd + list(cfg.extra_args)


class SGLangLauncher(SubprocessLauncher):
    """Launch ``n_servers`` SGLang servers, each on its own device set, and wait for /health."""

    server_name = "SGLang server"
    settings_path = "rollout.sglang"
    run_dir_prefix = "areal-sglang-"
    start_failure_hint = "set rollout.sglang.python to an interpreter that has sglang installed"
    # SGLang's server imports nothing of ours: a foreign interpreter gets
    # only a PYTHONPATH cleared of this side's entries.
    server_packages = ()

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
        self.dtype = self.config.dtype or dtype
        self.seed = self.config.seed if self.config.seed is not None else seed
        self.launch_prefix = launch_prefix
        self._tp = self.config.tp_size or 1
        self.role_environment = self.config  # rollout.sglang.python: the servers' interpreter
        super().__init__(
            run_dir, host=self.config.host,
            startup_timeout_s=self.config.startup_timeout_s, stop_grace_s=self.config.stop_grace_s,
            port_retries=self.config.port_retries, admin_token=self.config.api_key,
        )  # fmt: skip

    def log_name(self, index: int) -> str:
        return f"sglang-{index}.log"

    @property
    def python(self) -> ResolvedPython | None:
        """The servers' interpreter (``rollout.sglang.python``, resolved and
        probed once by the base class), or ``None`` when ``launch_prefix``
        replaces the command (tests' stand-in)."""
        return None if self.launch_prefix is not None else super().python

    def check_launch(self, model_path: str, n_servers: int, devices_per_server: int) -> None:
        tp = self.config.tp_size or max(1, devices_per_server)
        if devices_per_server and tp > devices_per_server:
            raise ServerError(
                f"rollout.sglang.tp_size={tp} needs {tp} devices per server but the allocation gives "
                f"{devices_per_server}; raise t in rollout.backend (e.g. sglang:d1t{tp}) or lower tp_size"
            )
        self._tp = tp
        self.python  # resolved before any server starts

    def command(self, model_path: str, port: int, index: int, device_ids: list[int]) -> list[str]:
        return build_command(
            self.config,
            model_path,
            port,
            dtype=self.dtype,
            tp_size=self._tp,
            seed=self.seed,
            launch_prefix=self.launch_prefix,
            host=self.host_for(index),
            # The kernel's token rule: api_key, else generated beyond loopback.
            api_key=self.admin_token,
            # Resolved by check_launch (every launch); a bare command() keeps the setting as written.
            python=self.resolved_python.python if self.resolved_python is not None else None,
        )

    def environment(self, index: int, n_servers: int, device_ids: list[int]) -> dict[str, str]:
        # Each server sees only its own devices, numbered from 0 (so no --base-gpu-id).
        env = super().environment(index, n_servers, device_ids)
        resolved = self.resolved_python
        if resolved is not None:
            self.server_pythonpath(env, resolved.python, resolved.foreign)
        env.update(self.config.extra_env)
        return env
