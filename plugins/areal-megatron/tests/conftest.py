"""Fixtures of the areal-megatron tests: tiny random models built from real
configs (Llama via ``areal_kernel.testing.models``, Qwen2/Qwen3 here)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    from areal_kernel.testing.models import make_tiny_llama

    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")), seed=3, layers=4)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """Tiny random Llama (vocab 256, 4 layers, 4 heads / 2 KV heads: splits
    t2 and p2; tied embeddings); weights drawn with std 0.2 so greedy
    generations depend on the weights."""
    from areal_kernel.testing.rank_engines import make_spread_tiny_llama

    return make_spread_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama-t2")), layers=4)


class RankPool:
    """One set of 2 rank processes for the whole session: each module builds
    its engine on them (``MegatronTrainEngine(..., ranks=...)``), the previous
    engine handing them over, so the imports of a start happen once."""

    def __init__(self) -> None:
        self.engine = None

    def build(self, config: dict, allocation: str, model_dir: str, total_steps: int = 20):
        from areal_megatron.engine import MegatronTrainEngine

        ranks = self.engine.detach_ranks() if self.engine is not None else None
        self.engine = None
        e = MegatronTrainEngine(config, allocation, ranks=ranks)
        e.initialize(model_dir, total_steps)
        self.engine = e
        return e

    def close(self) -> None:
        if self.engine is not None:
            self.engine.destroy()
            self.engine = None


_POOL = RankPool()


@pytest.fixture(scope="session")
def rank_pool():
    yield _POOL
    _POOL.close()


def pytest_runtest_teardown(item, nextitem):
    # The pool's ranks (SmolLM2 for the parity test) hold GBs: they end with
    # the last test that uses them instead of living to the end of the session.
    if "rank_pool" in getattr(item, "fixturenames", ()) and "rank_pool" not in getattr(nextitem, "fixturenames", ()):
        _POOL.close()
