"""The weight-delivery check's server side for vLLM (``monitor.weights``).

Runs inside a vLLM worker process (``AReaLWorkerExtension.
areal_weight_fingerprint``, reached through ``POST /collective_rpc``). The
trainer names tensors as Hugging Face checkpoints do; vLLM holds some of them
fused, so each name is mapped to a view of the parameter vLLM loaded it into:

- ``q_proj`` / ``k_proj`` / ``v_proj`` are row blocks of ``qkv_proj``, and
  ``gate_proj`` / ``up_proj`` of ``gate_up_proj`` (the model class's
  ``packed_modules_mapping``), sized from the model's Hugging Face config;
- transformers' fused expert tensors (``experts.gate_up_proj``,
  ``experts.down_proj``) are vLLM's ``w13_weight`` / ``w2_weight``, same
  layout where vLLM keeps it (accelerators; the shapes are checked); on
  CPU the MoE kernel holds them packed in its own blocked layout, so they
  are unreadable there;
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

LoRA adapters (``worker_adapter_fingerprints``) are read from the CPU copy
vLLM's LoRA manager keeps of each loaded adapter (the ``LoRAModel``: one
``lora_a`` / ``lora_b`` per module, q/k/v and gate/up packed as lists in the
fused module's entry). vLLM folds the adapter's scaling into ``lora_b`` in
place when it registers the adapter (``LoRALayerWeights.optimize``); the
reply gives that factor (``"scale"``) and the trainer multiplies its own
values by it before comparing, so the comparison stays exact. A worker does
not know adapter names, only vLLM's integer ids: it answers for every
adapter it holds and the protocol picks one (``protocol._pick_adapter``).

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


# transformers' fused expert tensors of a mixture-of-experts layer (one
# parameter per layer, experts leading: ``gate_up_proj`` (E, 2I, H) with the
# gate rows before the up rows, ``down_proj`` (E, H, I)) -> the parameter
# vLLM's fused MoE layer loads them into, which has the same layout (under
# the layer's ``routed_experts`` module in vllm 0.32, directly in older ones).
FUSED_EXPERTS: dict[str, tuple[str, ...]] = {
    "experts.gate_up_proj": ("experts.routed_experts.w13_weight", "experts.w13_weight"),
    "experts.down_proj": ("experts.routed_experts.w2_weight", "experts.w2_weight"),
}


def expert_shapes(hf_config: Any) -> dict[str, tuple[int, ...]]:
    """The shapes of the fused expert tensors (empty for a dense model)."""
    experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
    inter = getattr(hf_config, "moe_intermediate_size", None)
    if not experts or not inter:
        return {}
    e, i, h = int(experts), int(inter), int(hf_config.hidden_size)
    return {"experts.gate_up_proj": (e, 2 * i, h), "experts.down_proj": (e, h, i)}


def cpu_prepacked_experts(module: Any) -> Any:
    """The CPU experts kernel of a fused-MoE layer whose weights it keeps
    prepacked (the object whose ``process_weights_after_loading`` packs
    them), or None (another layer, another kernel, or an accelerator)."""
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is None or getattr(experts, "isa", None) is None or not hasattr(module, "w13_weight"):
        return None
    # CPUUnquantizedExperts and its x86/Arm/Power subclasses carry the ISA they pack for.
    return experts if type(experts).__name__.endswith("CPUUnquantizedExperts") else None


def block_rows(hf_config: Any) -> dict[str, list[int]]:
    """Rows of each block of the fused modules, from a decoder's HF config."""
    heads = int(hf_config.num_attention_heads)
    head_dim = getattr(hf_config, "head_dim", None) or int(hf_config.hidden_size) // heads
    kv = int(getattr(hf_config, "num_key_value_heads", None) or heads) * int(head_dim)
    q = heads * int(head_dim)
    inter = int(hf_config.intermediate_size)
    return {"qkv_proj": [q, kv, kv], "gate_up_proj": [inter, inter]}


