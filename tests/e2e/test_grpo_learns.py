"""A few real asynchronous GRPO steps on SmolLM2-135M: the sampling reward
goes up (a trend between the first and the last steps, not a value or a time)."""
import json
import os

from e2e_paths import EXAMPLE
from areal_kernel.testing.trends import sampling_reward_trend


def test_grpo_on_smollm2_raises_the_reward(run_areal, smollm2_dir, tmp_path):
    run_dir = str(tmp_path / "run")
    proc = run_areal(
        "train", EXAMPLE, f"run_dir={run_dir}", "trainer.max_steps=6", "trainer.eval_size=0",
        "logging.sinks=[jsonl]",
        timeout=1500,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if "perf/step_s" in r]
    assert len(steps) == 6
    first, later, rewards = sampling_reward_trend(steps)
    assert later > first + 0.1, f"no learning trend: per-step sampling reward {rewards}"
    # Asynchronous, but never staler than allowed; weights moved every step.
    assert max(r["rollout/staleness_max"] for r in steps) <= 1
    assert any(r["rollout/staleness_max"] == 1 for r in steps)
    assert [r["version"] for r in steps] == [1, 2, 3, 4, 5, 6]
