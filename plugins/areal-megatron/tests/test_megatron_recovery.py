"""Exact recovery with ``actor.backend: megatron:t2`` (2 tensor-parallel ranks,
gloo): ``kill -9`` a real ``areal train`` after a recovery checkpoint, run it
again (``recover: auto``) and compare with an uninterrupted run (the kernel's
``areal_kernel.testing.rank_engines.RankEngineRecoverySuite``). The model
state goes through megatron-core's ``dist_checkpointing`` (each rank its
shards). The suite's tiny Llama has 4 heads: it splits t2."""

from __future__ import annotations

from areal_kernel.testing.rank_engines import RankEngineRecoverySuite, plugin_example


class TestMegatronT2Recovery(RankEngineRecoverySuite):
    ENGINE_NAME = "megatron"
    EXAMPLE = plugin_example(__file__, "grpo_arithmetic_megatron.yaml")
    STEPS = 3
    EXTRA_ARGS = ("actor.backend=megatron:t2",)
