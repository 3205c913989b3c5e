"""The weight-delivery check's server side for vLLM (``monitor.weights``).

Runs inside a vLLM worker process (``AReaLWorkerExtension.
areal_weight_fingerprint``, reached through ``POST /collective_rpc``). The
trainer names tensors as Hugging Face checkpoints do; vLLM holds some of them
fused, so each name is mapped to a view of the parameter vLLM loaded it into:

- ``q_proj`` / ``k_proj`` / ``v_proj`` are row blocks of ``qkv_proj``, and
  ``gate_proj`` / ``up_proj`` of ``gate_up_proj`` (the model class's
  ``packed_modules_mapping``), sized from the model's Hugging Face config;
- a tied ``lm_head.weight`` is the embedding; an embedding padded to a
  multiple of the tensor-parallel granularity is read over its real rows;
- with LoRA enabled, a layer's loaded weights sit under ``base_layer``.

Rows are the leading dimension in both layouts, so a block of rows is a
contiguous view and the trainer's flat positions index it unchanged.

What cannot be read is reported, not guessed: on CPU vLLM repacks every
linear layer's weight for its GEMM kernels and frees the plain tensor
(``UnquantizedLinearMethod.process_weights_after_loading`` with
``remove_weight=True``), so those parameters are empty there. Such names go
to ``"unreadable"`` in the reply; the trainer then checks the tensors that
remain readable (norms, embeddings; every tensor on accelerators, where the
plain weights stay). Only tensor-parallel size 1 is covered (a shard holds
a slice of each tensor); the protocol refuses more.

torch is imported by the caller's process only (this module does not import vLLM)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Mapping

if TYPE_CHECKING:
    import torch

# Hugging Face module name -> (the fused vLLM module, the block's index in it).
PACKED: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def block_rows(hf_config: Any) -> dict[str, list[int]]:
    """Rows of each block of the fused modules, from a decoder's HF config."""
    heads = int(hf_config.num_attention_heads)
    head_dim = getattr(hf_config, "head_dim", None) or int(hf_config.hidden_size) // heads
    kv = int(getattr(hf_config, "num_key_value_heads", None) or heads) * int(head_dim)
    q = heads * int(head_dim)
    inter = int(hf_config.intermediate_size)
    return {"qkv_proj": [q, kv, kv], "gate_up_proj": [inter, inter]}


def hf_views(
    params: Mapping[str, "torch.Tensor"], hf_config: Any, names: Iterable[str], tied: bool
) -> tuple[dict[str, "torch.Tensor"], list[str]]:
    """(``{hf name: view of the loaded values}``, names whose parameter
    exists but holds no readable values). A name found in neither is left out
    (the reply lists it as missing)."""
    rows = block_rows(hf_config)
    vocab = int(getattr(hf_config, "vocab_size", 0) or 0)
    # With LoRA enabled, vLLM wraps each adapted layer and the embedding; the
    # loaded weights are the wrapped layer's (``<module>.base_layer.weight``).
    params = {n.replace(".base_layer.", "."): t for n, t in params.items()}
    table: dict[str, "torch.Tensor"] = {}
    unreadable: list[str] = []
    for name in names:
        target, start, count = _locate(params, name, rows, tied)
        if target is None:
            continue
        t = params[target]
        if t.numel() == 0:
            unreadable.append(name)
            continue
        if count is None and vocab and t.dim() == 2 and t.shape[0] > vocab and _is_vocab_table(name):
            start, count = 0, vocab  # padded rows are vLLM's, not the checkpoint's
        table[name] = t if count is None else t.narrow(0, start, count)
    return table, unreadable


def _is_vocab_table(name: str) -> bool:
    return name.endswith(("embed_tokens.weight", "lm_head.weight"))


def _locate(
    params: Mapping[str, "torch.Tensor"], name: str, rows: dict[str, list[int]], tied: bool
) -> tuple[str | None, int, int | None]:
    """(vLLM parameter name or None, first row, rows or None for all)."""
    if name in params:
        return name, 0, None
    if tied and name == "lm_head.weight":
        for cand in ("model.embed_tokens.weight", "embed_tokens.weight"):
            if cand in params:
                return cand, 0, None
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in PACKED:
            fused, idx = PACKED[part]
            target = ".".join([*parts[:i], fused, *parts[i + 1 :]])
            if target in params:
                sizes = rows[fused]
                return target, sum(sizes[:idx]), sizes[idx]
    return None, 0, None


def worker_fingerprint(model: Any, hf_config: Any, tied: bool, spec_json: str) -> dict[str, Any]:
    """The reply of one worker for the JSON ``spec_json``
    (``FingerprintSpec.to_json()``): ``areal_kernel.monitor.weights.fingerprint``
    over the views, plus ``"unreadable"``. The served version is not known to
    the worker (the API server labels versions): ``None``."""
    import json

    from areal_kernel.monitor.weights import FingerprintSpec, fingerprint

    spec = FingerprintSpec.from_json(json.loads(spec_json))
    if spec.adapter is not None:
        raise ValueError("the vLLM fingerprint reads base weights only (adapter tensors are not covered)")
    params = dict(model.named_parameters())
    table, unreadable = hf_views(params, hf_config, spec.positions, tied)
    skip = set(unreadable)
    reply = fingerprint(table, spec, None)
    reply["missing"] = [n for n in reply["missing"] if n not in skip]
    reply["unreadable"] = unreadable
    return reply
