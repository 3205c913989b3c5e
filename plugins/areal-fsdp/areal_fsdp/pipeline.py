"""Pipeline parallelism in the fsdp engine (``fsdp:p2``, ``fsdp:p4``):
``torch.distributed.pipelining`` stages cut from the HF model by layer count.

**Stages.** The decoder layers are split by count (``layout.split_layers``)
into ``p x v`` stages (``v`` stages per rank: 1 for ``1f1b``, 2 for
``interleaved_1f1b``), stage ``s`` on pipeline rank ``s % p``. Every rank
loads the whole HF model (memory-mapped, transient, as FSDP ranks do) and
then keeps only what its stages run (``prune_model``): the embedding on the
first stage, the final norm and the LM head on the last, each decoder layer
on its stage; a layer another rank runs is replaced by an empty module, so
parameter names stay the HF model's (``model.layers.3.mlp...``) on every
rank: exports, the broadcast and DCP checkpoints use them unchanged.

**Tied embeddings** (SmolLM2, the tiny test Llama): the embedding and the LM
head are one matrix. When the first and last stages sit on different ranks,
each of the two ranks keeps its own copy, initialised from the same file.
After the backward the two ranks add their gradients of it (one all-reduce
between them: ``tie_group``), so both copies get the gradient the single
process gets (embedding part + head part); the norm counts it once (the
last stage leaves its copy out) and clipping scales both by the same factor,
so AdamW moves both copies identically and they stay equal. The export
sends the first stage's copy (``model.embed_tokens.weight``; the tied
``lm_head.weight`` is not exported, as for one process).

**Micro-batches and the loss.** The engine's own micro-batching
(``MicroBatchRunner.plan``, ``max_tokens_per_mb``) makes the packed rows;
the schedule needs equal shapes, so each row is padded at its end to the
longest row of the call with a separate dummy sequence (positions restart
at 0, so the packed-sequence mask keeps it apart; it is after every real
token, and attention is causal, so it cannot change them). The rows are
stacked ``(M, L)`` and the schedule's own chunking gives back one row per
micro-batch. The RL loss needs per-token data (loss mask, old and proximal
logprobs, advantages, batch-wide sequence ids): rather than squeezing those
through the schedule, the schedule's ``target`` is each micro-batch's
*index* (``arange(M)``, chunked to ``[j]``), and the loss callable the
schedule runs on the last stage looks row ``j`` up and runs the same tail as
the single-process engine (logits -> logprobs and entropy of the scored
tokens -> the kernel's ``loss_fn``), recording the loss, stats and entropy.
It returns that micro-batch's share of the *batch* loss (the kernel's loss
contract), so the schedule must not rescale: ``scale_grads=False``. Scoring
(``compute_logprobs``) runs the same schedule forward-only
(``schedule.eval``), the callable recording logprobs and entropies.

When the engine's plan has fewer rows than pipeline ranks, the rows are
split finer (``PipelineRunner.plan``); when there are still fewer than the
schedule needs (1F1B: at least ``p``; interleaved: a multiple of ``p``),
filler rows of pad tokens run with a zero loss. Prompt sharing (``share_prompts``) is not used with ``p > 1``: every
sequence runs whole (the same numbers; more tokens when prompts repeat).
"""

from __future__ import annotations

from typing import Any, Callable

from areal_kernel.api.io import TrajectoryBatch
from areal_kernel.engine.microbatch import AccumulateResult, MicroBatchRunner, merge_stats, per_token_fields
from areal_kernel.engine.packing import pack_row
from areal_kernel.errors import ConfigError
from areal_kernel.platforms import current_platform

from areal_fsdp.layout import PIPELINE_SCHEDULES, Layout, split_layers, stage_rank

PP_FAMILIES = ("llama",)

# A packed row (``areal_kernel.engine.packing.pack_row``'s result).
PackedRow = Any


