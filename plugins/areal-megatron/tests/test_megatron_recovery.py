"""Exact recovery with ``actor.backend: megatron:t2`` (2 tensor-parallel ranks,
gloo): ``kill -9`` a real ``areal train`` after a recovery checkpoint, run it
again (``recover: auto``) and compare with an uninterrupted run: same sample
ids per step, same final weights. The model state goes through megatron-core's
``dist_checkpointing`` (each rank its shards).

Tiny random Llama with SmolLM2's tokenizer (4 heads: it splits t2); its
arithmetic rewards are 0, so an entropy bonus is what makes each update
depend on the sampled tokens."""

from __future__ import annotations

import json
import os

import pytest

from areal_kernel.testing.models import make_tiny_chat_llama
from areal_kernel.testing.recovery import kill_after_checkpoint, load_weights, read_samples, run_train

pytestmark = pytest.mark.slow
HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(HERE), "examples", "grpo_arithmetic_megatron.yaml")
STEPS = 3


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory):
    return make_tiny_chat_llama(tmp_path_factory.mktemp("tiny-megatron-recovery"))


def _args(model, run_dir):
    return [
        "train", EXAMPLE, f"model.path={model}", f"run_dir={run_dir}", "actor.backend=megatron:t2",
        f"trainer.max_steps={STEPS}", "trainer.batch_size=2", "trainer.eval_size=0",
        "rollout.gconfig.n_samples=4", "rollout.gconfig.max_new_tokens=6", "rollout.max_staleness=0",
        "algorithm.dynamic_filter=false", "algorithm.entropy_coef=0.05", "actor.megatron.lr=1e-3",
        "checkpoint.save_every=1", "logging.sinks=[jsonl]",
    ]  # fmt: skip


def test_killed_megatron_t2_run_resumes_exactly(tiny_chat_model, tmp_path):
    import torch

    ref_dir, run_dir = str(tmp_path / "reference"), str(tmp_path / "killed")
    ref = run_train(_args(tiny_chat_model, ref_dir))
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    kill_after_checkpoint(_args(tiny_chat_model, run_dir), run_dir, step=1)
    resumed = run_train(_args(tiny_chat_model, run_dir))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert json.load(open(os.path.join(run_dir, "result.json")))["resumed_from_step"] == 1
    got, want = read_samples(run_dir), read_samples(ref_dir)
    assert [s["step"] for s in got] == list(range(1, STEPS + 1))
    assert [s["uids"] for s in got] == [s["uids"] for s in want]
    a = load_weights(os.path.join(ref_dir, "checkpoints", "final"))
    b = load_weights(os.path.join(run_dir, "checkpoints", "final"))
    base = load_weights(tiny_chat_model)
    assert max(float((a[k] - base[k]).abs().max()) for k in a if k in base) > 1e-4  # training moved them
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=f"weight {k} differs after resume")
