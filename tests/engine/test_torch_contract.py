"""The built-in torch train engine passes the kernel's train-engine contract."""
import pytest

from areal_kernel.engine.torch_engine import TorchTrainEngine
from areal_kernel.testing.contracts import TrainEngineContract, engine_maker

SETTINGS = {"lr": 1e-3, "max_tokens_per_mb": 8}


@pytest.fixture
def contract_model_dir(tiny_model_dir):
    return tiny_model_dir


@pytest.fixture
def make_train_engine(contract_model_dir):
    return engine_maker(lambda: TorchTrainEngine(SETTINGS), contract_model_dir, 10)


@pytest.fixture
def train_engine(make_train_engine):
    e = make_train_engine()
    yield e
    e.destroy()


class TestTorchEngineContract(TrainEngineContract):
    pass
