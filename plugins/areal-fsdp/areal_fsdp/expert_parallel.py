"""Expert parallelism in the fsdp engine (``fsdp:d2e2``: 2 ranks, each holding
half of every MoE layer's experts).

**What is split.** In every sparse MoE block the experts' weights (HF's 3-D
``experts.gate_up_proj`` ``(E, 2I, H)`` and ``experts.down_proj`` ``(E, H, I)``)
become DTensors sharded on the expert dim over the expert ranks: rank ``r``
holds experts ``[r*E/e, (r+1)*E/e)``. They are left out of FSDP
(``ignored_params``): a rank computes with its own experts and never gathers
the others'. Everything else (embedding, attention, norms, the router
``gate``, dense MLPs, LM head) is FSDP-sharded over the data ranks as with
``fsdp:dN``. The experts reuse the data-parallel ranks (the kernel counts a
train engine's ranks as ``d*t*p*c``); this engine runs ``e == d``.

**The forward of one block** (``ExpertParallelMoE``), on the ``T`` tokens of
this rank's micro-batch, is Qwen3-MoE's math (``Qwen3MoeSparseMoeBlock``):
router logits ``h @ gate.weight^T``; probabilities by a float32 softmax;
top-k of them; renormalised to sum 1 when ``norm_topk_prob``; cast to the
logits' dtype. The ``T*k`` (token, expert) assignments are sorted by expert
(stable), each rank learns how many rows every other rank sends to each of
its experts (one all-to-all of counts), and the rows travel to the rank
holding their expert (``all_to_all_single`` with uneven splits; its backward
is the same exchange reversed). Each local expert runs its SwiGLU MLP on its
rows (``act(x W_g^T) * (x W_u^T)`` then ``W_d``), the outputs travel back by
the reverse exchange, are put back in assignment order, multiplied by their
routing weights and summed over the k choices of each token in top-k order
(as transformers' grouped-mm path does). Every expert's weights take part in
every forward, with zero rows when no token chose it: the gradient is then
zero, as in one process, never missing (AdamW treats the two differently).

**Gradients.** A rank's expert received the rows of every rank's tokens, so
its gradient already is the sum over the whole batch (no reduction; with
``e == d`` each expert lives on one rank). The router and the other weights
are summed over the data ranks by FSDP, as for ``fsdp:dN``.

**Router statistics** (``RouterStats``): in training forwards (not scoring,
not the filler micro-batches of a rank with fewer micro-batches) every block
adds, per expert, how many top-k choices it got and the sum of its router
probabilities, and the number of token rows. The controller adds the ranks'
sums and reports the Switch-Transformer load-balancing loss exactly as
transformers' ``load_balancing_loss_func`` pools it over layers and tokens
(``E * sum_i f_i * P_i``, ``f_i`` = choices of expert ``i`` per row, ``P_i``
= mean probability), and each expert's share of the choices. The aux loss is
a metric only: it is not added to the training loss, because the
single-process torch engine does not add it either (it computes the RL loss
from the logits and never asks the model for router logits), and the two
engines must take the same steps.

This module imports torch only inside its functions (the rank process
calls them); ``import areal_fsdp.expert_parallel`` stays light.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from areal_kernel.engine.microbatch import MicroBatchRunner
from areal_kernel.errors import ConfigError

# model_type values whose MoE block this module re-implements (parity with the
# torch engine: tests/test_fsdp_ep.py). Another family routes differently
# (Mixtral: softmax after top-k; Qwen2-MoE: a shared expert; DeepSeek: groups).
EP_FAMILIES = ("qwen3_moe",)
# The HF class of the block replaced in each decoder layer, per family.
MOE_BLOCKS = {"qwen3_moe": "Qwen3MoeSparseMoeBlock"}

# Keys of the raw router sums a rank reports in its train answer (summed over
# ranks by the controller's stats merge), turned into metrics by ``router_metrics``.
ROWS_KEY = "_moe_rows"
COUNT_KEY = "_moe_count_e"
PROB_KEY = "_moe_prob_e"


def check_ep_model(hf_config: Any, ep: int, allocation: str, where: str = "actor.backend") -> None:
    """One ``ConfigError`` naming ``where`` and the allocation when the model
    cannot be split ``ep`` ways by expert: not a mixture-of-experts model, a
    family without a re-implemented block, or experts not divisible by ``ep``."""
    if ep == 1:
        return
    model_type = getattr(hf_config, "model_type", None)
    n_experts = int(getattr(hf_config, "num_experts", 0) or getattr(hf_config, "num_local_experts", 0) or 0)
    if n_experts < 1:
        raise ConfigError(
            f"{where}: {allocation} asks for expert parallelism (e{ep}), but the model ({model_type!r}) is not a "
            f"mixture-of-experts model (no num_experts in its config.json); drop e, e.g. 'fsdp:d{ep}'"
        )
    if model_type not in EP_FAMILIES:
        raise ConfigError(
            f"{where}: {allocation}: the fsdp engine splits the experts of model types {', '.join(EP_FAMILIES)}, "
            f"not {model_type!r}; drop e (e.g. 'fsdp:d{ep}')"
        )
    if n_experts % ep:
        raise ConfigError(
            f"{where}: {allocation}: the model's num_experts={n_experts} does not divide by e={ep}; pick an e "
            f"that divides {n_experts}"
        )


def router_metrics(stats: dict[str, float], n_experts: int, top_k: int) -> dict[str, float]:
    """Pop the raw router sums out of merged train ``stats`` and return the
    metrics: ``moe_aux_loss`` (transformers' load-balancing loss, pooled over
    layers and every token of the step), ``moe_load_e<i>`` (expert ``i``'s share
    of the top-k choices; they sum to 1), ``moe_load_max`` / ``moe_load_min``
    and ``moe_load_imbalance`` (max share / mean share: 1 when balanced, ``E``
    when one expert takes every choice). ``{}`` when no token was routed."""
    rows = stats.pop(ROWS_KEY, 0.0)
    counts = [stats.pop(f"{COUNT_KEY}{i}", 0.0) for i in range(n_experts)]
    probs = [stats.pop(f"{PROB_KEY}{i}", 0.0) for i in range(n_experts)]
    if rows <= 0:
        return {}
    aux = n_experts * sum((c / rows) * (p / rows) for c, p in zip(counts, probs))
    total = sum(counts) or 1.0
    shares = [c / total for c in counts]
    out = {"moe_aux_loss": aux, "moe_load_max": max(shares), "moe_load_min": min(shares)}
    out["moe_load_imbalance"] = max(shares) * n_experts
    out.update({f"moe_load_e{i}": s for i, s in enumerate(shares)})
    return out


class RouterStats:
    """Per-expert sums of one optimizer step's training forwards on this
    rank (see the module docstring); ``paused()`` stops recording (filler
    micro-batches)."""

    def __init__(self, n_experts: int) -> None:
        self.n_experts = n_experts
        self.recording = True
        self.reset()

    def reset(self) -> None:
        self.rows = 0.0
        self.counts: Any = None
        self.probs: Any = None

    def add(self, top_index: Any, probs: Any) -> None:
        """One block's forward: its top-k expert ids and router probabilities
        (summed on their device; read back once per step by ``take``)."""
        import torch

        with torch.no_grad():
            counts = torch.bincount(top_index.reshape(-1), minlength=self.n_experts).double()
            psum = probs.detach().double().sum(0)
        self.counts = counts if self.counts is None else self.counts + counts
        self.probs = psum if self.probs is None else self.probs + psum
        self.rows += float(probs.shape[0])

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        was, self.recording = self.recording, False
        try:
            yield
        finally:
            self.recording = was

    def take(self) -> dict[str, float]:
        """The raw sums as stats entries (``ROWS_KEY``, ``COUNT_KEY<i>``,
        ``PROB_KEY<i>``), then reset; ``{}`` when nothing was recorded."""
        if self.counts is None:
            self.reset()
            return {}
        out = {ROWS_KEY: self.rows}
        out.update({f"{COUNT_KEY}{i}": float(c) for i, c in enumerate(self.counts.cpu().tolist())})
        out.update({f"{PROB_KEY}{i}": float(p) for i, p in enumerate(self.probs.cpu().tolist())})
        self.reset()
        return out


class ExpertRunner(MicroBatchRunner):
    """The kernel's micro-batch runner whose filler micro-batches (run only
    to keep the ranks' collectives in step) are left out of the router statistics."""

    router_stats: RouterStats | None = None

    def filler_forward(self, entropy_grad: bool = False) -> Any:
        if self.router_stats is None:
            return super().filler_forward(entropy_grad)
        with self.router_stats.paused():
            return super().filler_forward(entropy_grad)


