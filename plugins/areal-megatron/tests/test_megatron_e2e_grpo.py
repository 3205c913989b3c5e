"""A real asynchronous GRPO run through ``areal train`` with ``actor.backend:
megatron:d2`` (the example's): the local scheduler starts 2 Megatron rank
processes (gloo), two data-parallel replicas of a tiny random Llama with a
byte-level tokenizer, one embedded inference server, weights sent in memory
every step, and the ``char_share`` reward rises; its ``lr=0`` twin (the
negative control) does not clear the same bar. The test body and its checks
are the kernel's ``areal_kernel.testing.rank_engines.RankEngineGRPOSuite``
(shared with the FSDP test).

Measured with ``bench/bench_learning_signal.py --backend megatron --seeds 3``
(2-core machine): steps 9-12 sampled
0.983-0.995 with lr 3e-2 and 0.241-0.252 with lr=0 (bar 0.45); this test's
run: 0.857 and 0.248, 62 s for both arms with other work on the cores. On SmolLM2 (the arithmetic task) this
test took 190-372 s, with the torch engine's control shared.

Why d2: it is the example's layout, and the example targets SmolLM2-135M,
whose 9 attention heads and 3 KV heads 2 tensor-parallel ranks cannot split
(the engine refuses it with one error; t2 is exercised on tiny models:
parity, contract suite, recovery). With
``actor.backend=megatron:p2`` the SmolLM2 version passed once in 147 s (stages take
turns), too long for CI; p2's gathers into the broadcast are tested in
test_megatron_weight_update.py."""

from __future__ import annotations

from areal_kernel.testing.rank_engines import RankEngineGRPOSuite, plugin_example


class TestMegatronGRPO(RankEngineGRPOSuite):
    ENGINE_NAME = "megatron"
    EXAMPLE = plugin_example(__file__, "grpo_arithmetic_megatron.yaml")
