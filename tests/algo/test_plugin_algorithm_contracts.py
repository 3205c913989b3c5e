"""A third-party advantage estimator and loss (tests/algo/plugin_packages/
areal-test-algo, pip-installed into a private directory) pass the kernel's
contract suites, settings included."""
from __future__ import annotations

from pathlib import Path

import pytest

from areal_kernel.testing import AdvantageEstimatorContract, LossContract
from areal_kernel.testing.packages import pip_install_private, use_private_site

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def algo_plugin_site(tmp_path_factory) -> Path:
    return pip_install_private(HERE / "plugin_packages" / "areal-test-algo", tmp_path_factory.mktemp("algo-plugin"))


@pytest.fixture
def with_algo_plugin(algo_plugin_site, monkeypatch, areal_env):
    return use_private_site(algo_plugin_site, monkeypatch, areal_env)


class TestSignEstimator(AdvantageEstimatorContract):
    @pytest.fixture
    def estimator_name(self, with_algo_plugin):
        return "sign"

    @pytest.fixture
    def estimator_settings(self):
        return {"scale": 1.0}

    @pytest.fixture
    def estimator_settings_alt(self):
        return {"scale": 2.0}


class TestVanillaPGLoss(LossContract):
    @pytest.fixture
    def loss_name(self, with_algo_plugin):
        return "vanilla_pg"

    @pytest.fixture
    def loss_settings_alt(self):
        return {"pg_coef": 0.5}
