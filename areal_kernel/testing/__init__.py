"""Test support shipped with the kernel: pytest fixtures and contract suites.

Plugins (ours and third parties') subclass the contract suites and provide
the fixtures they ask for; the pytest plugin (entry point ``areal_testing``)
supplies shared fixtures. Every suite is importable from here::

    from areal_kernel.testing import DatasetContract, RewardContract

The suites live in ``areal_kernel.testing.contracts``, one module per kind
named after the kind's module in ``areal_kernel.api`` (``contracts.dataset``,
``contracts.train_engine``, ...); ``areal_kernel.testing.kinds`` is the old
path of nine of them. The names resolve on first use, so importing a helper
module of this package (``models``, ``waits``, ``noise``) does not import
pytest.

Float comparisons across code paths (two engines, a server and an engine):
``areal_kernel.testing.noise`` measures the noise floor in the same test and
asserts within a stated multiple of it.
"""

from __future__ import annotations

import importlib
from typing import Any

_SUITES = {
    "PlatformContract": "contracts.platform",
    "RewardContract": "contracts.reward",
    "InferenceEngineContract": "contracts.inference_engine",
    "TrainEngineContract": "contracts.train_engine",
    "PolicyEngineContract": "contracts.train_engine",
    "JointPoliciesContract": "contracts.train_engine",
    "DatasetContract": "contracts.dataset",
    "MetricSinkContract": "contracts.metric_sink",
    "AdvantageEstimatorContract": "contracts.advantage_estimator",
    "LossContract": "contracts.loss",
    "WorkflowContract": "contracts.workflow",
    "WeightTransportContract": "contracts.weight_transport",
    "SchedulerContract": "contracts.scheduler",
    "ToolParserContract": "contracts.tool_parser",
    "ToolContract": "contracts.tool",
    "TrainerContract": "contracts.trainer",
}

__all__ = sorted(_SUITES)


def __getattr__(name: str) -> Any:
    module = _SUITES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