def hf_views(
    params: Mapping[str, "torch.Tensor"],
    hf_config: Any,
    names: Iterable[str],
    tied: bool,
    packed: frozenset[str] = frozenset(),
) -> tuple[dict[str, "torch.Tensor"], list[str]]:
    """(``{hf name: view of the loaded values}``, names whose parameter
    exists but holds no readable values: emptied, or in ``packed``, the
    vLLM parameters a kernel keeps in its own layout). A name found in
    neither is left out (the reply lists it as missing)."""
    rows = block_rows(hf_config)
    experts = expert_shapes(hf_config)
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
        fused = next((k for k in FUSED_EXPERTS if name.endswith("." + k)), None)
        if t.numel() == 0 or target in packed or (fused is not None and tuple(t.shape) != experts.get(fused)):
            # Freed by a CPU repack, or (experts) padded or re-laid out by the
            # MoE kernel: the trainer's positions would not index it.
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
    for hf, candidates in FUSED_EXPERTS.items():
        if name.endswith("." + hf):
            stem = name[: -len(hf)]
            return next(((stem + c, 0, None) for c in candidates if stem + c in params), (None, 0, None))
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in PACKED:
            fused, idx = PACKED[part]
            target = ".".join([*parts[:i], fused, *parts[i + 1 :]])
            if target in params:
                sizes = rows[fused]
                return target, sum(sizes[:idx]), sizes[idx]
    return None, 0, None


def _adapter_tensor(lora_model: Any, name: str) -> tuple["torch.Tensor | None", float]:
    """(the tensor vLLM holds for the peft file name ``name`` of an adapter,
    the factor it was multiplied by) or (None, 1.0) when the adapter has none.
    peft names look like ``base_model.model.<module>.lora_A.weight``."""
    stem = name.removeprefix("base_model.model.")
    for kind in ("lora_A", "lora_B"):
        suffix = f".{kind}.weight"
        if stem.endswith(suffix):
            module = stem[: -len(suffix)]
            break
    else:
        return None, 1.0
    loras = getattr(lora_model, "loras", {})
    layer, idx = loras.get(module), None
    if layer is None:
        parent, _, leaf = module.rpartition(".")
        if leaf in PACKED:
            fused, idx = PACKED[leaf]
            layer = loras.get(f"{parent}.{fused}" if parent else fused)
    if layer is None:
        return None, 1.0
    if idx is None:
        a, b, alpha = layer.lora_a, layer.lora_b, layer.lora_alpha
    else:
        a, b, alpha = layer.lora_a[idx], layer.lora_b[idx], layer.lora_alphas[idx]
    if kind == "lora_A":
        return a, 1.0
    # ``optimize`` multiplied lora_b by alpha / rank (and set scaling to 1).
    return b, (float(alpha) / float(layer.rank) if b is not None else 1.0)


def worker_adapter_fingerprints(lora_manager: Any, spec_json: str) -> dict[str, Any]:
    """``{"adapters": {str(vLLM adapter id): fingerprint reply}}`` over every
    adapter this worker holds, for the adapter tensors named in
    ``spec_json``; each tensor's reply carries ``"scale"`` when vLLM holds it
    multiplied by a factor (``compare`` in ``areal_kernel.monitor.weights``)."""
    import json

    from areal_kernel.monitor.weights import FingerprintSpec, fingerprint

    spec = FingerprintSpec.from_json(json.loads(spec_json))
    if lora_manager is None:
        raise ValueError("this vLLM server runs without LoRA (--enable-lora): it holds no adapter")
    # The worker's LoRA manager keeps the loaded adapters in its model
    # manager; vLLM exposes no public accessor for a loaded adapter's tensors.
    manager = lora_manager._adapter_manager
    out: dict[str, Any] = {}
    for adapter_id in sorted(manager.list_adapters()):
        lora_model = manager.get_adapter(adapter_id)
        table: dict[str, Any] = {}
        scales: dict[str, float] = {}
        for name in spec.positions:
            t, scale = _adapter_tensor(lora_model, name)
            if t is not None:
                table[name] = t
                if scale != 1.0:
                    scales[name] = scale
        reply = fingerprint(table, spec, None)
        for name, scale in scales.items():
            if name in reply["tensors"]:
                reply["tensors"][name]["scale"] = scale
        out[str(adapter_id)] = reply
    return {"adapters": out}


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
    packed = frozenset(
        f"{name}.{w}"
        for name, module in model.named_modules()
        if cpu_prepacked_experts(module) is not None
        for w in ("w13_weight", "w2_weight")
    )
    table, unreadable = hf_views(params, hf_config, spec.positions, tied, packed)
    skip = set(unreadable)
    reply = fingerprint(table, spec, None)
    reply["missing"] = [n for n in reply["missing"] if n not in skip]
    reply["unreadable"] = unreadable
    return reply
