"""Multi-turn GRPO on SmolLM2-135M (examples/grpo_multi_turn.yaml): a wrong
answer to a single-digit sum gets "Your answer is wrong. Try again." and a
second turn; a sample solved at turn k scores 0.5**k. The sampling reward
rises over a few asynchronous steps (the kernel's trend statistic,
``areal_kernel.testing.trends``), and the second-turn success rate (of the
samples whose first answer was wrong, the fraction corrected after the
feedback) is logged every step and printed.

Over 60 s: a real GRPO run on a real model is the point of the test.

Measured (seed 1, 6 steps, 2-core CPU): sampling reward per step 0.36, 0.93,
0.90, 0.95, 0.82, 0.92; second-turn success 0.13 at step 1 (the initial
policy corrects about one wrong answer in eight after the feedback), then
falling towards 0 as first answers improve (the few still wrong are the ones
it cannot fix). Step 1 samples the initial policy, whose reward (0.36) is
the frozen-policy level: first-turn accuracy 0.31 plus half credit for the
corrected ones. Four steps are the fewest the trend statistic takes.

The bar, measured with ``bench/bench_learning_signal.py --runs 3 --controls 3
--steps 4 --example examples/grpo_multi_turn.yaml trainer.eval_size=0``
(2-core AVX-512): steps 3-4 sampled 0.78-0.92 with the example's lr and
0.28-0.46 with lr=0 (the negative control), so LEARNED = 0.55 separates them;
``later - first`` alone does not (the frozen policy reached +0.17 on one seed)
and is kept only as the direction check.
"""

import json
import math
import os

from e2e_paths import REPO
from areal_kernel.testing.trends import sampling_reward_trend

EXAMPLE = os.path.join(REPO, "examples", "grpo_multi_turn.yaml")
STEPS = 4
MARGIN = 0.1  # later - first, as the single-turn test
LEARNED = 0.55  # the single-turn test's bar; frozen-policy runs sampled 0.28-0.46 here


def test_multi_turn_grpo_on_smollm2_raises_the_reward(run_areal, smollm2_dir, tmp_path):
    run_dir = str(tmp_path / "run")
    proc = run_areal(
        "train", EXAMPLE, f"run_dir={run_dir}", f"trainer.max_steps={STEPS}", "trainer.eval_size=0",
        "logging.sinks=[jsonl]", "actor.torch.lr_scheduler=constant",
        timeout=1500,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if "perf/step_s" in r]
    assert [r["version"] for r in steps] == list(range(1, STEPS + 1))
    first, later, rewards = sampling_reward_trend(steps)
    second = [r.get("workflow/second_turn_success") for r in steps]
    turns = [r.get("workflow/turns") for r in steps]
    print(f"\nmulti-turn GRPO: sampling reward per step {[round(x, 3) for x in rewards]}; "
          f"second-turn success per step {[None if x is None else round(x, 3) for x in second]}; "
          f"turns per sample {[None if x is None else round(x, 2) for x in turns]}")  # fmt: skip
    # Episodes really took two turns after a wrong answer, and the rate was logged.
    known = [x for x in second if x is not None and not math.isnan(x)]
    assert known and all(0.0 <= x <= 1.0 for x in known), second
    assert second[0] is not None and not math.isnan(second[0]), "the initial policy got no second turn"
    assert all(t is not None and 1.0 < t <= 2.0 for t in turns), turns
    assert later > LEARNED, f"steps 3-{STEPS} sample no better than the initial policy: {rewards}"
    assert later > first + MARGIN, f"no learning trend: per-step sampling reward {rewards}"
