"""HF <-> Megatron conversion: a bit-exact round trip through every tensor-
and pipeline-parallel split, for Llama, Qwen2 and Qwen3 (tiny random models
from their real configs)."""

from __future__ import annotations

import json
import os

import pytest
from megatron_helpers import make_tiny_qwen

from areal_kernel.errors import ConfigError
from areal_megatron.convert import (
    arch_from_hf_config,
    check_layout,
    hf_to_megatron,
    megatron_names,
    megatron_to_hf,
)


def _load(d: str):
    from safetensors.torch import load_file

    cfg = json.load(open(os.path.join(d, "config.json")))
    return cfg, load_file(os.path.join(d, "model.safetensors"))


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def model(request, tiny_llama_dir, tmp_path_factory):
    if request.param == "llama":
        return _load(tiny_llama_dir)
    return _load(make_tiny_qwen(str(tmp_path_factory.mktemp(request.param)), request.param))


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4)])
def test_round_trip_is_bit_exact(model, tp, pp):
    import torch

    cfg, hf = model
    arch = arch_from_hf_config(cfg)
    check_layout(arch, tp, pp)
    per_stage = arch.layers // pp
    back: dict[str, torch.Tensor] = {}
    for stage in range(pp):
        names = megatron_names(arch, per_stage, stage == 0, stage == pp - 1)
        for n in names:
            shards = [hf_to_megatron(n, hf.__getitem__, arch, r, tp, stage * per_stage) for r in range(tp)]
            if tp > 1 and "layernorm" not in n:
                # Really split: each shard holds 1/tp of the whole (unsplit) tensor.
                whole = hf_to_megatron(n, hf.__getitem__, arch, 0, 1, stage * per_stage)
                assert all(s.numel() * tp == whole.numel() and s.shape != whole.shape for s in shards), n
            for name, t in megatron_to_hf(n, shards, arch, stage * per_stage):
                assert name not in back, name
                back[name] = t
    expected = {k: v for k, v in hf.items() if not (arch.tied and k == "lm_head.weight")}
    assert sorted(back) == sorted(expected)
    for k, v in expected.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_fused_layouts_are_megatrons(model):
    """The fused qkv rows are grouped per KV head ([q..., k, v] per group) and
    fc1 is [gate; up] per tensor-parallel rank: checked on rank 1 of 2."""
    import torch

    cfg, hf = model
    arch = arch_from_hf_config(cfg)
    d, qg = arch.head_dim, arch.q_per_group
    qkv = hf_to_megatron("decoder.layers.0.self_attention.linear_qkv.weight", hf.__getitem__, arch, 1, 2)
    group = 1  # rank 1 of 2 holds KV group 1 (of 2)
    q = hf["model.layers.0.self_attn.q_proj.weight"][group * qg * d : (group + 1) * qg * d]
    k = hf["model.layers.0.self_attn.k_proj.weight"][group * d : (group + 1) * d]
    assert torch.equal(qkv[: qg * d], q) and torch.equal(qkv[qg * d : qg * d + d], k)
    fc1 = hf_to_megatron("decoder.layers.0.mlp.linear_fc1.weight", hf.__getitem__, arch, 1, 2)
    half = arch.ffn // 2
    assert torch.equal(fc1[:half], hf["model.layers.0.mlp.gate_proj.weight"][half:])
    assert torch.equal(fc1[half:], hf["model.layers.0.mlp.up_proj.weight"][half:])


def test_unsupported_architecture_and_split_are_named():
    with pytest.raises(ConfigError, match="model_type 'gpt2'.*supported: llama, qwen2, qwen3"):
        arch_from_hf_config({"model_type": "gpt2"})
    smollm2_135m = {
        "model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
        "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
    }  # fmt: skip
    arch = arch_from_hf_config(smollm2_135m)
    check_layout(arch, 1, 2)  # 30 layers split in 2 stages
    with pytest.raises(ConfigError, match="num_attention_heads=9 is not divisible by t=2"):
        check_layout(arch, 2, 1)
