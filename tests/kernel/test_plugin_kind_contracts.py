"""A third-party dataset (tests/kernel/plugin_packages/areal-test-contract,
pip-installed into a private directory) passes ``DatasetContract`` in both
documented shapes: a plain list the kernel splits, and a ``(train, eval)``
tuple. Its reward ``scaled`` passes ``RewardContract`` with a keyword whose
default lives only in its config model, as ``areal train`` calls it. Its workflow ``minimal`` (only the documented
required members) passes ``WorkflowContract``; ``inflating`` breaks the
suite's reward rule and fails it."""
from __future__ import annotations

from pathlib import Path

import pytest

from areal_kernel.testing import DatasetContract, RewardContract, WorkflowContract
from areal_kernel.testing.packages import private_plugin_fixtures

HERE = Path(__file__).resolve().parent


contract_site, with_contract_plugin = private_plugin_fixtures(HERE / "plugin_packages" / "areal-test-contract", "contract_site")


class TestContractDataAsAList(DatasetContract):
    @pytest.fixture
    def dataset_name(self, with_contract_plugin):
        return "contract_data"

    @pytest.fixture
    def dataset_settings(self):
        return {"mode": "list", "n": 20}


class TestContractDataAsATuple(DatasetContract):
    @pytest.fixture
    def dataset_name(self, with_contract_plugin):
        return "contract_data"

    @pytest.fixture
    def dataset_settings(self):
        return {"mode": "tuple", "n": 12}


class TestScaledRewardDefaultsFromItsConfigModel(RewardContract):
    """``scaled(completion, answer, *, scale)`` has no default for ``scale``:
    the suite must validate ``{}`` through ``ScaledConfig`` (scale 2.0), as
    the kernel does, or the call fails on the missing keyword."""

    @pytest.fixture
    def reward_target(self, with_contract_plugin):
        from areal_kernel.plugins import get_registry

        return get_registry().get("reward", "scaled").target

    @pytest.fixture
    def reward_cases(self):
        return [("7", "7", 2.0), ("6", "7", 0.0)]


class TestScaledRewardWithSettings(TestScaledRewardDefaultsFromItsConfigModel):
    @pytest.fixture
    def reward_settings(self):
        return {"scale": 3}

    @pytest.fixture
    def reward_cases(self):
        return [("7", "7", 3.0), ("6", "7", 0.0)]


class TestMinimalWorkflow(WorkflowContract):
    @pytest.fixture
    def workflow_name(self, with_contract_plugin):
        return "minimal"


def test_the_workflow_suite_refuses_a_reward_above_its_calls(
    with_contract_plugin, areal_tiny_chat_model_dir, tmp_path_factory, tmp_path
):
    from areal_kernel.testing.contracts._shared import _embedded_engine

    suite = WorkflowContract()
    launcher, engine = _embedded_engine(areal_tiny_chat_model_dir, str(tmp_path_factory.mktemp("inflating-server")))
    try:
        record = {"id": "q1", "prompt": "What is 2 + 3?", "answer": "5"}
        with pytest.raises(AssertionError, match="outside the scores of its reward calls"):
            suite.test_rewards_are_called_as_documented(
                "inflating", {}, record, areal_tiny_chat_model_dir, engine, tmp_path
            )
    finally:
        engine.destroy()
        launcher.stop()
