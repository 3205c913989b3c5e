"""Real asynchronous GRPO on SmolLM2-135M with a LoRA adapter
(examples/grpo_lora.yaml) and the embedded server: the sampling reward goes
up while only the adapter trains and travels
(``areal_kernel.testing.learning.ARITHMETIC``: the mean sampling reward over
steps 3-6 above 0.55).

Over 60 s: a real GRPO run on a real model is the point of the test.

Its negative control is shared: the ``frozen`` case of
tests/e2e/test_grpo_learns.py (the kernel's example with every lr at 0) must
fail the same check. An adapter starts as a no-op (B = 0), so with lr=0 this
example samples the base model at every step, as the kernel's frozen run
does. Measured before the control was shared (it was this file's own
``frozen`` case): its seed-1 series equalled test_grpo_learns.py's frozen
one step for step, and over 3 seeds its frozen runs sampled 0.30-0.36
(mean 0.338, std 0.035) against the kernel's 0.340 / 0.033. Sharing saves
one SmolLM2 run (61-116 s) per suite run. Margins from
``bench/bench_learning_signal.py --backend lora``: steps 3-6 sampled
0.69-0.87 with the example's lr (3 seeds); the bar 0.55 is 6 frozen std above
the frozen mean.
"""

import os

from e2e_paths import REPO
from areal_kernel.testing.learning import ARITHMETIC, step_rows

EXAMPLE = os.path.join(REPO, "examples", "grpo_lora.yaml")


def test_lora_grpo_on_smollm2_raises_the_reward(run_areal, smollm2_dir, tmp_path):
    run_dir = str(tmp_path / "run")
    proc = run_areal(
        "train", EXAMPLE, f"run_dir={run_dir}", "trainer.max_steps=6", "trainer.eval_size=0",
        "logging.sinks=[jsonl]", "actor.torch.lr_scheduler=constant",
        timeout=1500,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = step_rows(run_dir)
    assert [r["version"] for r in steps] == [1, 2, 3, 4, 5, 6]
    # Only the adapter travelled: a few MB, not SmolLM2's ~515 MB.
    assert max(r["weights/mb"] for r in steps) < 50
    print(f"\n{ARITHMETIC.describe(steps)}")
    ARITHMETIC.assert_learned(steps)
    final = os.path.join(run_dir, "checkpoints", "final")
    assert os.path.isfile(os.path.join(final, "adapter_config.json"))
