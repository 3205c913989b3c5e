"""Context parallelism in the fsdp engine (``fsdp:c2``, ``fsdp:d2c2``): the
sequence dimension of every micro-batch split over the ``c`` ranks of a
context group.

**The split.** A micro-batch is one packed row of ``n`` tokens (sequences
concatenated, position ids restarting at 0 for each; ``areal_kernel.engine.
packing``). The row is padded at its end to ``N = c * L`` tokens and cut into
``c`` contiguous chunks of ``L`` tokens; context rank ``r`` runs the model on
tokens ``[r*L, (r+1)*L)`` with their position ids from the whole row (so RoPE
sees the global positions). Contiguous chunks are the simple choice: with
causal attention the last rank's queries see the most keys, so its attention
costs more than the first rank's (up to ``2c-1`` times on one long sequence;
the MLP and head costs are equal). Balancing that (each rank taking a chunk
from both ends) is left for later.

**Attention.** The model runs with the attention function ``context_attention``
(registered with transformers' ``AttentionInterface`` as ``ATTENTION_NAME``;
transformers builds no mask for an implementation it has no mask function
for). Each layer all-gathers the keys and values of the whole row over the
context group, then the rank's queries attend to the keys at global positions
``<=`` their own within the same sequence (sequence ids from the packed row;
padding is a sequence of its own at the end, so no real token attends to
it). Grouped-query attention repeats the key/value heads. The all-gather is
autograd-aware: its backward sums every rank's gradient of the gathered keys
and values and hands each rank the part of its own chunk (a reduce-scatter),
because the queries of every later rank used them.

**Logprobs and the loss.** The next-token labels are taken from the whole
row before splitting: the hidden state of the last token of chunk ``r``
predicts the first token of chunk ``r+1``. Each rank computes the logprobs
and entropies its positions predict, and the row's per-token vectors are
all-gathered, so every rank holds the same token-aligned vectors a single
process computes and runs the same loss function on them (any loss of the
loss contract, normalised by the batch's token counts). The backward of that
gather keeps only the rank's own positions' gradient: the loss is computed
``c`` times identically, and each rank's graph owns its positions' logprobs
once. Every rank's parameter gradients are then its partial sum of the
micro-batch's gradient; FSDP sums (not averages) gradients over all ranks
(``set_gradient_divide_factor(1.0)`` in ``areal_fsdp.rank``), which adds the
context ranks' parts and the data ranks' shares alike. The gradient norm
counts each weight once: FSDP shards every weight over all ``d*c`` ranks.

Prompt sharing (tree rows with a 4-D mask) is off with ``c > 1``: plain
packing only. This module imports torch only inside its functions;
``import areal_fsdp.context_parallel`` stays light.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from areal_kernel.engine.microbatch import MicroBatchRunner
from areal_kernel.errors import ConfigError

# The name the rank process registers ``context_attention`` under and sets as
# the model's attention implementation.
ATTENTION_NAME = "areal_context_parallel"


@dataclass
class ContextShard:
    """What one rank's attention needs to know about the row it runs a chunk
    of: its context group and size, and which keys of the padded row each of
    its queries sees (``chunk_mask``; built once per micro-batch, used by every layer)."""

    group: Any
    size: int
    allowed: Any  # (L, N) bool


def chunk_mask(seq_ids: Any, start: int, chunk: int) -> Any:
    """``(chunk, N)`` bool: query ``start + i`` of the padded row sees key
    ``j`` when ``j <= start + i`` (causal over the *global* positions: the
    chunk's offset in the row) and both belong to the same sequence
    (``seq_ids``, ``(N,)``: the sequence of each token of the padded row)."""
    import torch

    q_pos = torch.arange(start, start + chunk, device=seq_ids.device)
    k_pos = torch.arange(seq_ids.shape[0], device=seq_ids.device)
    return (k_pos[None, :] <= q_pos[:, None]) & (seq_ids[None, :] == seq_ids[q_pos][:, None])


def check_cp_model(hf_config: Any, cp: int, layout: str) -> None:
    """One ``ConfigError`` for a model whose attention ``context_attention``
    does not compute (sliding windows, logit soft-capping, attention sinks)."""
    text = getattr(hf_config, "text_config", None) or hf_config
    reasons = []
    if getattr(text, "sliding_window", None) is not None and getattr(text, "use_sliding_window", True):
        reasons.append("sliding-window attention")
    if getattr(text, "attn_logit_softcapping", None) is not None:
        reasons.append("attention logit soft-capping")
    if getattr(text, "layer_types", None) and any(t != "full_attention" for t in text.layer_types):
        reasons.append("layers other than full attention")
    if reasons:
        raise ConfigError(
            f"actor.backend: {layout} (c{cp}): the model ({getattr(text, 'model_type', '?')!r}) uses "
            f"{', '.join(reasons)}, which the context-parallel attention does not compute; use 'fsdp:d{cp}'"
        )


@functools.lru_cache(maxsize=1)
def _autograd_functions() -> tuple[Any, Any]:
    """The two gathers (torch autograd Functions, built on first use so the
    module imports without torch)."""
    import torch
    import torch.distributed as dist

    class GatherSequence(torch.autograd.Function):
        """All-gather along dim 0 over the context group; backward: the sum of
        every rank's gradient, each rank keeping its own chunk (reduce-scatter).
        For keys and values: every rank's queries read every earlier chunk."""

        @staticmethod
        def forward(ctx: Any, x: Any, group: Any, size: int) -> Any:
            ctx.group, ctx.size = group, size
            x = x.contiguous()
            out = x.new_empty((x.shape[0] * size, *x.shape[1:]))
            dist.all_gather_single(out, x, group=group)
            return out

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            grad = grad.contiguous()
            out = grad.new_empty((grad.shape[0] // ctx.size, *grad.shape[1:]))
            dist.reduce_scatter_single(out, grad, group=ctx.group)
            return out, None, None

    class GatherReplicated(torch.autograd.Function):
        """All-gather along dim 0 whose result every rank then uses the same
        way (the loss on the row's logprobs): backward keeps the gradient of
        the rank's own chunk, no communication (the other ranks' chunks got
        the same gradient on their own rank)."""

        @staticmethod
        def forward(ctx: Any, x: Any, group: Any, size: int, rank: int) -> Any:
            ctx.rows, ctx.rank = x.shape[0], rank
            x = x.contiguous()
            out = x.new_empty((x.shape[0] * size, *x.shape[1:]))
            dist.all_gather_single(out, x, group=group)
            return out

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            a = ctx.rank * ctx.rows
            return grad[a : a + ctx.rows].contiguous(), None, None, None

    return GatherSequence, GatherReplicated


def context_attention(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    context_shard: ContextShard | None = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    """transformers attention function (``AttentionInterface``): ``query`` is
    this rank's chunk ``(B, heads, L, D)``, ``key``/``value`` its chunk's
    ``(B, kv_heads, L, D)``; returns ``(B, L, heads, D)`` attention outputs
    over the keys of the whole row (see the module docstring)."""
    import torch
    import torch.nn.functional as F

    if context_shard is None:
        raise RuntimeError(
            f"the {ATTENTION_NAME!r} attention needs context_shard= (the model is called by areal_fsdp's "
            "ContextRunner only)"
        )
    s = context_shard
    gather_seq, _ = _autograd_functions()
    kv_heads = key.shape[1]
    # One collective per layer for keys and values together, sequence first
    # (the gather concatenates along dim 0).
    kv = torch.cat([key, value], dim=1).permute(2, 0, 1, 3)
    kv = gather_seq.apply(kv, s.group, s.size).permute(1, 2, 0, 3)
    k, v = kv[:, :kv_heads], kv[:, kv_heads:]
    groups = query.shape[1] // kv_heads
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(
        query,
        k,
        v,
        attn_mask=s.allowed.to(query.device)[None, None],
        dropout_p=dropout if module.training else 0.0,
        scale=scaling,
    )
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    """Make ``ATTENTION_NAME`` known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, context_attention)


class ContextRunner(MicroBatchRunner):
    """The micro-batch runner of one context rank: the kernel's loop
    (planning, loss, stats, lockstep) with ``forward`` running this rank's
    chunk of the row and returning the row's gathered token-aligned vectors."""

    def __init__(self, model: Any, config: Any, device: Any, *, group: Any, rank: int, size: int, **kw: Any) -> None:
        super().__init__(model, config, device, **kw)
        self.group, self.cp_rank, self.cp_size = group, rank, size

    def forward(
        self,
        row: Any,
        *,
        entropy_grad: bool,
        scored: Any = None,
        tree: Any = None,
        images: dict[str, Any] | None = None,
    ) -> tuple[Any, Any]:
        import torch

        if tree is not None or images:
            raise RuntimeError("context parallelism runs plain packed text rows only (no shared prompts, no images)")
        _, gather_rep = _autograd_functions()
        c, r = self.cp_size, self.cp_rank
        n = row.input_ids.shape[0]
        dev = row.input_ids.device
        chunk = -(-n // c)
        pad = chunk * c - n
        fill = torch.arange(pad, dtype=torch.long, device=dev)
        ids = torch.cat([row.input_ids, torch.zeros_like(fill)])
        pos = torch.cat([row.position_ids, fill])
        seq = torch.cumsum(row.seq_start.long(), 0) - 1
        # Padding: one sequence of its own after the last, attending only to itself.
        seq = torch.cat([seq, torch.full_like(fill, int(seq[-1]) + 1)])
        a = r * chunk
        shard = ContextShard(self.group, c, chunk_mask(seq, a, chunk))
        with self.autocast():
            out = self.model(
                input_ids=ids[a : a + chunk][None],
                position_ids=pos[a : a + chunk][None],
                use_cache=False,
                context_shard=shard,
            )
        # Labels from the whole row, shifted before the split: position p of
        # the padded row predicts token p + 1, also across a chunk boundary.
        wanted = ~row.seq_start if scored is None else (scored & ~row.seq_start)
        none = torch.zeros(pad + 1, dtype=torch.bool, device=dev)
        wanted_next = torch.cat([wanted, none])[a + 1 : a + chunk + 1]
        labels_next = torch.cat([row.input_ids, none.long()])[a + 1 : a + chunk + 1]
        pred = torch.nonzero(wanted_next, as_tuple=False)[:, 0]
        logits = out.logits[0].index_select(0, pred).float()
        if self.config.temperature != 1.0:
            logits = logits / self.config.temperature
        lse = torch.logsumexp(logits, dim=-1)
        lp_sel = logits.gather(-1, labels_next.index_select(0, pred)[:, None])[:, 0] - lse
        if entropy_grad:
            ent_sel = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
        else:
            with torch.no_grad():
                ent_sel = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
        local = torch.zeros(chunk, 2, dtype=lp_sel.dtype, device=dev).index_put(
            (pred,), torch.stack([lp_sel, ent_sel], dim=-1)
        )
        both = gather_rep.apply(local, self.group, c, r)
        # Entry p of the gathered row is the prediction of token p + 1: shift
        # back so that entry t is token t's logprob (token 0 predicts nothing).
        zero = both.new_zeros(1, 2)
        aligned = torch.cat([zero, both[: n - 1]])
        logprobs, entropy = aligned[:, 0], aligned[:, 1]
        return logprobs, (entropy if entropy_grad else entropy.detach())
