"""The fsdp engine (2 real ranks) passes the kernel's train-engine contract."""
import pytest

from areal_kernel.testing.contracts import TrainEngineContract

pytestmark = pytest.mark.slow


@pytest.fixture
def contract_model_dir(tiny_model_dir):
    return tiny_model_dir


@pytest.fixture
def train_engine(shared_engine):
    return shared_engine


class TestFSDPEngineContract(TrainEngineContract):
    pass
