"""Real asynchronous GRPO on SmolLM2-135M with a LoRA adapter
(examples/grpo_lora.yaml) and the embedded server: the sampling reward goes
up while only the adapter trains and travels, and the same run with ``lr=0``
(the engine's lr is the adapter's: the base weights are frozen anyway) fails
the same check (``areal_kernel.testing.learning.ARITHMETIC``: the mean
sampling reward over steps 3-6 above 0.55).

Over 60 s each: a real GRPO run on a real model is the point of the test.

An adapter starts as a no-op (B = 0), so the frozen run samples the base
model through the adapter-serving path; its own control rather than
test_grpo_learns.py's, because that path (the adapter served under the name
``policy``) is what this test is about. Margins from ``bench/bench_learning_signal.py --backend lora
--seed 2 --seed 3`` and this test's runs of seed 1 (2-core AVX-512): steps
3-6 sampled 0.69-0.87 with the example's lr and 0.30-0.36 with lr=0 (mean
0.34, std 0.035): the bar 0.55 is 6 frozen std above the frozen mean. The
frozen seed-1 series equalled test_grpo_learns.py's frozen one step for step
(a zero adapter is the base model). Wall time seen: learning 127 s, frozen
93 s (other work on the cores); the control adds one run of about the
learning run's length.
"""

import os

import pytest

from e2e_paths import REPO
from areal_kernel.testing.learning import ARITHMETIC, frozen_overrides, step_rows

EXAMPLE = os.path.join(REPO, "examples", "grpo_lora.yaml")


@pytest.mark.parametrize("arm", ["learning", "frozen"])
def test_lora_grpo_on_smollm2_raises_the_reward(arm, run_areal, smollm2_dir, tmp_path):
    run_dir = str(tmp_path / "run")
    frozen = frozen_overrides("actor.torch.lr") if arm == "frozen" else []
    proc = run_areal(
        "train", EXAMPLE, f"run_dir={run_dir}", "trainer.max_steps=6", "trainer.eval_size=0",
        "logging.sinks=[jsonl]", "actor.torch.lr_scheduler=constant", *frozen,
        timeout=1500,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = step_rows(run_dir)
    assert [r["version"] for r in steps] == [1, 2, 3, 4, 5, 6]
    # Only the adapter travelled: a few MB, not SmolLM2's ~515 MB.
    assert max(r["weights/mb"] for r in steps) < 50
    print(f"\n{arm}: {ARITHMETIC.describe(steps)}")
    ARITHMETIC.assert_arm(arm, steps)
    final = os.path.join(run_dir, "checkpoints", "final")
    assert os.path.isfile(os.path.join(final, "adapter_config.json"))
