"""Real asynchronous GRPO on SmolLM2-135M with a LoRA adapter
(examples/grpo_lora.yaml) and the embedded server: the sampling reward goes
up while only the adapter trains and travels.

Measured (6 steps, constant lr 1e-3, seed 1, 2-core CPU): see LEARNED below
and the report of the change that added it; the frozen-weights control of
test_grpo_learns.py (lr=0, same prompts and sampling) stayed at 0.25-0.38,
and an adapter starts as a no-op, so step 1 samples that same initial policy.
"""

import json
import os

from e2e_paths import REPO

from areal_kernel.testing.trends import sampling_reward_trend

EXAMPLE = os.path.join(REPO, "examples", "grpo_lora.yaml")
LEARNED = 0.55  # the bar of test_grpo_learns.py: above every frozen-policy run measured there


def test_lora_grpo_on_smollm2_raises_the_reward(run_areal, smollm2_dir, tmp_path):
    run_dir = str(tmp_path / "run")
    proc = run_areal(
        "train", EXAMPLE, f"run_dir={run_dir}", "trainer.max_steps=6", "trainer.eval_size=0",
        "logging.sinks=[jsonl]", "actor.torch.lr_scheduler=constant",
        timeout=1500,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if "perf/step_s" in r]
    assert [r["version"] for r in steps] == [1, 2, 3, 4, 5, 6]
    # Only the adapter travelled: a few MB, not SmolLM2's ~515 MB.
    assert max(r["weights/mb"] for r in steps) < 50
    first, later, rewards = sampling_reward_trend(steps)
    assert later > LEARNED, f"steps 3-6 sample no better than a frozen policy: per-step sampling reward {rewards}"
    assert later > first + 0.1, f"no learning trend: per-step sampling reward {rewards}"
    final = os.path.join(run_dir, "checkpoints", "final")
    assert os.path.isfile(os.path.join(final, "adapter_config.json"))
