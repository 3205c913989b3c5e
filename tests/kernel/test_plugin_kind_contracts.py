"""A third-party dataset (tests/kernel/plugin_packages/areal-test-contract,
pip-installed into a private directory) passes ``DatasetContract`` in both
documented shapes: a plain list the kernel splits, and a ``(train, eval)``
tuple."""
from __future__ import annotations

from pathlib import Path

import pytest

from areal_kernel.testing import DatasetContract
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
