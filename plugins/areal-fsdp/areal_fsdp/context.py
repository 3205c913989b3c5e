"""The run the controller is executing (set by the ``areal_on_run_start`` hook).

Light module: no torch. ``FSDPTrainEngine`` reads the actor allocation and the
scheduler choice from here when it is built by ``areal train`` (which passes
only the engine's own config section to the constructor).
"""
from __future__ import annotations

from typing import Any

_run: dict[str, Any] = {}


def set_run(config: Any, run_dir: str) -> None:
    _run.clear()
    _run.update(config=config, run_dir=run_dir)


def current_run() -> tuple[Any, str | None]:
    """``(ExperimentConfig or None, run_dir or None)``."""
    return _run.get("config"), _run.get("run_dir")


def clear() -> None:
    _run.clear()
