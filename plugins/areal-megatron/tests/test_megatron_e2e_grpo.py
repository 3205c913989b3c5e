"""A real asynchronous GRPO run through ``areal train`` with ``actor.backend:
megatron:d2`` (the example's): the local scheduler starts 2 Megatron rank
processes (gloo), two data-parallel replicas of SmolLM2-135M-Instruct, one
embedded inference server, weights sent in memory every step. Asserted: the sampling reward trends up (the kernel's statistic and
bar, ``areal_kernel.testing.trends``), staleness stays bounded, versions
advance, the ranks' logs and the final HF export are there.

Why d2: SmolLM2-135M has 9 attention heads and 3 KV heads, which 2
tensor-parallel ranks cannot split (the engine refuses it with one error; t2
is exercised on tiny models: parity, contract suite, recovery). With
``actor.backend=megatron:p2`` the same test passed once in 147 s (stages take
turns), too long for CI; p2's gathers into the broadcast are tested in
test_megatron_weight_update.py."""

from __future__ import annotations

import json
import os

import pytest
from areal_kernel.testing.trends import ARITHMETIC_LEARNED, sampling_reward_trend

pytestmark = pytest.mark.slow
HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(HERE), "examples", "grpo_arithmetic_megatron.yaml")
STEPS = 6


def test_grpo_with_two_megatron_ranks_raises_the_reward(run_areal, tmp_path):
    """About 65 s: two SmolLM2 megatron ranks plus a server start, and 6 real GRPO
    steps, the fewest that show a reward trend."""
    run_dir = str(tmp_path / "run")
    proc = run_areal(
        "train", EXAMPLE, f"run_dir={run_dir}", f"trainer.max_steps={STEPS}", "trainer.eval_size=0",
        "logging.sinks=[jsonl]",
        timeout=1500,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if "perf/step_s" in r]
    assert len(steps) == STEPS
    assert all(r["train/n_ranks"] == 2.0 and r["train/skipped"] == 0.0 for r in steps)
    first, later, rewards = sampling_reward_trend(steps)
    assert later > ARITHMETIC_LEARNED, f"steps 3-6 sample no better than a frozen policy: per-step reward {rewards}"
    assert later > first + 0.1, f"no learning trend: per-step sampling reward {rewards}"
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
