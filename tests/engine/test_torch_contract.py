"""The built-in torch train engine passes the kernel's train-engine contract."""
import pytest

from areal_kernel.engine.torch_engine import TorchTrainEngine
from areal_kernel.testing.contracts import TrainEngineContract


@pytest.fixture
def contract_model_dir(tiny_model_dir):
    return tiny_model_dir


@pytest.fixture
def train_engine(contract_model_dir):
    e = TorchTrainEngine({"lr": 1e-3, "max_tokens_per_mb": 8})
    e.initialize(contract_model_dir, 10)
    yield e
    e.destroy()


class TestTorchEngineContract(TrainEngineContract):
    pass
