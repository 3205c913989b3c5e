"""Files of the ``areal inf`` service under ``$AREAL_HOME/inf`` (default ``~/.areal/inf``).

- ``config.toml``: the service's settings (``[gateway]``) and the registered
  models (``[models.<name>]``); the gateway writes it on register/deregister
  and reads it when it starts, so registered models come back after a stop.
- ``gateway.json``: the running gateway (pid, process start time, address,
  admin token, the process ids of every replica); written by the gateway,
  removed when it stops. Readable by its owner only (it holds the token).
- ``gateway.log``: the gateway's own log; replicas log under ``models/<name>/``.

A state file whose pid is gone (or now belongs to another process: the
start time differs) is *stale*: the gateway was killed without cleaning up.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from areal_kernel.config.sections import format_validation_error
from areal_kernel.errors import ConfigError

CONFIG_NAME = "config.toml"
STATE_NAME = "gateway.json"
LOG_NAME = "gateway.log"
LOCK_NAME = "lock"
MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def inf_home() -> Path:
    """``$AREAL_HOME/inf``, or ``~/.areal/inf``."""
    base = os.environ.get("AREAL_HOME") or os.path.join(os.path.expanduser("~"), ".areal")
    return Path(base).expanduser().absolute() / "inf"


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


# -- the running gateway ----------------------------------------------------------


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


def read_state(home: Path, name: str = STATE_NAME) -> dict[str, Any] | None:
    """The state file ``name`` under ``home`` (``areal agent`` keeps its own there)."""
    path = home / name
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: unreadable state file ({e}); remove it if no gateway runs") from None
    if not isinstance(data, dict) or not isinstance(data.get("pid"), int):
        raise ConfigError(f"{path}: not a gateway state file (no pid); remove it if no gateway runs")
    return data


def write_state(home: Path, state: dict[str, Any], name: str = STATE_NAME) -> None:
    write_atomic(home / name, json.dumps(state, indent=2) + "\n", mode=0o600)


def remove_state(home: Path, pid: int | None = None, name: str = STATE_NAME) -> None:
    """Remove the state file (only if it still names ``pid``, when given)."""
    path = home / name
    try:
        if pid is not None:
            current = json.loads(path.read_text(encoding="utf-8"))
            if current.get("pid") != pid:
                return
        path.unlink()
    except (OSError, ValueError):
        pass


def gateway_alive(state: dict[str, Any]) -> bool:
    return process_alive(int(state["pid"]), state.get("start_time"))


def kill_leftovers(state: dict[str, Any], grace_s: float = 5.0) -> list[int]:
    """Kill the process groups a state file names that still run (the gateway
    and every replica, each the leader of its own group), checked by start
    time so a reused pid is never hit. Returns the pids that were signalled."""
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
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in live:
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 10.0)
        while time.monotonic() < deadline and any(group_alive(pid) for pid in live):
            time.sleep(0.1)
    return live


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
