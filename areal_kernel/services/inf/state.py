"""Files of the ``areal inf`` service under ``$AREAL_HOME/inf`` (default ``~/.areal/inf``).

- ``config.toml``: the service's settings (``[gateway]``) and the registered
  models (``[models.<name>]``); the gateway writes it on register/deregister
  and reads it when it starts, so registered models come back after a stop.
- ``gateway.json``: the running gateway (pid, process start time, address,
  admin token, the process ids of every replica); written by the gateway,
  removed when it stops. Readable by its owner only (it holds the token).
- ``gateway.log``: the gateway's own log; replicas log under ``models/<name>/``.

A state file whose pid is gone is *stale*: the gateway was killed without
cleaning up. Starting, finding and stopping the gateway by its state file is
``services.detached`` (shared with ``areal agent``), described by ``INF``.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from areal_kernel.config.sections import format_validation_error
from areal_kernel.errors import ConfigError
from areal_kernel.services.detached import DetachedService, write_atomic

CONFIG_NAME = "config.toml"
STATE_NAME = "gateway.json"
LOG_NAME = "gateway.log"
MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class GatewaySettings(BaseModel):
    """``[gateway]`` in ``config.toml`` (``areal inf run`` flags override host, port and token)."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="Bind address; beyond loopback control routes need an admin token.")
    port: int = Field(8000, ge=1, le=65535)
    admin_token: str | None = Field(
        None, description="Bearer token for the control routes (/admin/*); generated when unset and not on loopback."
    )
    health_interval_s: float = Field(5.0, gt=0, description="How often every replica's health route is probed.")
    unhealthy_after: int = Field(
        6,
        ge=1,
        description="A live replica failing this many probes in a row is killed, so the supervisor restarts it.",
    )
    default_max_tokens: int = Field(256, ge=1, description="max_tokens of a request that gives none.")
    stream_chunk_tokens: int = Field(
        8, ge=1, description="Streaming: tokens generated per step before the text so far is sent."
    )
    request_timeout_s: float = Field(600.0, gt=0, description="Per-request limit towards the replicas.")


class ModelEntry(BaseModel):
    """One registered model (``[models.<name>]``)."""

    model_config = ConfigDict(extra="forbid")

    backend: str = Field(description="Inference backend allocation: embedded, embedded:d2, vllm:d1t2, ...")
    model_path: str = Field(description="HF model directory or a registered model name.")
    dtype: Literal["float32", "bfloat16"] | None = Field(None, description="Weights dtype; default float32.")
    max_restarts: int = Field(3, ge=0, description="Restarts allowed per replica before the model is failed.")
    args: dict[str, Any] = Field(
        default_factory=dict, description="The backend's settings, validated against its config section."
    )


class ServiceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    models: dict[str, ModelEntry] = Field(default_factory=dict)


def check_model_name(name: str) -> str:
    if not MODEL_NAME_RE.match(name or ""):
        raise ConfigError(
            f"--model-name {name!r}: use 1-128 letters, digits, '.', '_' or '-' (starting with a letter or digit)"
        )
    return name


def load_config(home: Path) -> ServiceConfig:
    """The service config (defaults when the file does not exist)."""
    import tomllib

    path = home / CONFIG_NAME
    if not path.exists():
        return ServiceConfig()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read: {e}") from None
    try:
        cfg = ServiceConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{path} is invalid: " + format_validation_error(e, model=ServiceConfig)) from None
    for name in cfg.models:
        if not MODEL_NAME_RE.match(name):
            raise ConfigError(f"{path}: models.{name}: not a valid model name (letters, digits, '.', '_', '-')")
    return cfg


def save_config(home: Path, cfg: ServiceConfig) -> None:
    """Write ``config.toml`` atomically (a crash leaves the old or the new file)."""
    lines = ["# areal inf: service settings and registered models (written by the gateway)", "", "[gateway]"]
    # Only what the user set: a default left out follows the kernel's default.
    for k, v in cfg.gateway.model_dump(exclude_unset=True).items():
        if v is not None:
            lines.append(f"{_toml_key(k)} = {_toml_value(v)}")
    for name, entry in cfg.models.items():
        lines += ["", f"[models.{_toml_key(name)}]"]
        data = entry.model_dump()
        args = data.pop("args")
        for k, v in data.items():
            if v is not None:
                lines.append(f"{_toml_key(k)} = {_toml_value(v)}")
        if args:
            lines += [f"[models.{_toml_key(name)}.args]"]
            lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in args.items() if v is not None]
    write_atomic(home / CONFIG_NAME, "\n".join(lines) + "\n", mode=0o600)


def _toml_key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k)


def _toml_value(v: Any) -> str:
    # JSON string escapes (\" \\ \n \uXXXX ...) are all valid TOML basic-string escapes.
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        items = [f"{_toml_key(str(k))} = {_toml_value(x)}" for k, x in v.items() if x is not None]
        return "{ " + ", ".join(items) + " }" if items else "{}"
    raise ConfigError(f"cannot store {v!r} ({type(v).__name__}) in {CONFIG_NAME}; use numbers, strings, lists, maps")


# -- the running gateway ----------------------------------------------------------

INF = DetachedService(
    command="inf",
    title="the inference service",
    process="the gateway",
    short="gateway",
    pid_label="gateway pid",
    not_started="the gateway did not start listening",
    exited="the gateway exited with code {rc} while starting; its log ({log}):",
    state_name=STATE_NAME,
    log_name=LOG_NAME,
    token_env="AREAL_INF_ADMIN_TOKEN",
)
