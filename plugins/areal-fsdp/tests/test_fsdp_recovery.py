"""Exact recovery with the FSDP engine (2 ranks, gloo): ``kill -9`` a real
``areal train`` with ``actor.backend: fsdp:d2`` after a recovery checkpoint,
run it again (``recover: auto``) and compare with an uninterrupted run (the
kernel's ``areal_kernel.testing.rank_engines.RankEngineRecoverySuite``). The
engine state goes through ``torch.distributed.checkpoint`` (each rank its
shards)."""

from __future__ import annotations

from areal_kernel.testing.rank_engines import RankEngineRecoverySuite, plugin_example


class TestFSDPRecovery(RankEngineRecoverySuite):
    ENGINE_NAME = "fsdp"
    EXAMPLE = plugin_example(__file__, "grpo_arithmetic_fsdp.yaml")
    STEPS = 4