def check_pp_model(model: Any, n_stages: int, layout: Layout, schedule: str) -> None:
    """One ``ConfigError`` line when the stages cannot be cut from ``model``."""
    cfg = model.config
    mt = getattr(cfg, "model_type", None)
    if mt not in PP_FAMILIES:
        raise ConfigError(
            f"actor.backend: {layout}: pipeline stages are cut for model types {', '.join(PP_FAMILIES)}, "
            f"not {mt!r}; use 'fsdp:d{layout.world_size}'"
        )
    n = int(cfg.num_hidden_layers)
    if n < n_stages:
        raise ConfigError(
            f"actor.backend: {layout} with actor.fsdp.pipeline_schedule={schedule!r} needs at least {n_stages} "
            f"decoder layers ({n_stages // layout.pp} stage(s) per rank), the model has {n}; use fewer pipeline "
            "ranks or pipeline_schedule '1f1b'"
        )


def prune_model(model: Any, layout: Layout, schedule: str, rank: int) -> dict[str, Any]:
    """Keep what ``rank``'s stages run (in place; see the module docstring).
    Returns ``{"stages": [(stage index, layer range)], "first": stage 0 is
    here, "last": the last stage is here, "tied": the embedding and head
    share one matrix, "tie_split": ... and they ended on different ranks}``."""
    import torch.nn as nn

    v = PIPELINE_SCHEDULES[schedule][1]
    n_stages = layout.pp * v
    check_pp_model(model, n_stages, layout, schedule)
    base = model.model
    ranges = split_layers(int(model.config.num_hidden_layers), n_stages)
    mine = [(s, ranges[s]) for s in range(n_stages) if stage_rank(s, layout.pp) == rank]
    first = stage_rank(0, layout.pp) == rank
    last = stage_rank(n_stages - 1, layout.pp) == rank
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is base.embed_tokens.weight
    tie_split = tied and stage_rank(0, layout.pp) != stage_rank(n_stages - 1, layout.pp)
    kept = {i for _, r in mine for i in r}
    for i in range(len(base.layers)):
        if i not in kept:
            # An empty module keeps the ModuleList's indices, hence the HF names of the layers this rank keeps.
            base.layers[i] = nn.Module()
    if not first:
        base.embed_tokens = None
    if not last:
        base.norm = None
        model.lm_head = None
    return {"stages": mine, "first": first, "last": last, "tied": tied, "tie_split": tie_split}


def stage_module(model: Any, layers: range, first: bool, last: bool, autocast: Callable[[], Any]) -> Any:
    """The ``nn.Module`` one pipeline stage runs, over the (pruned) HF model's
    own submodules: embedding (first stage), ``layers``, rotary embedding and
    mask as ``LlamaModel.forward`` builds them, final norm + LM head (last
    stage). ``forward(x, position_ids)``: ``x`` is the token ids (first stage)
    or the previous stage's hidden states; returns hidden states, or logits
    on the last stage."""
    import torch.nn as nn
    from transformers.masking_utils import create_causal_mask

    base = model.model

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = base.embed_tokens if first else None
            self.layers = nn.ModuleList([base.layers[i] for i in layers])
            self.rotary = base.rotary_emb
            self.norm = base.norm if last else None
            self.head = model.lm_head if last else None

        def forward(self, x: Any, position_ids: Any) -> Any:
            with autocast():
                h = self.embed(x) if self.embed is not None else x
                # No cache and no attention mask, as the runner calls the whole
                # model: packed sequences are told apart by position_ids.
                mask = create_causal_mask(
                    config=base.config, inputs_embeds=h, attention_mask=None, past_key_values=None,
                    position_ids=position_ids,
                )  # fmt: skip
                pe = self.rotary(h, position_ids=position_ids)
                for layer in self.layers:
                    h = layer(h, attention_mask=mask, position_embeddings=pe, position_ids=position_ids,
                              past_key_values=None, use_cache=False)  # fmt: skip
                if self.head is not None and self.norm is not None:
                    h = self.head(self.norm(h))
            return h

    return Stage()


