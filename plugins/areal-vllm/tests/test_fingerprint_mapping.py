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

import pytest
import torch

from areal_kernel.errors import ServerError
from areal_kernel.monitor.weights import compare, plan, sample_named
from areal_vllm.fingerprint import hf_views, worker_adapter_fingerprints, worker_fingerprint

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

        def named_modules(self):
            return iter(())  # no MoE layer whose experts a CPU kernel keeps packed

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


# -- LoRA adapters ---------------------------------------------------------------------


class _Layer:
    """Shaped like vLLM's ``LoRALayerWeights`` after registration: one
    module's lora_a / lora_b, lora_b already multiplied by alpha / rank."""

    def __init__(self, a, b, alpha, rank):
        self.lora_a, self.lora_b, self.lora_alpha, self.rank = a, b * (alpha / rank), alpha, rank


class _Packed:
    """Shaped like vLLM's ``PackedLoRALayerWeights``: the fused module's
    members as lists, each lora_b multiplied by its own alpha / rank."""

    def __init__(self, members, alpha, rank):
        self.lora_a = [a for a, _ in members]
        self.lora_b = [b * (alpha / rank) for _, b in members]
        self.lora_alphas, self.rank = [alpha] * len(members), rank


class _Manager:
    """Shaped like the worker's LoRA manager: ``_adapter_manager`` lists the
    registered adapters (``LoRAModel``: ``.loras`` by module) by integer id."""

    def __init__(self, adapters):
        class Inner:
            def list_adapters(self_inner):
                return dict(adapters)

            def get_adapter(self_inner, i):
                return adapters[i]

        self._adapter_manager = Inner()


def _peft_adapter(seed: int, rank: int = 4):
    """peft file names and tensors of an adapter on q/k/v/o and gate/up/down
    of a 2-layer model (hidden 32, kv 16, intermediate 48)."""
    g = torch.Generator().manual_seed(seed)
    dims = {"self_attn.q_proj": (32, 32), "self_attn.k_proj": (32, 16), "self_attn.v_proj": (32, 16),
            "self_attn.o_proj": (32, 32), "mlp.gate_proj": (32, 48), "mlp.up_proj": (32, 48),
            "mlp.down_proj": (48, 32)}  # fmt: skip
    out = {}
    for layer in range(2):
        for mod, (i, o) in dims.items():
            stem = f"base_model.model.model.layers.{layer}.{mod}"
            out[f"{stem}.lora_A.weight"] = torch.randn(rank, i, generator=g)
            out[f"{stem}.lora_B.weight"] = torch.randn(o, rank, generator=g)
    return out


def _as_vllm(peft: dict[str, torch.Tensor], alpha: int = 8, rank: int = 4):
    class LoRAModel:
        loras: dict = {}

    model = LoRAModel()
    model.loras = {}
    for layer in range(2):
        stem = f"model.layers.{layer}"

        def ab(mod):
            return peft[f"base_model.model.{stem}.{mod}.lora_A.weight"], peft[
                f"base_model.model.{stem}.{mod}.lora_B.weight"
            ]

        model.loras[f"{stem}.self_attn.qkv_proj"] = _Packed(
            [ab(f"self_attn.{m}") for m in ("q_proj", "k_proj", "v_proj")], alpha, rank
        )
        model.loras[f"{stem}.mlp.gate_up_proj"] = _Packed(
            [ab(f"mlp.{m}") for m in ("gate_proj", "up_proj")], alpha, rank
        )
        for mod in ("self_attn.o_proj", "mlp.down_proj"):
            model.loras[f"{stem}.{mod}"] = _Layer(*ab(mod), alpha, rank)
    return model


