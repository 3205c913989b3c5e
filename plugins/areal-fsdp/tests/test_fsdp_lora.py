"""LoRA on 2 real FSDP2 ranks (gloo) against the kernel's single-process torch
engine with the same adapter: same adapter init, same steps, same exports;
a DCP checkpoint holds only the adapter and resumes identically."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_kernel.algo.losses import make_ppo_loss_fn
from areal_kernel.api.engine import WeightUpdateMeta
from areal_kernel.testing.noise import assert_within_noise, measure_noise_floor
from areal_kernel.testing.rank_engines import ppo_step_inputs, random_batch, torch_references

pytestmark = pytest.mark.slow

CFG = {
    "lr": 1e-2,
    "max_tokens_per_mb": 20,
    "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]},
}
LOSS = make_ppo_loss_fn(eps_clip=0.2, behav_imp_weight_cap=5.0)
# Two ranks sum the same numbers in another order: float noise, far below
# what a lost micro-batch or a wrong reduction changes (> 1e-3 here). Adam at
# lr 1e-2 turns that noise into 1e-4-sized weight differences, so the bound is
# a floor measured in the same run (areal_kernel.testing.noise): the torch
# engine with another micro-batch split for training, the HF model with another
# attention kernel for the exports. Measured 0.3-0.6x the floor (AVX-512) and
# 0.6-0.8x (ATEN_CPU_CAPABILITY=avx2): 4x leaves about 5x headroom.
NOISE_CFG = {**CFG, "max_tokens_per_mb": 13}
MULTIPLE = 4.0


def _diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def lora_pair(tiny_model_dir):
    from areal_fsdp.engine import FSDPTrainEngine

    fsdp = FSDPTrainEngine(CFG, world_size=2)
    fsdp.initialize(tiny_model_dir, 10)
    ref, noise = torch_references(CFG, NOISE_CFG, tiny_model_dir, 10)
    init = (dict(fsdp.full_weights()), {n: t.clone() for n, t in ref.named_weights_for_transfer()})
    try:
        for seed, lengths in enumerate([[7, 9, 5, 12], [11, 6, 8, 10]]):
            batch = random_batch(lengths, seed=seed)
            for e in (fsdp, ref, noise):
                e.train_batch(batch, LOSS, ppo_step_inputs(batch, e))
        yield fsdp, ref, init, noise
    finally:
        fsdp.destroy()


def test_fsdp_lora_trains_the_adapter_like_one_process(lora_pair):
    fsdp, ref, (init_fsdp, init_ref), noise = lora_pair
    assert _diff(init_fsdp, init_ref) == 0.0  # same seed, same peft init
    assert fsdp.adapter_spec() == ref.adapter_spec()
    names = [n for n, _ in fsdp.named_weights_for_transfer()]
    assert names == [n for n, _ in ref.named_weights_for_transfer()] and len(names) == 2 * 3 * 2
    now = dict(fsdp.full_weights())
    want = dict(ref.named_weights_for_transfer())
    floor = measure_noise_floor("adapter weights", want, dict(noise.named_weights_for_transfer()))
    print(assert_within_noise(now, want, floor, MULTIPLE))
    assert _diff(now, init_fsdp) > 1e-3  # it did train
    probe = random_batch([10, 7, 12], seed=99)
    want_lp = ref.compute_logprobs(probe)
    floor = measure_noise_floor("logprobs", want_lp, noise.compute_logprobs(probe))
    print(assert_within_noise(fsdp.compute_logprobs(probe), want_lp, floor, MULTIPLE))


def test_fsdp_lora_exports_and_disk_update(lora_pair, tmp_path, tiny_model_dir):
    fsdp, ref, _, _ = lora_pair
    probe = random_batch([10, 7, 12], seed=5)
    want = ref.compute_logprobs(probe)

    fsdp.send_weights(WeightUpdateMeta(kind="disk", version=1, path=str(tmp_path / "upd")))
    assert sorted(os.listdir(tmp_path / "upd")) == ["adapter_config.json", "adapter_model.safetensors"]
    with open(tmp_path / "upd" / "adapter_config.json") as f:
        assert json.load(f)["r"] == 4

    fsdp.save_hf(str(tmp_path / "adapter"))
    from peft import PeftModel

    def peft(attn: str):
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=attn)
        return PeftModel.from_pretrained(base, tmp_path / "adapter")

    hf_lp = _hf_logprobs(peft("sdpa"), probe)
    # The floor: the same HF model with its other attention kernel.
    floor = measure_noise_floor("logprobs, same weights", hf_lp, _hf_logprobs(peft("eager"), probe))
    print(assert_within_noise(hf_lp, want, floor, MULTIPLE, what="adapter export vs engine"))

    fsdp.config = fsdp.config.model_copy(update={"lora": fsdp.config.lora.model_copy(update={"export": "merged"})})
    fsdp.save_hf(str(tmp_path / "merged"), max_shard_bytes=64 << 10)  # several files: the bounded path
    assert os.path.isfile(tmp_path / "merged" / "model.safetensors.index.json")
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    print(assert_within_noise(_hf_logprobs(merged, probe), want, floor, MULTIPLE, what="merged export vs engine"))


def _hf_logprobs(model, batch):
    model.eval()
    out = []
    for t in batch.trajectories:
        with torch.no_grad():
            logp = model(torch.tensor([t.input_ids])).logits[0].log_softmax(-1)
        out.append([0.0] + [logp[i - 1, t.input_ids[i]].item() for i in range(1, len(t.input_ids))])
    return out


def test_fsdp_lora_checkpoint_holds_the_adapter_and_resumes(lora_pair, tmp_path):
    fsdp = lora_pair[0]
    ckpt = str(tmp_path / "state")
    fsdp.save_state(ckpt)
    from torch.distributed.checkpoint import FileSystemReader

    keys = list(FileSystemReader(os.path.join(ckpt, "dcp")).read_metadata().state_dict_metadata)
    model_keys = [k for k in keys if k.startswith("model.")]
    # The adapter and its moments, not the frozen base.
    assert len(model_keys) == 12 and all(".lora_" in k for k in model_keys), [
        k for k in model_keys if ".lora_" not in k
    ]
    assert any(k.startswith("optim.state.") and k.endswith(".exp_avg") for k in keys)

    def two_steps():
        for seed in (20, 21):
            batch = random_batch([8, 11, 6, 9], seed=seed)
            fsdp.train_batch(batch, LOSS, ppo_step_inputs(batch, fsdp))
        return dict(fsdp.full_weights())

    first = two_steps()
    fsdp.load_state(ckpt)
    second = two_steps()
    assert _diff(first, second) == 0.0
