"""Exact recovery with the FSDP engine (2 ranks, gloo): ``kill -9`` a real
``areal train`` after a recovery checkpoint, run it again (``recover:
auto``) and compare with an uninterrupted run (the kernel's
``areal_kernel.testing.rank_engines.RankEngineRecoverySuite``), on each
layout whose state is stored differently: ``fsdp:d2`` (every weight and its
optimizer state sharded over the data ranks), ``fsdp:t2`` (DTensor shards
of the split projections, replicated norms and embedding) and ``fsdp:p2``
(each rank its own pipeline stage and optimizer). The engine state goes
through ``torch.distributed.checkpoint`` (each rank its shards). The
suite's tiny Llama (4 heads, 2 KV heads, 2 layers) splits t2 and p2.

The split layouts run 3 steps (checkpoint 1, killed in step 2, resumed
through step 3: enough to resume after a checkpoint and train on). Measured
on 2 cores shared with other work: d2 17-24 s, t2 18-22 s, p2 12-21 s.
Negative control, run by hand once (not kept as a test): ranks whose
``dcp_load`` reads only the model entry (fresh AdamW moments) fail the
weight check on t2 and on p2 (both name model.embed_tokens.weight)."""

from __future__ import annotations

from areal_kernel.testing.rank_engines import RankEngineRecoverySuite, plugin_example


class TestFSDPRecovery(RankEngineRecoverySuite):
    ENGINE_NAME = "fsdp"
    EXAMPLE = plugin_example(__file__, "grpo_arithmetic_fsdp.yaml")
    STEPS = 4


class TestFSDPTensorParallelRecovery(RankEngineRecoverySuite):
    ENGINE_NAME = "fsdp"
    EXAMPLE = plugin_example(__file__, "grpo_arithmetic_fsdp.yaml")
    STEPS = 3
    EXTRA_ARGS = ("actor.backend=fsdp:t2",)


class TestFSDPPipelineRecovery(RankEngineRecoverySuite):
    ENGINE_NAME = "fsdp"
    EXAMPLE = plugin_example(__file__, "grpo_arithmetic_fsdp.yaml")
    STEPS = 3
    EXTRA_ARGS = ("actor.backend=fsdp:p2",)