def test_adapter_tensors_map_onto_vllms_packed_lora_layout_with_their_scale():
    """Without a server: peft names read as vLLM's packed LoRA entries, lora_B
    compared through the scale the reply gives, each adapter id answered; the
    protocol picks the k-th listed adapter name as the k-th smallest id (the
    real server: test_vllm_server.py::test_weight_delivery_check_reads_lora_
    adapters_and_names_a_dropped_update)."""
    from areal_vllm.protocol import _adapter_names, _pick_adapter

    a, b = _peft_adapter(1), _peft_adapter(2)
    numels = {n: t.numel() for n, t in a.items()}
    spec = plan(list(numels.items()), 5, len(a), 8, adapter="task-a")
    sent = sample_named(a.items(), spec.positions)
    out = worker_adapter_fingerprints(_Manager({3: _as_vllm(a), 7: _as_vllm(b)}), json.dumps(spec.to_json()))
    assert set(out["adapters"]) == {"3", "7"}
    scales = {n: r.get("scale") for n, r in out["adapters"]["3"]["tensors"].items()}
    assert {s for n, s in scales.items() if ".lora_B." in n} == {2.0}
    assert {s for n, s in scales.items() if ".lora_A." in n} == {None}
    checked, bad = compare(sent, numels, spec, "srv", out["adapters"]["3"])
    assert checked == len(a) and bad == [], bad
    # The other adapter differs in every tensor.
    assert len(compare(sent, numels, spec, "srv", out["adapters"]["7"])[1]) == len(a)

    raw = json.dumps({"results": [out]}).encode()
    models = json.dumps({"data": [{"id": "base", "parent": None}, {"id": "task-a", "parent": "base"},
                                  {"id": "task-b", "parent": "base"}]}).encode()  # fmt: skip
    acc: dict = {}
    _adapter_names(acc, models)
    assert compare(sent, numels, spec, "srv", _pick_adapter(acc, "task-a", raw)) == (len(a), [])
    acc = {}
    _adapter_names(acc, models)
    assert len(compare(sent, numels, spec, "srv", _pick_adapter(acc, "task-b", raw))[1]) == len(a)
    # A name the server does not list: every sampled tensor is absent.
    acc = {}
    _adapter_names(acc, models)
    _, bad = compare(sent, numels, spec, "srv", _pick_adapter(acc, "task-c", raw))
    assert len(bad) == len(a) and all("no tensor" in m.detail for m in bad)
    # Listed names and held adapters differ in number: no guess, the server "did not answer".
    acc = {}
    _adapter_names(acc, json.dumps({"data": [{"id": "task-a", "parent": "base"}]}).encode())
    with pytest.raises(ServerError, match="lists 1 adapter"):
        _pick_adapter(acc, "task-a", raw)


def test_fused_expert_tensors_map_to_vllms_moe_parameters_when_their_layout_is_kept():
    """transformers' fused expert tensors of a real tiny Qwen3-MoE
    (``experts.gate_up_proj`` (E, 2I, H), ``experts.down_proj`` (E, H, I))
    are read from vLLM's ``routed_experts.w13_weight`` / ``w2_weight`` (same
    layout); packed by a CPU kernel, or of another shape (an intermediate
    size padded by the kernel), they are unreadable rather than compared."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = {n: p.detach().clone() for n, p in Qwen3MoeForCausalLM(cfg).named_parameters()}
    experts = [n for n in hf if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(experts) == 4 and hf[experts[0]].dim() == 3, experts
    rename = {
        "experts.gate_up_proj": "experts.routed_experts.w13_weight",
        "experts.down_proj": "experts.routed_experts.w2_weight",
    }
    params = {}
    for n, t in hf.items():
        hit = next((k for k in rename if n.endswith(k)), None)
        params[n[: -len(hit)] + rename[hit] if hit else n] = t.clone()
    table, unreadable = hf_views(params, cfg, experts, tied=False)
    assert unreadable == [] and set(table) == set(experts)
    assert all(torch.equal(table[n], hf[n]) for n in experts)
    w13 = "model.layers.0.mlp.experts.routed_experts.w13_weight"
    table, unreadable = hf_views(params, cfg, experts, tied=False, packed=frozenset({w13}))
    assert unreadable == ["model.layers.0.mlp.experts.gate_up_proj"] and len(table) == 3
    params[w13] = torch.zeros(4, 2 * 32, 32)  # the intermediate size padded to 32
    _, unreadable = hf_views(params, cfg, experts, tied=False)
    assert unreadable == ["model.layers.0.mlp.experts.gate_up_proj"]
