"""The fsdp engine (2 real ranks) passes the kernel's train-engine contract.

Most checks run on the session's shared engine; the recovery check starts one
more 2-rank engine to load the checkpoint into."""

import pytest

from areal_kernel.testing.contracts import TrainEngineContract, engine_maker

pytestmark = pytest.mark.slow


@pytest.fixture
def contract_model_dir(tiny_model_dir):
    return tiny_model_dir


@pytest.fixture
def train_engine(shared_engine):
    return shared_engine


@pytest.fixture
def make_train_engine(contract_model_dir):
    from areal_fsdp.engine import FSDPTrainEngine

    # The shared engine's settings (conftest.shared_engine).
    return engine_maker(
        lambda: FSDPTrainEngine({"lr": 1e-3, "max_tokens_per_mb": 8}, world_size=2), contract_model_dir, 20
    )


class TestFSDPEngineContract(TrainEngineContract):
    pass
