"""Exact recovery with the FSDP engine (2 ranks, gloo): ``kill -9`` a real
``areal train`` with ``actor.backend: fsdp:d2`` after a recovery checkpoint,
run it again (``recover: auto``) and compare with an uninterrupted run (the
kernel's ``areal_kernel.testing.rank_engines.RankEngineRecoverySuite``). The
engine state goes through ``torch.distributed.checkpoint`` (each rank its
shards)."""

from __future__ import annotations

import os

import pytest

from areal_kernel.testing.rank_engines import RankEngineRecoverySuite

pytestmark = pytest.mark.slow
HERE = os.path.dirname(os.path.abspath(__file__))


class TestFSDPRecovery(RankEngineRecoverySuite):
    ENGINE_NAME = "fsdp"
    EXAMPLE = os.path.join(os.path.dirname(HERE), "examples", "grpo_arithmetic_fsdp.yaml")
    STEPS = 4
