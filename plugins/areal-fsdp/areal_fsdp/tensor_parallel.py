"""Tensor-parallel plans (DTensor ``parallelize_module``) per model family.

A decoder layer of the Llama family (Llama, Qwen2, Qwen3) is split the
Megatron way: the attention's q/k/v projections and the MLP's gate/up
projections column-wise (each tensor rank holds a slice of the heads and of
the intermediate features), the attention's o projection and the MLP's down
projection row-wise (their all-reduce gives every tensor rank the full
residual stream back). One all-reduce per attention and one per MLP in the
forward, as many in the backward.

The vocabulary (``apply_vocab_parallel``): the embedding and the LM head
are split by vocabulary rows, tensor rank ``r`` holding rows
``[r*V/t, (r+1)*V/t)`` of both (a tied matrix is split once and serves
both). The embedding looks up the tokens it owns, zeroes the others, and an
all-reduce sums the ranks' rows. The head gives each rank its slice of the
logits, which never exist whole on one rank: ``TensorRunner`` computes each
token's logprob and entropy with ``vocab_parallel_scores`` (the max per
token over the tensor group, then one sum of the exp-sums, the exp-weighted
logits and the target's logit from the rank that owns it; the backward
needs no collective). On a small model with a large vocabulary (SmolLM2's
49152 x 576 head) the head is the largest matmul of the step, which the
replicated head made every tensor rank compute in full.

When the vocabulary cannot split (``vocab_split_refusal``: a vocabulary
that does not divide by t, a LoRA adapter on the embedding or the head, a
head with a bias, scaled or soft-capped logits) both stay replicated and
the plain runner sees full logits, as before: a fallback, not padding,
because padding would change the shapes that exports, broadcasts and
checkpoints carry. The driver logs the reason.

Not split: the final norm and the layer norms stay replicated over the
tensor ranks. Qwen3's per-head q/k norms are replicated too, but
they act on the local heads only, so each tensor rank's gradient of their
weight is a partial sum over its heads: ``per_head_params`` names them and
the rank sums their gradients over the tensor group after the backward.

LoRA (``actor.fsdp.lora``, applied before the split): a planned projection
that carries a peft adapter is split through its ``base_layer``, and its
``lora_A`` / ``lora_B`` so that the update lands on the same local output
slice as the base (``module_plan``); adapters on other linear layers stay
replicated like their base (an adapter on the LM head keeps the vocabulary
replicated). Adapter dropout is refused with
t > 1 (``areal_fsdp.layout.check_layout_settings``).

Attention heads: the installed transformers' attention reshapes the
projections with ``view(..., -1, head_dim)``, so it runs on the local head
count without touching the module; ``num_key_value_groups`` (heads per kv
head) is the same on every tensor rank when both head counts divide by t,
which ``check_tp_model`` requires.

This module imports torch only inside its functions (the rank process calls
them); ``import areal_fsdp.tensor_parallel`` stays light.
"""

from __future__ import annotations

import functools
from typing import Any

from areal_kernel.engine.microbatch import MicroBatchRunner
from areal_kernel.errors import ConfigError

# model_type values of config.json the plan below was checked on (parity with
# the torch engine, tests/test_fsdp_tp.py). Qwen2's q/k/v biases are split
# with their column-wise weights (ColwiseParallel shards a bias on dim 0).
# Its parity was once unsettled (one MLP weight 4.35x a two-split floor away,
# with AVX2 kernels): that element, layers.0.mlp.up_proj[116, 35] of the test
# model, moves by up to 1.0e-5 under any other micro-batch split too (Adam on
# a near-zero gradient), so the test's floor now spans three splits.
TP_FAMILIES = ("llama", "qwen3", "qwen2")

# Relative module paths inside one decoder layer -> "colwise" / "rowwise".
LAYER_PLAN: dict[str, str] = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


# Replicated weights inside a split attention that see only the local heads
# (their gradients are partial sums over the tensor ranks).
PER_HEAD: tuple[str, ...] = ("self_attn.q_norm", "self_attn.k_norm")


def per_head_params(model: Any) -> list[str]:
    """Names of the parameters (in ``model.named_parameters()``) of the
    per-head modules of every decoder layer: their gradients must be summed
    over the tensor group."""
    layers = {id(m) for m in decoder_layers(model)}
    names = []
    for layer_name, layer in model.named_modules():
        if id(layer) not in layers:
            continue
        for path in PER_HEAD:
            if _has_submodule(layer, path):
                names += [f"{layer_name}.{path}.{n}" for n, _ in layer.get_submodule(path).named_parameters()]
    return names


