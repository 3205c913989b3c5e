"""Exact recovery of a LoRA run through the real CLI: ``kill -9`` the trainer
after a checkpoint, run the same command again and compare with a run that
was never interrupted. The checkpoints hold the adapter and its optimizer
state only; the servers get the adapter back from the restored engine.

Same set-up as test_recovery.py (tiny random Llama with SmolLM2's tokenizer,
rewards all 0, an entropy bonus so every update depends on the exact samples),
with examples/grpo_lora.yaml's adapter."""

import os
import re

import pytest

from areal_kernel.testing.models import make_tiny_chat_llama
from areal_kernel.testing.recovery import (
    EXACT_SERVER,
    assert_bit_equal,
    kill_after_checkpoint,
    load_weights,
    read_samples,
    run_train,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "examples", "grpo_lora.yaml")
STEPS = 4


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_chat_llama(tmp_path_factory.mktemp("tiny-recovery-lora"))


def _args(model, run_dir):
    return [
        "train", EXAMPLE, f"model.path={model}", f"run_dir={run_dir}",
        f"trainer.max_steps={STEPS}", "trainer.batch_size=2", "trainer.eval_size=2",
        "rollout.gconfig.n_samples=4", "rollout.gconfig.max_new_tokens=6", "rollout.max_staleness=0",
        "weight_update.mode=disk", "algorithm.dynamic_filter=false", "algorithm.entropy_coef=0.05",
        "actor.torch.lora.dropout=0.1", "checkpoint.save_every=1", "checkpoint.keep_last=2",
        "logging.sinks=[console, jsonl]", *EXACT_SERVER,
    ]  # fmt: skip


@pytest.mark.slow
def test_killed_lora_run_resumes_to_the_same_adapter(tiny_model, tmp_path):

    ref_dir, run_dir = str(tmp_path / "reference"), str(tmp_path / "killed")
    ref = run_train(_args(tiny_model, ref_dir))
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]

    kill_after_checkpoint(_args(tiny_model, run_dir), run_dir, step=2)
    from safetensors.torch import load_file

    kept = load_file(os.path.join(run_dir, "recover", "step2", "engine", "model.safetensors"))
    assert kept and all(".lora_" in k for k in kept)  # the adapter only, not the frozen base

    resumed = run_train(_args(tiny_model, run_dir))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    # The kill comes once step 3 has trained; an adapter checkpoint is so small
    # that step 3's may complete before the kill lands, so the run resumes from
    # step 2 or 3 -- either way the work after it was lost and must be redone.
    m = re.search(r"resuming from step (\d+) ", resumed.stdout)
    assert m and int(m.group(1)) in (2, 3), resumed.stdout[-3000:]
    assert [s["uids"] for s in read_samples(run_dir)] == [s["uids"] for s in read_samples(ref_dir)]

    final = [os.path.join(d, "checkpoints", "final") for d in (ref_dir, run_dir)]
    assert os.path.isfile(os.path.join(final[0], "adapter_config.json"))
    a, b = load_weights(final[0]), load_weights(final[1])
    assert set(a) == set(b) and all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in a)
    assert max(float(a[k].abs().max()) for k in a if ".lora_B." in k) > 1e-4  # the adapter trained
    assert_bit_equal(b, a, "adapter tensor")
