"""In-memory weight updates from megatron ranks into a real embedded inference
server, through the kernel's weight-transport hook and registry (the path
``areal train`` takes): the ranks gather tensor-parallel (t2) and pipeline
(p2) shards into HF tensors, rank 0 streams them in small buckets. The test
is the kernel's ``areal_kernel.testing.rank_engines.RankEngineWeightUpdateSuite``,
run once per layout on the session's rank pool."""

from __future__ import annotations

import pytest

from areal_kernel.testing.rank_engines import RankEngineWeightUpdateSuite


class TestMegatronWeightUpdate(RankEngineWeightUpdateSuite):
    ENGINE_NAME = "megatron"

    @pytest.fixture(params=["megatron:t2", "megatron:p2"])
    def update_engine(self, request, rank_pool, tiny_model_dir):
        return rank_pool.build({"lr": 1e-3, "max_tokens_per_mb": 16}, request.param, tiny_model_dir, 20)
