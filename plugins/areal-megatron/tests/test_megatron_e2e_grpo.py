"""A real asynchronous GRPO run through ``areal train`` with ``actor.backend:
megatron:d2`` (the example's): the local scheduler starts 2 Megatron rank
processes (gloo), two data-parallel replicas of SmolLM2-135M-Instruct, one
embedded inference server, weights sent in memory every step. Asserted: the
sampling reward over steps 3-6 clears the kernel's learning bar
(``areal_kernel.testing.learning.ARITHMETIC``, 0.55), staleness stays bounded,
versions advance, the ranks' logs and the final HF export are there.

Its negative control is shared with the FSDP test and the kernel's: the
``frozen`` case of tests/e2e/test_grpo_learns.py (the kernel's example with
every lr at 0) must fail the same check. A frozen policy samples the same
whichever engine holds it, and this example's other rollout settings
(``filter_retry_budget: 1``, in-memory updates) gave the identical per-step
series when the kernel's example ran with them (seed 1); sharing keeps two more
SmolLM2 ranks off the big-memory unit, the suite's longest. Measured on
Megatron with ``bench/bench_learning_signal.py --backend megatron --seed 1``
and this test (2-core AVX-512, other work sharing the cores): steps 3-6 sampled
0.763 and 0.749 with the example's lr (two runs of seed 1) and 0.345 with lr=0,
in line with the torch engine's and FSDP's arms. More seeds are owed.

Why d2: SmolLM2-135M has 9 attention heads and 3 KV heads, which 2 tensor-
parallel ranks cannot split (the engine refuses it with one error; t2 is
exercised on tiny models: parity, contract suite, recovery). With
``actor.backend=megatron:p2`` the same test passed once in 147 s (stages take
turns), too long for CI; p2's gathers into the broadcast are tested in
test_megatron_weight_update.py."""

from __future__ import annotations

import json
import os

import pytest
from areal_kernel.testing.learning import ARITHMETIC, step_rows

pytestmark = pytest.mark.slow
HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(HERE), "examples", "grpo_arithmetic_megatron.yaml")
STEPS = 6


def test_grpo_with_two_megatron_ranks_raises_the_reward(run_areal, tmp_path):
    """Over 60 s (139 s and 287 s seen while other work shared the two cores;
    the 65 s once written here was the FSDP test's): two SmolLM2 Megatron ranks plus a server
    start, and 6 real GRPO steps, the fewest that give the check a four-step
    window after the initial policy's steps."""
    run_dir = str(tmp_path / "run")
    proc = run_areal(
        "train", EXAMPLE, f"run_dir={run_dir}", f"trainer.max_steps={STEPS}", "trainer.eval_size=0",
        "logging.sinks=[jsonl]",
        timeout=1500,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = step_rows(run_dir)
    assert len(steps) == STEPS
    assert all(r["train/n_ranks"] == 2.0 and r["train/skipped"] == 0.0 for r in steps)
    print(f"\n{ARITHMETIC.describe(steps)}")
    ARITHMETIC.assert_learned(steps)
    # Asynchronous (some samples one version old), never staler than allowed.
    assert max(r["rollout/staleness_max"] for r in steps) <= 1
    assert any(r["rollout/staleness_max"] == 1 for r in steps), [r["rollout/staleness_max"] for r in steps]
    assert [r["version"] for r in steps] == list(range(1, STEPS + 1))
    assert all(r["weights/mb"] > 100 for r in steps)  # SmolLM2 broadcast from the ranks each step
    # The 2 ranks logged to the run dir and are gone; the export is a loadable HF dir.
    assert sorted(os.listdir(os.path.join(run_dir, "megatron-ranks"))) == ["rank-0.log", "rank-1.log"]
    final = json.load(open(os.path.join(run_dir, "result.json")))["checkpoint"]
    assert os.path.isfile(os.path.join(final, "config.json")) and os.path.isfile(
        os.path.join(final, "tokenizer_config.json")
    )
    assert any(f.endswith(".safetensors") for f in os.listdir(final))
