"""A few real asynchronous GRPO steps on SmolLM2-135M: the sampling reward
goes up, and the same run with its weights frozen (``lr=0``, the negative
control) fails the same check (``areal_kernel.testing.learning.ARITHMETIC``:
the mean sampling reward over steps 3-6 must be above 0.55).

Over 60 s each: a real GRPO run on a real model is the point of the test.

The bar, from ``bench/bench_learning_signal.py --backend torch`` (6 steps at
the example's peak lr held constant, seeds 1-4, 2-core AVX-512 machine):
steps 3-6 sampled 0.68-0.86 with the example's lr (mean 0.77, std 0.08) and
0.25-0.38 with lr=0 (mean 0.34, std 0.06): 0.55 is 3.6 frozen std above the
frozen mean and below every learning run. Four steps in the window, because
one step holds a handful of prompt groups (+-0.15); step 2 is left out since
with staleness 1 it still samples mostly the initial weights.

The frozen case is also the negative control of the LoRA learning test
(tests/e2e/test_grpo_lora.py: a fresh adapter is a no-op, and its frozen
series equalled this one step for step), which asserts the same check: with
every lr at 0 no train engine changes what is sampled. (The FSDP and Megatron
GRPO tests shared it too until they moved to a tiny model with their own
controls: ``areal_kernel.testing.rank_engines.RankEngineGRPOSuite``.)

Wall time seen (other helpers' jobs loading both cores ~6x): learning 316 s,
frozen 221 s.
"""

import pytest

from e2e_paths import EXAMPLE
from areal_kernel.testing.learning import ARITHMETIC, frozen_overrides, step_rows


def _run(run_areal, run_dir: str, *overrides: str) -> list[dict]:
    proc = run_areal(
        "train", EXAMPLE, f"run_dir={run_dir}", "trainer.max_steps=6", "trainer.eval_size=0",
        "logging.sinks=[jsonl]", "actor.torch.lr_scheduler=constant", *overrides,
        timeout=1500,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = step_rows(run_dir)
    assert len(steps) == 6
    # Asynchronous, but never staler than allowed; the version moved every step.
    assert max(r["rollout/staleness_max"] for r in steps) <= 1
    assert any(r["rollout/staleness_max"] == 1 for r in steps)
    assert [r["version"] for r in steps] == [1, 2, 3, 4, 5, 6]
    return steps


@pytest.mark.parametrize("arm", ["learning", "frozen"])
def test_grpo_on_smollm2_raises_the_reward(arm, run_areal, smollm2_dir, tmp_path):
    frozen = frozen_overrides("actor.torch.lr") if arm == "frozen" else []
    steps = _run(run_areal, str(tmp_path / "run"), *frozen)
    print(f"\n{arm}: {ARITHMETIC.describe(steps)}")
    ARITHMETIC.assert_arm(arm, steps)
