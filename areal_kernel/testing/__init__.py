"""Test support shipped with the kernel: pytest fixtures and contract suites.

Plugins (ours and third parties') subclass the contract suites and provide
the fixtures they ask for; the pytest plugin (entry point ``areal_testing``)
supplies shared fixtures. Every suite is importable from here::

    from areal_kernel.testing import DatasetContract, RewardContract

Engines and platforms: ``areal_kernel.testing.contracts``; the other kinds
(datasets, metric sinks, advantage estimators, losses, workflows, weight
transports, schedulers, tool-call parsers, tools): ``areal_kernel.testing.kinds``. The names resolve
on first use, so importing a helper module of this package (``models``,
``waits``, ``noise``) does not import pytest.

Float comparisons across code paths (two engines, a server and an engine):
``areal_kernel.testing.noise`` measures the noise floor in the same test and
asserts within a stated multiple of it.
"""

from __future__ import annotations

import importlib
from typing import Any

_SUITES = {
    "PlatformContract": "contracts",
    "RewardContract": "contracts",
    "InferenceEngineContract": "contracts",
    "TrainEngineContract": "contracts",
    "DatasetContract": "kinds",
    "MetricSinkContract": "kinds",
    "AdvantageEstimatorContract": "kinds",
    "LossContract": "kinds",
    "WorkflowContract": "kinds",
    "WeightTransportContract": "kinds",
    "SchedulerContract": "kinds",
    "ToolParserContract": "kinds",
    "ToolContract": "kinds",
}

__all__ = sorted(_SUITES)


def __getattr__(name: str) -> Any:
    module = _SUITES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
