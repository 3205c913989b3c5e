"""A third-party dataset (tests/kernel/plugin_packages/areal-test-contract,
pip-installed into a private directory) passes ``DatasetContract`` in both
documented shapes: a plain list the kernel splits, and a ``(train, eval)``
tuple. Its reward ``scaled`` passes ``RewardContract`` with a keyword whose
default lives only in its config model, as ``areal train`` calls it."""
from __future__ import annotations

from pathlib import Path

import pytest

from areal_kernel.testing import DatasetContract, RewardContract
from areal_kernel.testing.packages import pip_install_private, use_private_site

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def contract_site(tmp_path_factory) -> Path:
    return pip_install_private(HERE / "plugin_packages" / "areal-test-contract", tmp_path_factory.mktemp("contract"))


@pytest.fixture
def with_contract_plugin(contract_site, monkeypatch, areal_env):
    return use_private_site(contract_site, monkeypatch, areal_env)


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