def _exchange_fn() -> Any:
    """The all-to-all of rows as an autograd function: forward sends
    ``in_splits[j]`` rows to rank ``j`` and receives ``out_splits[j]`` from it;
    the backward sends the gradients back the same way reversed."""
    import torch
    import torch.distributed as dist

    class Exchange(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, out_splits: list[int], in_splits: list[int], group: Any) -> Any:
            ctx.splits, ctx.group = (out_splits, in_splits), group
            out = x.new_empty((sum(out_splits), *x.shape[1:]))
            dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
            return out

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            out_splits, in_splits = ctx.splits
            back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
            dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
            return back, None, None, None

    return Exchange


def make_block(hf_block: Any, hf_config: Any, group: Any, stats: RouterStats, comm_device: Any) -> Any:
    """An ``nn.Module`` replacing one HF sparse MoE block: the same children
    (``gate``, ``experts``: parameter names unchanged) and the forward of the
    module docstring. ``hf_block.experts``' weights must already be sharded
    (``shard_experts``)."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F

    exchange = _exchange_fn()
    ep = dist.get_world_size(group)
    n_experts = int(hf_config.num_experts)
    n_local = n_experts // ep
    top_k = int(hf_config.num_experts_per_tok)
    norm_topk = bool(getattr(hf_config, "norm_topk_prob", False))

    class ExpertParallelMoE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = hf_block.gate
            self.experts = hf_block.experts

        def route(self, h: Any) -> tuple[Any, Any, Any]:
            """(top-k weights in the logits' dtype, top-k expert ids, probabilities)."""
            logits = F.linear(h, self.gate.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            top_w, top_i = torch.topk(probs, top_k, dim=-1)
            if norm_topk:
                top_w = top_w / top_w.sum(dim=-1, keepdim=True)
            return top_w.to(logits.dtype), top_i, probs

        def forward(self, hidden_states: Any) -> Any:
            shape = hidden_states.shape
            h = hidden_states.reshape(-1, shape[-1])
            top_w, top_i, probs = self.route(h)
            if self.training and stats.recording:
                stats.add(top_i, probs)
            flat = top_i.reshape(-1)
            order = torch.sort(flat, stable=True).indices  # assignments grouped by expert, hence by rank
            rows = h.index_select(0, order // top_k)
            counts = torch.bincount(flat, minlength=n_experts)
            # How many rows each rank sends to each of this rank's experts.
            recv_counts = torch.empty_like(counts, device=comm_device)
            dist.all_to_all_single(recv_counts, counts.to(comm_device), group=group)
            send = counts.view(ep, n_local).sum(1).tolist()
            per_src = recv_counts.view(ep, n_local).cpu()
            recv = per_src.sum(1).tolist()
            got = exchange.apply(rows.to(comm_device), recv, send, group).to(h.device)
            # Received rows come by source rank, each source's by local expert: regroup by expert.
            local_ids = torch.repeat_interleave(torch.arange(n_local).repeat(ep), per_src.reshape(-1)).to(h.device)
            by_expert = torch.sort(local_ids, stable=True).indices
            grouped = got.index_select(0, by_expert)
            w_gu = self.experts.gate_up_proj.to_local()
            w_d = self.experts.down_proj.to_local()
            outs, start = [], 0
            for j, n in enumerate(per_src.sum(0).tolist()):
                x = grouped[start : start + n]  # may be empty: the weights still get a (zero) gradient
                gate, up = F.linear(x, w_gu[j]).chunk(2, dim=-1)
                outs.append(F.linear(self.experts.act_fn(gate) * up, w_d[j]))
                start += n
            done = torch.cat(outs).index_select(0, torch.argsort(by_expert))  # back in received order
            back = exchange.apply(done.to(comm_device), send, recv, group).to(h.device)
            per_choice = back.index_select(0, torch.argsort(order))  # assignment order (token-major)
            weighted = per_choice * top_w.reshape(-1, 1)
            out = weighted.view(-1, top_k, shape[-1]).sum(dim=1)
            return out.to(hidden_states.dtype).reshape(shape)

    return ExpertParallelMoE()


def shard_experts(experts: Any, mesh: Any, rank: int) -> list[Any]:
    """Replace ``experts``' 3-D weights by DTensors sharded on the expert dim
    over ``mesh`` (this rank keeps its contiguous slice). Returns the new parameters."""
    import torch.nn as nn
    from torch.distributed.tensor import DTensor, Shard

    ep = mesh.size()
    out = []
    for name in ("gate_up_proj", "down_proj"):
        full = getattr(experts, name)
        n_local = full.shape[0] // ep
        local = full.detach()[rank * n_local : (rank + 1) * n_local].clone()
        dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())
        p = nn.Parameter(dt, requires_grad=full.requires_grad)
        setattr(experts, name, p)
        out.append(p)
    return out


def apply_expert_parallel(model: Any, mesh: Any, rank: int, group: Any, stats: RouterStats, comm_device: Any) -> list:
    """Shard the experts of every sparse MoE block of ``model`` over ``mesh``
    and swap in ``ExpertParallelMoE`` (in place, before FSDP). Returns the
    expert parameters (FSDP must ignore them)."""
    cls_name = MOE_BLOCKS[model.config.model_type]
    params: list[Any] = []
    replaced = 0
    for _, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child).__name__ == cls_name:
                params += shard_experts(child.experts, mesh, rank)
                setattr(module, child_name, make_block(child, model.config, group, stats, comm_device))
                replaced += 1
    if not replaced:
        raise ConfigError(
            f"expert parallelism: found no {cls_name} in {type(model).__name__}; every decoder layer is dense"
        )
    return params
