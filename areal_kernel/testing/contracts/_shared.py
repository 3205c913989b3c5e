"""What the contract suites share: building a part as the kernel builds it
(through the registry, with settings validated against the registered
``config_model``), the check that a misspelt setting is refused, and the
real engines several suites run on (the kernel's torch train engine, its
embedded inference server)."""

from __future__ import annotations

import math
from typing import Any

import pytest


# A settings key no part declares: a config_model must refuse it.
_TYPO_KEY = "areal_contract_no_such_setting"
# A keyword no kernel version passes: estimators and losses must ignore it.
_EXTRA_KEYWORD = "areal_contract_future_keyword"


def _spec(kind: str, name: str) -> Any:
    from areal_kernel.plugins import get_registry

    return get_registry().get(kind, name)


def _build(kind: str, name: str, ctx: Any) -> Any:
    """``name`` of ``kind`` built the way the kernel builds it (``Registry.build``:
    the kind's factory shape, then its contract checked)."""
    from areal_kernel.plugins import get_registry

    return get_registry().build(kind, name, ctx)


def _config(data: dict[str, Any]) -> Any:
    """An ``ExperimentConfig`` validated from ``data`` as ``areal train`` validates a file."""
    from areal_kernel.config.loader import validate_config
    from areal_kernel.plugins import get_registry

    return validate_config(data, "contract config", get_registry())


def _section(name: str, settings: dict[str, Any] | None, **fields: Any) -> dict[str, Any]:
    out = dict(fields)
    if settings:
        out[name] = settings
    return out


def _check_unknown_setting_is_refused(kind: str, name: str, where: str) -> None:
    """A misspelt key under ``where`` must be a ``ConfigError`` naming it."""
    from areal_kernel.config.sections import validate_settings
    from areal_kernel.errors import ConfigError

    try:
        validate_settings(where, kind, name, {_TYPO_KEY: 1}, spec=_spec(kind, name))
    except ConfigError as e:
        msg = str(e)
        assert where in msg, f"the error must name the section {where!r}: {msg}"
        return
    pytest.fail(
        f"{where}: {{{_TYPO_KEY}: 1}} was accepted; a misspelt setting must be an error. Give the "
        f"config_model of {kind} '{name}' model_config = ConfigDict(extra='forbid')"
    )


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(float(x))


def _torch_engine(model_dir: str, total_steps: int) -> Any:
    """The kernel's torch train engine on ``model_dir`` (lr 1e-3, seed 0), initialized."""
    from areal_kernel.engine.torch_engine import TorchTrainEngine

    engine = TorchTrainEngine({"lr": 1e-3, "seed": 0})
    engine.initialize(model_dir, total_steps)
    return engine


def _embedded_engine(model_dir: str, run_dir: str) -> tuple[Any, Any]:
    """The kernel's embedded server (one, fp32) on ``model_dir`` and its client."""
    from areal_kernel.inference.client import RemoteInferenceEngine
    from areal_kernel.inference.embedded.backend import EmbeddedProtocol
    from areal_kernel.inference.embedded.launcher import EmbeddedLauncher, EmbeddedServerConfig

    launcher = EmbeddedLauncher(EmbeddedServerConfig(dtype="float32"), run_dir=run_dir)
    infos = launcher.launch(model_dir, n_servers=1, devices_per_server=0)
    return launcher, RemoteInferenceEngine([i.address for i in infos], EmbeddedProtocol())


async def _closing(engine: Any, coro: Any) -> Any:
    """Await ``coro``, then release the engine's sessions of this event loop."""
    try:
        return await coro
    finally:
        close = getattr(engine, "aclose", None)
        if close is not None:
            await close(current_loop_only=True)