def token_scores(
    logits_rows: Any, row: PackedRow, scored: Any, temperature: float, entropy_grad: bool
) -> tuple[Any, Any]:
    """Token-aligned logprobs and entropies of one packed row from its
    logits (``(n, vocab)``, position ``i`` predicting token ``i + 1``): the
    same arithmetic as ``MicroBatchRunner.forward`` after its model call
    (the parity tests hold the two together)."""
    import contextlib

    import torch

    n = row.input_ids.shape[0]
    dev = row.input_ids.device
    wanted = ~row.seq_start if scored is None else (scored & ~row.seq_start)
    target_pos = torch.nonzero(wanted, as_tuple=False)[:, 0]
    logits = logits_rows.index_select(0, target_pos - 1).float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    labels = row.input_ids.index_select(0, target_pos)
    lp_sel = logits.gather(-1, labels[:, None])[:, 0] - lse
    logprobs = torch.zeros(n, dtype=lp_sel.dtype, device=dev).index_put((target_pos,), lp_sel)
    with contextlib.nullcontext() if entropy_grad else torch.no_grad():
        z = logits if entropy_grad else logits.detach()
        l = lse if entropy_grad else lse.detach()
        ent = l - (torch.softmax(z, dim=-1) * z).sum(-1)
        entropy = torch.zeros(n, dtype=ent.dtype, device=dev).index_put((target_pos,), ent)
    return logprobs, entropy


