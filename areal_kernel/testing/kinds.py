"""The old path of nine contract suites (datasets, metric sinks, advantage
estimators, losses, workflows, weight transports, schedulers, tool-call
parsers and tools), kept so that imports written against it keep working.

The suites live in ``areal_kernel.testing.contracts`` now, one module per
kind (``areal_kernel.testing.contracts.dataset`` holds ``DatasetContract``,
and so on); import them from there or from ``areal_kernel.testing``.
"""

from __future__ import annotations

from areal_kernel.testing.contracts.advantage_estimator import AdvantageEstimatorContract
from areal_kernel.testing.contracts.dataset import DatasetContract
from areal_kernel.testing.contracts.loss import LossContract
from areal_kernel.testing.contracts.metric_sink import MetricSinkContract
from areal_kernel.testing.contracts.scheduler import SchedulerContract
from areal_kernel.testing.contracts.tool import ToolContract
from areal_kernel.testing.contracts.tool_parser import ToolParserContract
from areal_kernel.testing.contracts.weight_transport import WeightTransportContract
from areal_kernel.testing.contracts.workflow import WorkflowContract

__all__ = [
    "AdvantageEstimatorContract",
    "DatasetContract",
    "LossContract",
    "MetricSinkContract",
    "SchedulerContract",
    "ToolContract",
    "ToolParserContract",
    "WeightTransportContract",
    "WorkflowContract",
]
