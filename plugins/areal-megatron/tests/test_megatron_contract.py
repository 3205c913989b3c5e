"""The megatron engine (``megatron:t2``: 2 real tensor-parallel ranks) passes
the kernel's train-engine contract. The engine under test runs on the
session's rank pool; the recovery check starts one more t2 engine to load
the checkpoint into."""

import pytest

from areal_kernel.testing.contracts import TrainEngineContract, engine_maker

pytestmark = pytest.mark.slow
SETTINGS = {"lr": 1e-3, "max_tokens_per_mb": 8}


@pytest.fixture
def contract_model_dir(tiny_model_dir):
    return tiny_model_dir


@pytest.fixture(scope="module")
def _t2_engine(rank_pool, tiny_model_dir):
    return rank_pool.build(SETTINGS, "megatron:t2", tiny_model_dir, 20)


@pytest.fixture
def train_engine(_t2_engine):
    return _t2_engine


@pytest.fixture
def make_train_engine(contract_model_dir):
    from areal_megatron.engine import MegatronTrainEngine

    return engine_maker(lambda: MegatronTrainEngine(SETTINGS, "megatron:t2"), contract_model_dir, 20)


class TestMegatronEngineContract(TrainEngineContract):
    pass