def check_tp_model(hf_config: Any, tp: int, allocation: str) -> None:
    """One ``ConfigError`` naming the allocation when the model cannot be
    split ``tp`` ways: a family without a plan, or head / feature counts that
    do not divide by ``tp``."""
    if tp == 1:
        return
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in TP_FAMILIES:
        raise ConfigError(
            f"actor.backend: {allocation}: the fsdp engine has a tensor-parallel plan for model types "
            f"{', '.join(TP_FAMILIES)}, not {model_type!r}; use data parallelism only (t1)"
        )
    counts = {
        "num_attention_heads": hf_config.num_attention_heads,
        "num_key_value_heads": getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
        "intermediate_size": hf_config.intermediate_size,
    }
    bad = {k: v for k, v in counts.items() if v % tp}
    if bad:
        raise ConfigError(
            f"actor.backend: {allocation}: the model's "
            + ", ".join(f"{k}={v}" for k, v in bad.items())
            + f" do not divide by t={tp}; pick a t that divides every one of {counts}"
        )


def decoder_layers(model: Any) -> list[Any]:
    """The decoder layers of an HF causal LM, found by the class names the
    model declares unsplittable (``_no_split_modules``), in model order."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def apply_tensor_parallel(model: Any, tp_mesh: Any) -> int:
    """Split every decoder layer of ``model`` over ``tp_mesh`` (in place,
    before FSDP wraps it). Returns the number of layers split."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    layers = decoder_layers(model)
    if not layers:
        raise ConfigError(
            f"tensor parallelism: found no decoder layers in {type(model).__name__} (none of its modules is one "
            "of its _no_split_modules)"
        )
    for layer in layers:
        missing = [path for path in LAYER_PLAN if not _has_submodule(layer, path)]
        if missing:
            raise ConfigError(
                f"tensor parallelism: {type(layer).__name__} has no {', '.join(missing)}; the plan is for "
                f"Llama-family layers ({', '.join(TP_FAMILIES)})"
            )
        plan: dict[str, Any] = {}
        for path, kind in LAYER_PLAN.items():
            for sub, sub_kind in module_plan(layer.get_submodule(path), path, kind).items():
                plan[sub] = styles[sub_kind]()
        parallelize_module(layer, tp_mesh, plan)
    return len(layers)


def module_plan(module: Any, path: str, kind: str) -> dict[str, str]:
    """The plan entries of one planned projection: ``{path: kind}`` for a
    plain linear layer; for a peft LoRA layer (the base linear under
    ``base_layer``, its adapters' ``lora_A`` / ``lora_B`` beside it) the base
    is split as planned and each adapter so that ``B @ A`` is split like the
    base weight, the update landing on the same local output slice:

    - column-wise base (``W`` split over its output rows, input replicated):
      ``lora_A`` replicated (it reads the whole input), ``lora_B`` column-wise
      (each rank its slice of the update's outputs). Its input's gradient is
      the sum of the ranks' partial gradients: ``ColwiseParallel`` all-reduces
      it in the backward, so ``lora_A``'s gradient is whole on every rank;
    - row-wise base (``W`` split over its input columns, input sharded):
      ``lora_A`` row-wise (each rank multiplies its input slice by its columns
      of ``A``; the all-reduce sums the ``r`` partial products), ``lora_B``
      replicated (the whole update, added to the base's all-reduced output).

    Adapters left unplanned stay replicated plain parameters: FSDP shards them
    over the data axis only, and the grad norm counts them once
    (``areal_fsdp.rank.replicas``)."""
    if not (hasattr(module, "base_layer") and hasattr(module, "lora_A") and hasattr(module, "lora_B")):
        return {path: kind}
    plan = {f"{path}.base_layer": kind}
    for adapter in module.lora_A:
        if kind == "colwise":
            plan[f"{path}.lora_B.{adapter}"] = "colwise"
        else:
            plan[f"{path}.lora_A.{adapter}"] = "rowwise"
    return plan


