"""A real asynchronous GRPO run through ``areal train`` with ``actor.backend:
fsdp:d2``: the local scheduler starts 2 FSDP rank processes (gloo), one
embedded inference server serves a tiny random Llama with a byte-level
tokenizer, weights move in memory every step, and the ``char_share`` reward
rises; its ``lr=0`` twin (the negative control) does not clear the same bar.
The test body and its checks are the kernel's
``areal_kernel.testing.rank_engines.RankEngineGRPOSuite`` (shared with the
Megatron test).

Measured with ``bench/bench_learning_signal.py --backend fsdp --seeds 3``
(2-core machine): steps 9-12 sampled
0.887-0.961 with lr 3e-2 and 0.239-0.248 with lr=0 (bar 0.45); this test's
run: 0.824 and 0.244, 69 s for both arms with other work on the cores. On SmolLM2 (the arithmetic task)
this test took 128-280 s, with the torch engine's control shared."""

from __future__ import annotations

from areal_kernel.testing.rank_engines import RankEngineGRPOSuite, plugin_example


class TestFSDPGRPO(RankEngineGRPOSuite):
    ENGINE_NAME = "fsdp"
    EXAMPLE = plugin_example(__file__, "grpo_arithmetic_fsdp.yaml")


class TestFSDPTensorParallelGRPO(RankEngineGRPOSuite):
    """The same run with the weights split by tensor parallelism
    (``fsdp:t2``: q/k/v and gate/up column-wise, o/down row-wise over the two
    ranks; the tiny model's 4 heads and 2 KV heads divide by 2), gathered for
    every in-memory broadcast: the reward clears ``TINY_CHARS``'s bar and the
    ``lr=0`` twin does not."""

    ENGINE_NAME = "fsdp"
    EXAMPLE = plugin_example(__file__, "grpo_arithmetic_fsdp.yaml")
    OVERRIDES = ("actor.backend=fsdp:t2",)