class PipelineRunner:
    """Scores and accumulates gradients through a pipeline schedule (the
    pipeline counterpart of ``MicroBatchRunner``, whose planning, autocast
    and ``apply_gradients`` it reuses through ``runner``)."""

    def __init__(
        self,
        model: Any,
        runner: MicroBatchRunner,
        layout: Layout,
        schedule: str,
        stages: list[tuple[int, Any]],
        first: bool,
        last: bool,
    ) -> None:
        self.model = model
        self.runner = runner
        self.layout = layout
        self.schedule_name = schedule
        self.stages = stages  # (stage index, module) of this rank, in stage order
        self.n_stages = layout.pp * PIPELINE_SCHEDULES[schedule][1]
        self.first = first
        self.last = last
        self.config = runner.config
        self.device = runner.device

    # -------------------------------------------------------------- schedule
    def plan(self, batch: TrajectoryBatch) -> list[list[int]]:
        """The micro-batches (batch indices per packed row): the engine's plan
        (``max_tokens_per_mb``), split finer when it has fewer rows than the
        pipeline has ranks (the stages could not overlap, and the schedule
        would run full-length filler rows instead): then the budget becomes
        ``ceil(tokens / p)`` (never below the longest sequence)."""
        plan = [mb for mb, _ in self.runner.plan(batch)]
        p = self.layout.pp
        if len(plan) >= p:
            return plan
        lengths = [len(t.input_ids) for t in batch.trajectories]
        budget = max(max(lengths), -(-sum(lengths) // p))
        finer_runner = MicroBatchRunner(
            self.model, self.config.model_copy(update={"max_tokens_per_mb": budget}), self.device
        )
        finer = [mb for mb, _ in finer_runner.plan(batch)]
        return finer if len(finer) > len(plan) else plan

    def n_microbatches(self, rows: int) -> int:
        """Micro-batches the schedule runs for ``rows`` real rows: 1F1B needs
        at least ``p``; interleaved 1F1B a multiple of ``p`` (its rounds)."""
        p = self.layout.pp
        m = max(rows, p)
        if PIPELINE_SCHEDULES[self.schedule_name][1] > 1:
            m = -(-m // p) * p
        return m

    def make_schedule(self, n_mbs: int, length: int, loss: Callable[[Any, Any], Any]) -> Any:
        """Fresh stages and schedule for ``n_mbs`` rows of ``length`` tokens.
        The stages get their shapes statically (every rank knows them from the
        same plan), so nothing is inferred through a meta-device forward."""
        import torch
        from torch.distributed import pipelining

        hidden = int(self.model.config.hidden_size)
        vocab = int(self.model.config.vocab_size)
        dtype = next(self.model.parameters()).dtype
        meta = torch.device("meta")
        built = []
        for s, module in self.stages:
            # Hidden states carry gradients (the static metadata derives the
            # gradients' shapes from examples that require them); token ids do not.
            if s == 0:
                inp = torch.empty(1, length, dtype=torch.long, device=meta)
            else:
                inp = torch.empty(1, length, hidden, dtype=dtype, device=meta, requires_grad=True)
            width = vocab if s == self.n_stages - 1 else hidden
            out = torch.empty(1, length, width, dtype=dtype, device=meta, requires_grad=True)
            built.append(
                pipelining.PipelineStage(module, s, self.n_stages, self.device, input_args=(inp,), output_args=(out,))
            )
        cls = getattr(pipelining, PIPELINE_SCHEDULES[self.schedule_name][0])
        # scale_grads=False: each micro-batch's loss already is its share of
        # the batch loss (the kernel's loss contract); the schedule's default
        # would divide the gradients by n_mbs once more.
        if len(built) == 1 and PIPELINE_SCHEDULES[self.schedule_name][1] == 1:
            return cls(built[0], n_mbs, loss_fn=loss, scale_grads=False)
        return cls(built, n_mbs, loss_fn=loss, scale_grads=False)

    def stacked(self, rows: list[PackedRow], n_mbs: int) -> tuple[Any, Any, int]:
        """``(ids (M, L), position_ids (M, L), L)``: the rows padded at their
        end with one dummy sequence (ids 0, positions from 0), filler rows all
        padding; ``L`` at least 2."""
        import torch

        length = max([2] + [r.n_tokens for r in rows])
        ids = torch.zeros(n_mbs, length, dtype=torch.long, device=self.device)
        ramp = torch.arange(length, dtype=torch.long, device=self.device)
        pos = ramp.repeat(n_mbs, 1)
        for j, r in enumerate(rows):
            n = r.n_tokens
            ids[j, :n] = r.input_ids
            pos[j, :n] = r.position_ids
            pos[j, n:] = ramp[: length - n]
        return ids, pos, length

    def run(self, rows: list[PackedRow], loss: Callable[[int, Any], Any], train: bool) -> None:
        """Run the schedule over ``rows`` (plus fillers); ``loss(j, logits)``
        is called on the last stage for each real row ``j`` (``logits``: its
        unpadded ``(n, vocab)`` logits) and returns the tensor to backpropagate."""
        import torch

        n_mbs = self.n_microbatches(len(rows))
        ids, pos, length = self.stacked(rows, n_mbs)

        def schedule_loss(output: Any, target: Any) -> Any:
            j = int(target[0])
            if j >= len(rows):  # a filler: no loss, zero gradients (but a backward like the others)
                return (output.float() * 0.0).sum()
            return loss(j, output[0, : rows[j].n_tokens])

        sched = self.make_schedule(n_mbs, length, schedule_loss)
        args = (ids,) if self.first else ()
        target = torch.arange(n_mbs, device=self.device)
        if train:
            sched.step(*args, target=target, position_ids=pos, return_outputs=False)
        else:
            with torch.no_grad():
                sched.eval(*args, target=target, position_ids=pos, return_outputs=False)

    # --------------------------------------------------------------- scoring
    def score(
        self, batch: TrajectoryBatch, only_loss_tokens: bool = False
    ) -> tuple[list[list[float]], list[list[float]]]:
        """As ``MicroBatchRunner.score``; the lists are filled on the rank of the last stage only."""
        trajs = batch.trajectories
        ids = [t.input_ids for t in trajs]
        out_lp: list[list[float]] = [[] for _ in ids]
        out_ent: list[list[float]] = [[] for _ in ids]
        masks = {"loss_mask": [[1.0 if m else 0.0 for m in t.loss_mask] for t in trajs]} if only_loss_tokens else {}
        rows = [pack_row(mb, ids, masks, {}, self.device) for mb in self.plan(batch)]

        def record(j: int, logits: Any) -> Any:
            row = rows[j]
            scored = row.data["loss_mask"] > 0 if only_loss_tokens else None
            lp, ent = token_scores(logits, row, scored, self.config.temperature, False)
            lp_l, ent_l = lp.cpu().tolist(), ent.cpu().tolist()
            for k, i in enumerate(row.seq_index):
                a, b = row.cu_seqlens[k], row.cu_seqlens[k + 1]
                out_lp[i], out_ent[i] = lp_l[a:b], ent_l[a:b]
            return logits.new_zeros(())

        was_training = self.model.training
        self.model.eval()
        try:
            self.run(rows, record, train=False)
        finally:
            self.model.train(was_training)
        return out_lp, out_ent

    # -------------------------------------------------------------- training
    def accumulate(
        self,
        batch: TrajectoryBatch,
        loss_fn: Callable[..., Any],
        extra: dict[str, list[list[float]]] | None,
        *,
        batch_loss_tokens: int,
        batch_n_seqs: int,
        seq_index: list[int] | None = None,
    ) -> AccumulateResult:
        """As ``MicroBatchRunner.accumulate`` (same per-token fields, batch-wide
        normalisers and sequence ids); the loss, stats and entropy are
        measured on the last stage (zeros elsewhere); ``finite`` likewise;
        ``n_mbs`` counts the packed rows with data, ``n_model_tokens`` their
        tokens (padding not counted)."""
        import math

        import torch

        ids, float_fields, long_fields = per_token_fields(batch, extra)
        dev = self.device
        batch_scalars = {
            "batch_loss_tokens": torch.tensor(float(batch_loss_tokens), device=dev),
            "batch_n_seqs": torch.tensor(float(batch_n_seqs), device=dev),
        }
        to_batch = None if seq_index is None else torch.tensor(seq_index or [0], dtype=torch.long, device=dev)
        entropy_grad = bool(getattr(loss_fn, "needs_entropy_grad", False))
        rows = [pack_row(mb, ids, float_fields, long_fields, dev) for mb in self.plan(batch)]
        res = AccumulateResult(n_mbs=len(rows), n_model_tokens=sum(r.n_tokens for r in rows))

        def mb_loss(j: int, logits: Any) -> Any:
            row = rows[j]
            data = dict(row.data)
            if to_batch is not None:
                # Loss functions see batch-wide sequence ids, as in one process.
                data["seq_ids"] = to_batch.index_select(0, data["seq_ids"])
            data.update(batch_scalars)
            logprobs, entropy = token_scores(logits, row, data["loss_mask"] > 0, self.config.temperature, entropy_grad)
            loss, stats = loss_fn(logprobs, entropy, data)
            value = float(loss.detach()) if torch.is_tensor(loss) else float(loss)
            if not math.isfinite(value):
                res.finite = False  # the backward still runs (lockstep); the step is skipped everywhere
            res.loss += value
            with torch.no_grad():
                res.entropy_sum += float((entropy.detach() * data["loss_mask"]).sum())
            merge_stats(res.stats, stats or {})
            if torch.is_tensor(loss) and loss.requires_grad:
                return loss
            # No gradient from this loss: a zero one keeps the backward (and its sends) in step.
            return (logprobs * 0.0).sum()

        self.run(rows, mb_loss, train=True)
        return res


def make_pipeline(
    model: Any, runner: MicroBatchRunner, layout: Layout, schedule: str, rank: int
) -> tuple[PipelineRunner, dict[str, Any]]:
    """Prune ``model`` to ``rank``'s stages and build their runner. Returns
    the runner and ``prune_model``'s description."""
    info = prune_model(model, layout, schedule, rank)
    last_stage = layout.pp * PIPELINE_SCHEDULES[schedule][1] - 1
    stages = [
        (s, stage_module(model, layers, s == 0, s == last_stage, runner.autocast)) for s, layers in info["stages"]
    ]
    pr = PipelineRunner(model, runner, layout, schedule, stages, info["first"], info["last"])
    return pr, info


def comm_device() -> Any:
    """Where tensors travel between ranks (host memory when the platform's
    collectives run there, e.g. gloo on cpu)."""
    import torch

    plat = current_platform()
    return torch.device("cpu") if plat.collectives_on_host else plat.device()
