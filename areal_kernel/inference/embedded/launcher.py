"""Start and stop embedded server processes (no torch in this process).

Each server is ``python -m areal_kernel.inference.embedded.server``; the
process plumbing (ports, process groups, health wait, log tail, stop,
restart) is the kernel's ``SubprocessLauncher``.
"""

from __future__ import annotations

import os
import sys
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from areal_kernel.inference.launcher import PORT_IN_USE_EXIT, SubprocessLauncher
from areal_kernel.utils.network import LOOPBACK_HOSTS, is_loopback

SERVER_MODULE = "areal_kernel.inference.embedded.server"
ADMIN_TOKEN_ENV = "AREAL_EMBEDDED_ADMIN_TOKEN"
__all__ = [
    "ADMIN_TOKEN_ENV",
    "PORT_IN_USE_EXIT",
    "LOOPBACK_HOSTS",
    "SERVER_MODULE",
    "EmbeddedLauncher",
    "EmbeddedServerConfig",
    "LOOPBACK_HOSTS",
    "is_loopback",
]


class EmbeddedServerConfig(BaseModel):
    """Settings of embedded inference servers (``rollout.embedded`` section)."""

    model_config = ConfigDict(extra="forbid")

    dtype: Literal["float32", "bfloat16", "float16"] = (
        "float32"  # bf16 is slower than fp32 on CPUs without avx512_bf16/AMX
    )
    max_batch_size: int = Field(64, ge=1)
    prefix_cache: bool = Field(
        True,
        description="Keep the KV of the prefix the prompts share (a chat template's system prompt) per weight "
        "version and adapter, and prefill only the rest of each prompt. Off: every prompt is prefilled whole, "
        "so a run's generations do not depend on what the server cached before (bit-repeatable resumes).",
    )
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
    keepalive_s: float = Field(
        75.0,
        gt=0,
        description="How long the server keeps an idle HTTP connection open (the client's pool "
        "keeps connections for less: rollout.client_keepalive_s).",
    )
    extra_env: dict[str, str] = Field(default_factory=dict)
    stop_grace_s: float = Field(5.0, ge=0)
    port_retries: int = Field(3, ge=0)


class EmbeddedLauncher(SubprocessLauncher):
    """Launch ``n_servers`` embedded servers and wait until they are healthy."""

    server_name = "embedded server"
    settings_path = "rollout.embedded"
    log_tail_lines = 30
    poll_s = 0.2
    # The embedded server watches PARENT_PID_ENV itself (and --parent-pid).
    guard_parent = False

    def __init__(self, config: EmbeddedServerConfig | None = None, run_dir: str | None = None) -> None:
        self.config = config or EmbeddedServerConfig()
        # The kernel's token rule (SubprocessLauncher.admin_token): beyond
        # loopback a token is generated when the section sets none. It reaches
        # servers through the environment and clients through ``admin_token``.
        super().__init__(
            run_dir, host=self.config.host, startup_timeout_s=self.config.startup_timeout_s,
            stop_grace_s=self.config.stop_grace_s, port_retries=self.config.port_retries,
            base_port=self.config.port, admin_token=self.config.admin_token,
        )  # fmt: skip

    def command(self, model_path: str, port: int, index: int, device_ids: list[int]) -> list[str]:
        c = self.config
        return [
            sys.executable, "-m", SERVER_MODULE,
            "--model", model_path,
            "--host", self.host_for(index),
            "--port", str(port),
            "--dtype", c.dtype,
            "--max-batch-size", str(c.max_batch_size),
            "--seed", str(c.seed),
            "--attn-implementation", c.attn_implementation,
            "--keepalive-s", f"{c.keepalive_s:g}",
            *([] if c.prefix_cache else ["--no-prefix-cache"]),
            "--parent-pid", str(os.getpid()),
        ]  # fmt: skip

    def environment(self, index: int, n_servers: int, device_ids: list[int]) -> dict[str, str]:
        env = super().environment(index, n_servers, device_ids)
        # The token goes through the environment, not argv: argv is world-readable in ps.
        if self.admin_token:
            env[ADMIN_TOKEN_ENV] = self.admin_token
        else:
            env.pop(ADMIN_TOKEN_ENV, None)
        # Let the child import this very package even when it is not installed.
        pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH", "")) if p)
        env.update(self.config.extra_env)
        return env
