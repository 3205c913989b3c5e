"""Fixtures of the areal-fsdp tests: a tiny random Llama on disk and one
2-rank engine shared by the tests that only need *an* initialized engine
(starting ranks costs a few seconds of imports per process)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """Tiny random Llama (vocab 256, 2 layers, tied embeddings); weights drawn
    with std 0.2 so greedy generations depend on the weights."""
    from areal_kernel.testing.rank_engines import make_spread_tiny_llama

    return make_spread_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")), layers=2)


@pytest.fixture(scope="session")
def shared_engine(tiny_model_dir):
    """A 2-rank fsdp engine (gloo), lr 1e-3, small micro-batches."""
    from areal_fsdp.engine import FSDPTrainEngine

    e = FSDPTrainEngine({"lr": 1e-3, "max_tokens_per_mb": 8}, world_size=2)
    e.initialize(tiny_model_dir, 20)
    yield e
    e.destroy()
