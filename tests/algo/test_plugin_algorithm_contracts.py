"""A third-party advantage estimator and loss (tests/algo/plugin_packages/
areal-test-algo, pip-installed into a private directory) pass the kernel's
contract suites, settings included."""
from __future__ import annotations

import pytest

from areal_kernel.testing import AdvantageEstimatorContract, LossContract


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


@pytest.mark.filterwarnings("ignore:.*old_pg.*:DeprecationWarning")
class TestOldStyleLoss(LossContract):
    """A loss written for the keyword convention before ``knobs`` still
    passes the suite (the kernel passes it the knobs as keywords)."""

    @pytest.fixture
    def loss_name(self, with_algo_plugin):
        return "old_pg"

    @pytest.fixture
    def loss_settings_alt(self):
        return {"pg_coef": 0.5}
