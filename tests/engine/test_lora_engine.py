"""LoRA in the built-in torch engine: what trains, what travels, what is saved."""

from __future__ import annotations

import json
import os

import pytest
import torch
from engine_helpers import make_batch
from test_torch_engine import LENGTHS, MULTIPLE, advantages_for, make_engine, max_abs_diff, ppo_like_loss
from transformers import AutoModelForCausalLM

from areal_kernel.api.engine import WeightUpdateMeta
from areal_kernel.engine.config import TorchEngineConfig
from areal_kernel.testing.noise import assert_within_noise, measure_noise_floor
from areal_kernel.errors import ConfigError

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "up_proj"]}


def hf_logprobs(model, batch) -> list[list[float]]:
    out = []
    model.eval()
    for t in batch.trajectories:
        with torch.no_grad():
            logp = model(torch.tensor([t.input_ids])).logits[0].float().log_softmax(-1)
        out.append([0.0] + [logp[i - 1, t.input_ids[i]].item() for i in range(1, len(t.input_ids))])
    return out


def trained_engine(model_dir: str, steps: int = 2, **cfg):
    cfg.setdefault("lora", LORA)
    e = make_engine(model_dir, total_steps=4, lr=1e-2, **cfg)
    for s in range(steps):
        b = make_batch(LENGTHS, seed=10 + s)
        e.train_batch(b, ppo_like_loss, advantages_for(b))
    return e


def test_only_the_adapter_trains_and_travels(tiny_model_dir):
    batch = make_batch(LENGTHS, seed=3)
    base = make_engine(tiny_model_dir)
    e = make_engine(tiny_model_dir, total_steps=4, lr=1e-2, lora=LORA)
    # peft starts B at zero: the adapted model scores exactly like the base
    # (the adapter adds an exact 0.0 to each target's output).
    assert max_abs_diff(e.compute_logprobs(batch), base.compute_logprobs(batch)) == 0.0
    before = {n: p.detach().clone() for n, p in e.model.named_parameters()}
    n_opt = sum(len(g["params"]) for g in e.optimizer.param_groups)
    # 2 layers x 3 targets x (A, B)
    assert n_opt == 2 * 3 * 2
    e.train_batch(batch, ppo_like_loss, advantages_for(batch))
    changed = {n for n, p in e.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(".lora_" in n for n in changed)
    assert any(".lora_B." in n for n in changed)
    assert max_abs_diff(e.compute_logprobs(batch), base.compute_logprobs(batch)) > 1e-4

    named = e.named_weights_for_transfer()
    assert len(named) == 12
    assert all(n.startswith("base_model.model.model.layers.") and n.endswith((".lora_A.weight", ".lora_B.weight"))
               for n, _ in named)  # fmt: skip
    spec = e.adapter_spec()
    assert spec is not None and spec.name == "policy"
    assert spec.config["r"] == 4 and spec.config["lora_alpha"] == 8.0
    assert sorted(spec.config["target_modules"]) == ["q_proj", "up_proj", "v_proj"]
    json.dumps(spec.config)  # JSON-able: it travels in request bodies
    assert base.adapter_spec() is None


def test_adapter_and_merged_exports_load_with_stock_tools(tiny_model_dir, tmp_path):
    from peft import PeftModel

    batch = make_batch(LENGTHS, seed=4)
    e = trained_engine(tiny_model_dir)
    want = e.compute_logprobs(batch)

    e.save_hf(str(tmp_path / "adapter"))
    files = set(os.listdir(tmp_path / "adapter"))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files and "config.json" not in files
    def peft(attn: str):
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=attn)
        return PeftModel.from_pretrained(base, tmp_path / "adapter")

    got = hf_logprobs(peft("sdpa"), batch)
    # Floor (areal_kernel.testing.noise): the same HF model with its other attention kernel.
    floor = measure_noise_floor("logprobs, same weights", got, hf_logprobs(peft("eager"), batch))
    print(assert_within_noise(got, want, floor, MULTIPLE, what="adapter export vs engine"))

    e.config = e.config.model_copy(update={"lora": e.config.lora.model_copy(update={"export": "merged"})})
    e.save_hf(str(tmp_path / "merged"))
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    print(assert_within_noise(hf_logprobs(merged, batch), want, floor, MULTIPLE, what="merged export vs engine"))
    # The live model was not merged in place: it still scores the same.
    assert max_abs_diff(e.compute_logprobs(batch), want) == 0.0

    # A disk weight update ships the adapter alone.
    e.send_weights(WeightUpdateMeta(kind="disk", version=1, path=str(tmp_path / "upd")))
    assert set(os.listdir(tmp_path / "upd")) == {"adapter_config.json", "adapter_model.safetensors"}
    full = os.path.getsize(tmp_path / "merged" / "model.safetensors")
    assert os.path.getsize(tmp_path / "upd" / "adapter_model.safetensors") < full / 5


def test_lora_recovery_is_exact(tiny_model_dir, tmp_path):
    # Dropout on the adapter input draws from the RNG: recovery must restore it too.
    cfg = dict(lora={**LORA, "dropout": 0.2}, lr_scheduler="cosine", max_tokens_per_mb=40)
    a = trained_engine(tiny_model_dir, steps=1, **cfg)
    a.save_state(str(tmp_path / "ckpt"))
    b2 = make_batch(LENGTHS, seed=20)
    a.train_batch(b2, ppo_like_loss, advantages_for(b2))

    from safetensors import safe_open

    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and all(".lora_" in k for k in keys)  # the frozen base is not copied

    b = make_engine(tiny_model_dir, total_steps=4, lr=1e-2, **cfg)
    b.load_state(str(tmp_path / "ckpt"))
    b.train_batch(b2, ppo_like_loss, advantages_for(b2))
    wa = dict(a.named_weights_for_transfer())
    wb = dict(b.named_weights_for_transfer())
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) == 0.0

    c = trained_engine(tiny_model_dir, steps=0, **cfg)  # control: no restore
    c.train_batch(b2, ppo_like_loss, advantages_for(b2))
    wc = dict(c.named_weights_for_transfer())
    assert max((wa[k] - wc[k]).abs().max().item() for k in wa) > 1e-4


def test_bad_lora_settings_name_the_field(tiny_model_dir):
    with pytest.raises(ConfigError, match=r"lora\.rank"):
        TorchEngineConfig.parse({"lora": {"rank": 0}})
    with pytest.raises(ConfigError, match=r"lora\.name"):
        TorchEngineConfig.parse({"lora": {"name": "has space"}})
    with pytest.raises(ConfigError, match=r"actor\.torch\.lora\.target_modules: .*'qq_proj'"):
        make_engine(tiny_model_dir, lora={"target_modules": ["qq_proj"]})
    with pytest.raises(ConfigError, match=r"not a linear layer"):
        make_engine(tiny_model_dir, lora={"target_modules": ["self_attn"]})
