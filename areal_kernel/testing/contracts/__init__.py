"""The contract suites, one module per registry kind: a plugin's tests
subclass one per registered part and give it the fixtures it asks for::

    import pytest
    from areal_kernel.testing.contracts import PlatformContract

    class TestMyPlatform(PlatformContract):
        @pytest.fixture
        def platform(self):
            return MyPlatform()

Each suite builds the part exactly as the kernel does (through the registry,
with settings validated against the registered ``config_model``) and checks
what the kernel relies on, through public kernel APIs only;
docs/plugin-authoring.md ("Testing your plugin") lists the fixtures of each.
Real parts throughout: the kernel's torch train engine and embedded
inference server on tiny models, real reward worker processes, real files
and subprocesses.

A suite's module is named after its kind's module in ``areal_kernel.api``
(``contracts.scheduler`` holds ``SchedulerContract``, the suite for
``areal_kernel.api.scheduler``); what several suites share is in
``contracts._shared``. Every suite is importable from this package and from
``areal_kernel.testing``; ``areal_kernel.testing.kinds`` is the old path of
nine of them and still re-exports them.
"""

from __future__ import annotations

from areal_kernel.testing.contracts.advantage_estimator import AdvantageEstimatorContract
from areal_kernel.testing.contracts.dataset import DatasetContract
from areal_kernel.testing.contracts.inference_engine import InferenceEngineContract
from areal_kernel.testing.contracts.loss import LossContract
from areal_kernel.testing.contracts.metric_sink import MetricSinkContract
from areal_kernel.testing.contracts.platform import PlatformContract
from areal_kernel.testing.contracts.reward import RewardContract
from areal_kernel.testing.contracts.scheduler import SchedulerContract
from areal_kernel.testing.contracts.tool import ToolContract
from areal_kernel.testing.contracts.tool_parser import ToolParserContract
from areal_kernel.testing.contracts.train_engine import (
    JointPoliciesContract,
    PolicyEngineContract,
    TrainEngineContract,
    engine_maker,
    policies_engine_maker,
)
from areal_kernel.testing.contracts.trainer import TrainerContract
from areal_kernel.testing.contracts.weight_transport import WeightTransportContract
from areal_kernel.testing.contracts.workflow import WorkflowContract

__all__ = [
    "AdvantageEstimatorContract",
    "DatasetContract",
    "InferenceEngineContract",
    "JointPoliciesContract",
    "LossContract",
    "MetricSinkContract",
    "PlatformContract",
    "PolicyEngineContract",
    "RewardContract",
    "SchedulerContract",
    "ToolContract",
    "ToolParserContract",
    "TrainEngineContract",
    "TrainerContract",
    "WeightTransportContract",
    "WorkflowContract",
    "engine_maker",
    "policies_engine_maker",
]
