"""The vLLM side of the weight-delivery check, without a server: Hugging Face
tensor names mapped onto the parameters vLLM fuses them into
(``areal_vllm.fingerprint``). The parameters are built from a real tiny
Llama (grouped-query attention, so q and k/v blocks differ in size) the way
vLLM's loader stacks them: q, k, v into ``qkv_proj`` and gate, up into
``gate_up_proj``, in that order, plus a padded embedding. The real vLLM server
(where CPU linear weights are repacked and unreadable) is
``test_vllm_server.py::test_weight_delivery_check_reads_what_the_server_loaded``."""

from __future__ import annotations

import json

import torch

from areal_kernel.monitor.weights import compare, plan, sample_named
from areal_vllm.fingerprint import hf_views, worker_fingerprint

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    hf = {n: p.detach().clone() for n, p in model.named_parameters() if n != "lm_head.weight"}
    hf["lm_head.weight"] = hf["model.embed_tokens.weight"]  # what a trainer of a tied model may send
    return cfg, hf


def _vllm_layout(hf: dict[str, torch.Tensor], pad_rows: int = 28) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        if name == "lm_head.weight":
            continue  # tied: vLLM holds one parameter
        part = next((p for p in name.split(".") if any(p in m for m in FUSED.values())), None)
        if part is None:
            out[name] = t.clone()
            continue
        fused = next(f for f, members in FUSED.items() if part in members)
        key = name.replace(part, fused)
        if key not in out:
            out[key] = torch.cat([hf[name.replace(part, m)] for m in FUSED[fused]], dim=0)
    emb = out["model.embed_tokens.weight"]
    out["model.embed_tokens.weight"] = torch.cat([emb, torch.zeros(pad_rows, emb.shape[1])])
    return out


def test_every_hf_tensor_maps_to_its_exact_values_in_the_fused_layout():
    cfg, hf = _tiny()
    params = _vllm_layout(hf)
    table, unreadable = hf_views(params, cfg, hf, tied=True)
    assert unreadable == [] and set(table) == set(hf)
    for name, t in hf.items():
        assert table[name].shape == t.shape and torch.equal(table[name], t), name
    # A wrong block order (k before q) would not pass: q and k differ in size here.
    assert (
        table["model.layers.0.self_attn.q_proj.weight"].shape[0]
        != table["model.layers.0.self_attn.k_proj.weight"].shape[0]
    )


def test_fingerprint_round_trip_clean_perturbed_and_repacked():
    cfg, hf = _tiny()
    numels = {n: t.numel() for n, t in hf.items()}
    spec = plan(list(numels.items()), 3, len(hf), 16)

    class Model:
        def __init__(self, params):
            self.params = params

        def named_parameters(self):
            return iter(self.params.items())

    def reply(params):
        return worker_fingerprint(Model(params), cfg, True, json.dumps(spec.to_json()))

    sent = sample_named(hf.items(), spec.positions)
    params = _vllm_layout(hf)
    checked, bad = compare(sent, numels, spec, "srv", reply(params))
    assert checked == len(hf) and bad == []
    # One element of the v block changed in the fused tensor: named as v_proj.
    name = "model.layers.1.self_attn.v_proj.weight"
    q_rows = 32
    kv_rows = 16
    pos = spec.positions[name][0]
    params["model.layers.1.self_attn.qkv_proj.weight"].view(-1)[(q_rows + kv_rows) * 32 + pos] += 1.0
    _, bad = compare(sent, numels, spec, "srv", reply(params))
    assert [m.tensor for m in bad] == [name]
    # Linear weights freed after repacking (vLLM on CPU): unreadable, not missing or mismatched.
    params = _vllm_layout(hf)
    for k in [k for k in params if k.endswith("proj.weight")]:
        params[k] = torch.empty(0)
    r = reply(params)
    assert set(r["unreadable"]) == {n for n in hf if n.endswith("proj.weight")} and r["missing"] == []
    checked, bad = compare(sent, numels, spec, "srv", r)
    assert bad == [] and checked == len(hf) - len(r["unreadable"])
    # With LoRA enabled vLLM wraps layers: their weights sit under base_layer.
    wrapped = {k.replace(".weight", ".base_layer.weight") if "proj" in k or "embed" in k else k: v
               for k, v in _vllm_layout(hf).items()}  # fmt: skip
    checked, bad = compare(sent, numels, spec, "srv", reply(wrapped))
    assert bad == [] and checked == len(hf)
    # A tensor vLLM does not have at all is missing.
    params = _vllm_layout(hf)
    del params["model.norm.weight"]
    assert reply(params)["missing"] == ["model.norm.weight"]