def _has_submodule(module: Any, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


# --------------------------------------------------------- the vocabulary split
def vocab_split_refusal(model: Any, tp: int) -> str | None:
    """Why the embedding and the LM head of ``model`` cannot be split over
    ``tp`` ranks by vocabulary rows (they then stay replicated); None when
    they can. Uneven vocabularies fall back rather than pad: a padded head
    would change the weights' shapes that exports, broadcasts and checkpoints
    carry, and the replicated head is exact, only slower."""
    import torch.nn as nn

    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if hasattr(emb, "base_layer") or hasattr(head, "base_layer"):
        return "a LoRA adapter wraps the embedding or the LM head"
    if not isinstance(emb, nn.Embedding) or not isinstance(head, nn.Linear):
        return f"embedding {type(emb).__name__} / head {type(head).__name__} are not nn.Embedding / nn.Linear"
    if head.bias is not None:
        return "the LM head has a bias"
    cfg = getattr(model, "config", None)
    if any(getattr(cfg, k, None) not in (None, 1.0) for k in ("final_logit_softcapping", "logit_scale")):
        return "the model scales or soft-caps its logits"
    vocab = emb.weight.shape[0]
    if head.weight.shape[0] != vocab:
        return f"the embedding has {vocab} rows, the LM head {head.weight.shape[0]}"
    if vocab % tp:
        return f"the vocabulary ({vocab}) does not divide by t={tp}"
    return None


def apply_vocab_parallel(model: Any, tp_mesh: Any) -> int:
    """Split the embedding and the LM head of ``model`` by vocabulary rows over
    ``tp_mesh`` (in place, before FSDP; ``vocab_split_refusal`` must be None).
    Tensor rank ``r`` holds rows ``[r*V/t, (r+1)*V/t)`` of both. The embedding
    looks up the tokens it owns, zeroes the others, and one all-reduce sums the
    ranks' rows (torch's row-wise embedding); the head returns the rank's
    slice of the logits ``(..., V/t)`` as a plain tensor, which only
    ``vocab_parallel_scores`` reads. A tied matrix is split once and shared
    by both. Returns the first vocabulary row this rank holds."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = head.weight is emb.weight
    names = {id(m): n for n, m in model.named_modules()}
    parallelize_module(
        model,
        tp_mesh,
        {
            # Token ids are the same on every tensor rank; the summed rows too.
            names[id(emb)]: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            # The head reads the full hidden state; its backward sums the
            # ranks' input gradients (the input's Replicate layout).
            names[id(head)]: ColwiseParallel(output_layouts=Shard(-1), use_local_output=True),
        },
    )
    if tied:
        # Each style distributed its own copy of the shared matrix: keep one.
        head.weight = emb.weight
    rows = emb.weight.to_local().shape[0]
    return tp_mesh.get_local_rank() * rows


def vocab_parallel_scores(logits: Any, labels: Any, start: int, group: Any) -> tuple[Any, Any]:
    """Per row of ``logits`` (``(m, V/t)``: this rank's vocabulary slice
    ``[start, start + V/t)``, float, temperature applied): the logprob of
    ``labels`` (global token ids) and the entropy over the whole vocabulary,
    the same on every rank of ``group``. Two collectives: the max per row
    (for a stable exp), then one sum of (sum of exp, sum of exp * logit, the
    label's logit from the rank that owns it). Differentiable in ``logits``."""
    return _scores_fn().apply(logits, labels, start, group)


@functools.lru_cache(maxsize=1)
def _scores_fn() -> Any:
    """The autograd Function behind ``vocab_parallel_scores`` (built on first
    use so the module imports without torch)."""
    import torch
    import torch.distributed as dist

    class VocabParallelScores(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, logits: Any, labels: Any, start: int, group: Any) -> Any:
            # Unused outputs (the entropy when only logprobs train) get None, not zeros.
            ctx.set_materialize_grads(False)
            rows = logits.shape[-1]
            top = logits.max(dim=-1).values
            # Every rank must shift by the same max: the sums below add across ranks.
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            shifted = logits - top[:, None]
            e = shifted.exp()
            local = labels - start
            own = (local >= 0) & (local < rows)
            target = shifted.gather(-1, local.clamp(0, rows - 1)[:, None])[:, 0]
            sums = torch.stack([e.sum(-1), (e * shifted).sum(-1), torch.where(own, target, 0.0)], dim=-1)
            dist.all_reduce(sums, group=group)
            log_z = sums[:, 0].log()
            mean = sums[:, 1] / sums[:, 0]  # E_p[logit] - max
            ctx.save_for_backward(shifted, log_z, mean, local, own)
            return sums[:, 2] - log_z, log_z - mean

        @staticmethod
        def backward(ctx: Any, g_lp: Any, g_ent: Any) -> Any:
            # d logprob / d z_j = [j = label] - p_j; d entropy / d z_j = p_j (E_p[z] - z_j).
            # Both need only this rank's p_j and the rows' global sums: no collective.
            shifted, log_z, mean, local, own = ctx.saved_tensors
            p = (shifted - log_z[:, None]).exp()
            grad = torch.zeros_like(p)
            if g_lp is not None:
                grad -= p * g_lp[:, None]
                hit = torch.nonzero(own, as_tuple=False)[:, 0]
                grad.index_put_((hit, local.index_select(0, hit)), g_lp.index_select(0, hit), accumulate=True)
            if g_ent is not None:
                grad += g_ent[:, None] * p * (mean[:, None] - shifted)
            return grad, None, None, None

    return VocabParallelScores


class TensorRunner(MicroBatchRunner):
    """The micro-batch runner of a tensor rank whose LM head is split by
    vocabulary (``apply_vocab_parallel``): the model returns this rank's
    slice of the logits, and the logprobs and entropies come from
    ``vocab_parallel_scores`` over the tensor group."""

    # The head's input is laid out by the tensor plan: not indexed by position there.
    select_in_model = False

    def __init__(self, model: Any, config: Any, device: Any, *, group: Any, vocab_start: int, **kw: Any) -> None:
        super().__init__(model, config, device, **kw)
        self.group, self.vocab_start = group, vocab_start

    def token_scores(self, logits: Any, labels: Any, entropy_grad: bool) -> tuple[Any, Any]:
        lp, ent = vocab_parallel_scores(logits, labels, self.vocab_start, self.group)
        return lp, (ent if entropy_grad else ent.detach())
