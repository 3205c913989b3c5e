"""Several adapters trained in one pass over the frozen base (``train_together``).

Through its views (``areal_kernel.engine.multi_adapter``) a multi-adapter
engine trains one policy per call: each forward runs the base for one
adapter's batch. ``train_together(engine, jobs)`` takes one job per policy
(what ``view.train_batch`` takes: a batch, a loss, extra fields) and runs
micro-batches that mix the policies' sequences:

- each policy's sequences are cut into chunks as its own ``train_batch``
  would (with prompt sharing, a group's common prompt once per chunk; a
  chunk never spans policies), and all policies' chunks are packed together
  under ``max_tokens_per_mb`` (``joint_plan``), so a forward holds no more
  tokens than a one-policy forward may, and fewer forwards run;
- in a micro-batch, each policy's chunks are packed as usual and the rows
  laid end to end (the shared-prompt tree row built over all the chunks):
  attention stays inside each sequence and each policy's tokens are
  contiguous;
- the base's layers run once over the whole row, and every adapted linear
  layer adds each policy's update to that policy's tokens only
  (``AdapterSegments``);
- each policy's loss sees its own tokens' logprobs and its own batch-wide
  normalisers; the losses are summed and back-propagated once, each
  policy's gradients landing on its own adapter only; then each policy's
  optimizer clips and steps on its own (its lr, its step count), as
  ``view.train_batch`` does.

The result equals one ``view.train_batch`` per policy within float rounding
(``tests/engine/test_train_together.py`` measures it against a floor). What
it saves is the base's work on several small batches done as one larger
one: fewer, larger matrix products, which is what an accelerator rewards.

The loop itself is ``joint_accumulate`` (one process's share, under the
runner's ``MicroBatchHooks``): the torch engine runs it on the whole
batches, areal-fsdp's ranks on their shares of each policy's batch, in
lockstep (fillers past a rank's own micro-batches, and every trained
adapter in every forward with a zero share where it has no token, so that
each backward reduces the same gradients on every rank).

Falls back to one ``view.train_batch`` per policy (the same result) where a
joint forward cannot hold: one job, batches with images, and adapters on a
layer outside the decoder when the runner splits off the LM head (which
then runs on the scored positions only, not on a contiguous row). A policy
whose loss is not finite skips its step alone; its loss is left out of the
backward, so the others' gradients stay clean.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping

from areal_kernel.api.io import TrajectoryBatch
from areal_kernel.engine.microbatch import (
    FILLER_TOKENS,
    AccumulateResult,
    check_batch,
    count_loss_tokens,
    merge_stats,
    per_token_fields,
)
from areal_kernel.engine.packing import PackedRow, allocate_micro_batches, pack_row
from areal_kernel.engine.prefix_tree import SharedChunk, plan_chunks, virtual_order
from areal_kernel.errors import ArealError

if TYPE_CHECKING:
    from areal_kernel.api.engine import TrainEngine
    from areal_kernel.engine.microbatch import MicroBatchRunner
    from areal_kernel.engine.multi_adapter import AdapterPolicy
    from areal_kernel.engine.torch_engine import TorchTrainEngine


@dataclass
class PolicyJob:
    """One policy's share of a joint step: what its ``train_batch`` takes."""

    batch: TrajectoryBatch
    loss_fn: Callable[..., Any]
    extra: dict[str, list[list[float]]] | None = None


class _SegmentLinear:
    """Stands in for one peft LoRA linear layer during a joint forward: the
    base layer on every token, then each segment's own adapter update on its
    tokens (dimension 1 of a ``[1, T, features]`` input).

    The adapters present on the layer are stacked along the rank (``A`` rows,
    ``B`` columns) and run over the whole row in two matrix products, each
    token's rank entries masked to its own adapter's and scaled by its
    ``alpha / r`` (``masks``: one per set of adapters, shared by the
    layers): as many operations for two adapters as for one, and a token
    never reaches another adapter's parameters (their gradients get exact
    zeros from it). With LoRA dropout, which draws a mask per adapter, each
    segment runs through its own adapter on its own tokens instead.

    ``always``: adapters that take part in the products even with no token
    in the row (their mask columns zero): on ranks of a sharded model every
    adapter trained in the step must get a gradient, zero or not, in every
    backward, or the ranks would reduce different sets of gradients."""

    def __init__(
        self,
        layer: Any,
        path: str,
        segments: list[tuple[str, int, int]],
        masks: dict[Any, Any],
        always: tuple[str, ...] = (),
    ) -> None:
        self.layer = layer
        self.path = path
        self.segments = segments
        self.masks = masks
        self.always = always

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        import torch

        layer = self.layer
        result = layer.base_layer(x, *args, **kwargs)
        total = self.segments[-1][2]
        if x.dim() != 3 or x.shape[0] != 1 or x.shape[1] != total:
            raise ArealError(
                f"joint adapter forward: layer {self.path!r} got an input of shape {tuple(x.shape)}, "
                f"not the packed row's [1, {total}, ...]"
            )
        named = [n for n, _, _ in self.segments] + list(self.always)
        present = [name for name in dict.fromkeys(named) if name in layer.lora_A]
        if not present:
            return result
        if any(not isinstance(layer.lora_dropout[n], torch.nn.Identity) for n in present):
            return self._per_segment(x, result)
        a_w = [layer.lora_A[n].weight for n in present]
        b_w = [layer.lora_B[n].weight for n in present]
        key = tuple((n, w.shape[0], float(layer.scaling[n])) for n, w in zip(present, a_w))
        mask = self.masks.get(key)
        if mask is None:
            mask = torch.zeros(total, sum(w.shape[0] for w in a_w), dtype=a_w[0].dtype, device=x.device)
            col = 0
            for n, w in zip(present, a_w):
                for name, start, end in self.segments:
                    if name == n:
                        mask[start:end, col : col + w.shape[0]] = float(layer.scaling[n])
                col += w.shape[0]
            self.masks[key] = mask
        a = a_w[0] if len(a_w) == 1 else torch.cat(a_w, dim=0)
        b = b_w[0] if len(b_w) == 1 else torch.cat(b_w, dim=1)
        h = torch.nn.functional.linear(x.to(a.dtype), a) * mask
        return (result + torch.nn.functional.linear(h, b)).to(result.dtype)

    def _per_segment(self, x: Any, result: Any) -> Any:
        import torch

        layer = self.layer
        pieces = []
        for name, start, end in self.segments:
            piece = result[:, start:end]
            if name in layer.lora_A:
                a, b = layer.lora_A[name], layer.lora_B[name]
                xs = x[:, start:end].to(a.weight.dtype)
                piece = (piece + b(a(layer.lora_dropout[name](xs))) * layer.scaling[name]).to(result.dtype)
            pieces.append(piece)
        out = torch.cat(pieces, dim=1)
        # Adapters with no token here still join the graph, with a zero share.
        for name in self.always:
            if name in layer.lora_A and all(name != n for n, _, _ in self.segments):
                a, b = layer.lora_A[name], layer.lora_B[name]
                out = out + (b(a(x[:, :1].to(a.weight.dtype))) * 0.0).sum().to(out.dtype)
        return out


class AdapterSegments:
    """Within ``with AdapterSegments(model, segments):`` every peft LoRA
    linear layer of ``model`` adds adapter ``name``'s update to the tokens
    ``[start, end)`` of the packed row only, for each ``(name, start, end)``
    of ``segments`` (contiguous, from 0); the adapters of ``always`` join
    every product with a zero share where they have no segment
    (``_SegmentLinear``). The layers' own ``forward`` is shadowed by an
    instance attribute for the duration, so the module tree, the parameters
    and their ``requires_grad`` stay as they are."""

    def __init__(self, model: Any, segments: list[tuple[str, int, int]], always: tuple[str, ...] = ()) -> None:
        if not segments or segments[0][1] != 0 or any(a[2] != b[1] for a, b in zip(segments, segments[1:])):
            raise ArealError(f"joint adapter forward: segments {segments} do not tile the row from 0")
        self.model = model
        self.segments = segments
        self.always = always
        self._shadowed: list[Any] = []

    def __enter__(self) -> "AdapterSegments":
        masks: dict[Any, Any] = {}
        for path, layer in lora_layers(self.model):
            layer.forward = _SegmentLinear(layer, path, self.segments, masks, self.always)
            self._shadowed.append(layer)
        return self

    def __exit__(self, *exc: Any) -> None:
        for layer in self._shadowed:
            del layer.forward
        self._shadowed.clear()


def lora_layers(model: Any) -> Iterator[tuple[str, Any]]:
    """``(module path, layer)`` of every peft LoRA linear layer of ``model``."""
    from peft.tuners.lora import LoraLayer

    for path, m in model.named_modules():
        if isinstance(m, LoraLayer) and hasattr(m, "base_layer"):
            yield path, m


def batches_refusal(batches: Iterable[TrajectoryBatch]) -> str | None:
    """Why the policies' whole ``batches`` cannot share forwards whatever
    the model (None when they can): one policy, or a batch with images. A
    controller that splits the batches over ranks decides this on the whole
    batches, since one rank's share could hold images and another's not."""
    batches = list(batches)
    if len(batches) < 2:
        return "one policy"
    if any(t.images is not None for b in batches for t in b.trajectories):
        return "a batch has images"
    return None


def joint_refusal(runner: "MicroBatchRunner", model: Any, batches: Iterable[TrajectoryBatch]) -> str | None:
    """Why the policies' ``batches`` cannot share forwards on ``model`` (run
    by ``runner``; None when they can): ``batches_refusal``, then the
    model's structure. The model's part is the same on every rank of a
    sharded model (it reads the structure only)."""
    why = batches_refusal(batches)
    if why is not None:
        return why
    split = runner.head_split()
    if split is not None:
        # The LM head then runs on the scored positions only, not on the row
        # the segments describe; without the split every layer sees the row.
        inside = {id(m) for m in split[0].modules()}
        outside = [path for path, layer in lora_layers(model) if id(layer) not in inside]
        if outside:
            return f"an adapter on {outside[0]!r}, outside the decoder"
    for path, layer in lora_layers(model):
        if getattr(layer, "lora_variant", None):
            return f"a LoRA variant (DoRA...) on {path!r}"
    return None


def _joint_row(rows: list[PackedRow]) -> PackedRow:
    """The packed rows laid end to end (what ``MicroBatchRunner.forward`` reads)."""
    import torch

    cu: list[int] = [0]
    for r in rows:
        cu.extend(cu[-1] + b for b in r.cu_seqlens[1:])
    return PackedRow(
        input_ids=torch.cat([r.input_ids for r in rows]),
        position_ids=torch.cat([r.position_ids for r in rows]),
        seq_start=torch.cat([r.seq_start for r in rows]),
        cu_seqlens=cu,
        seq_index=[i for r in rows for i in r.seq_index],
        data={},
    )


def joint_plan(config: Any, batches: dict[str, TrajectoryBatch]) -> list[dict[str, list[SharedChunk]]]:
    """The micro-batches of a joint step: every policy's sequences in chunks
    (with ``share_prompts``, a group's common prompt once per chunk, never
    shared across policies; else one sequence per chunk), all policies'
    chunks packed together under ``max_tokens_per_mb`` (first-fit
    decreasing, deterministic), so that a forward holds no more tokens than
    one policy's would. Each micro-batch maps the policies it holds, in
    ``batches``' order, to their chunks; a micro-batch may hold one policy."""
    items: list[tuple[str, SharedChunk, int]] = []
    for name, batch in batches.items():
        trajs = batch.trajectories
        ids = [t.input_ids for t in trajs]
        lengths = [len(x) for x in ids]
        if config.share_prompts:
            own = plan_chunks(ids, [t.loss_mask for t in trajs], config.max_tokens_per_mb)
        else:
            own = [SharedChunk(0, (i,)) for i in range(len(trajs))]
        items.extend((name, c, c.cost(lengths)) for c in own)
    plan = []
    for bin_ in allocate_micro_batches([cost for _, _, cost in items], config.max_tokens_per_mb):
        mb: dict[str, list[SharedChunk]] = {}
        for name in batches:
            own = [items[k][1] for k in bin_ if items[k][0] == name]
            if own:
                mb[name] = own
        plan.append(mb)
    return plan


@dataclass
class JointPart:
    """One policy's share of a joint step on one process: its part of the
    policy's batch and what ``MicroBatchRunner.accumulate`` takes with it
    (the whole batch's normalisers; ``seq_index``: the batch index of each
    trajectory of ``batch``, None when ``batch`` is the whole batch)."""

    adapter: str  # the peft adapter name
    batch: TrajectoryBatch
    loss_fn: Callable[..., Any]
    extra: dict[str, list[list[float]]] | None
    batch_loss_tokens: int
    batch_n_seqs: int
    seq_index: list[int] | None = None


def joint_accumulate(
    runner: "MicroBatchRunner", model: Any, parts: dict[str, JointPart]
) -> dict[str, AccumulateResult]:
    """Forward and backward of a joint step's micro-batches over ``parts``
    (policy name -> its share), every policy's gradients landing on its own
    adapter (module docstring); what ``MicroBatchRunner.accumulate`` is to
    one policy, with the same ``runner.hooks``. The caller makes the
    adapters' parameters trainable and zeroes their gradients first, and
    clips and steps each adapter after (``MicroBatchRunner.apply_gradients``
    once per policy, in the same order on every rank).

    With ``hooks.lockstep`` (ranks of a sharded model): every rank runs as
    many micro-batches as the busiest (fillers past its own), each with a
    backward, and every policy's adapter takes part in every forward (a zero
    share where the micro-batch holds none of its tokens), so that each
    backward reduces the same gradients on every rank."""
    import torch

    dev = runner.device
    lockstep = runner.hooks.lockstep
    names = list(parts)
    always = tuple(parts[n].adapter for n in names) if lockstep else ()
    fields, lengths, scalars, to_batch = {}, {}, {}, {}
    for name in names:
        part = parts[name]
        fields[name] = per_token_fields(part.batch, part.extra)
        lengths[name] = [len(x) for x in fields[name][0]]
        scalars[name] = {
            "batch_loss_tokens": torch.tensor(float(part.batch_loss_tokens), device=dev),
            "batch_n_seqs": torch.tensor(float(part.batch_n_seqs), device=dev),
        }
        if part.seq_index is not None:
            to_batch[name] = torch.tensor(part.seq_index or [0], dtype=torch.long, device=dev)
    plan = joint_plan(runner.config, {name: parts[name].batch for name in names if len(parts[name].batch)})
    acc = {name: AccumulateResult(n_mbs=sum(1 for mb in plan if name in mb)) for name in names}
    entropy_grad = {name: bool(getattr(parts[name].loss_fn, "needs_entropy_grad", False)) for name in names}
    for j in range(runner.hooks.micro_batch_count(len(plan))):
        if j >= len(plan):
            # A filler through every adapter: this rank's gradients join the others' reductions.
            with AdapterSegments(model, [(always[0], 0, FILLER_TOKENS)], always):
                (runner.filler_forward() * 0.0).sum().backward()
            continue
        mb = plan[j]
        held = [name for name in names if name in mb]
        rows: list[PackedRow] = []
        chunks: list[SharedChunk] = []
        union_ids: list[list[int]] = []
        seg_tokens: list[int] = []
        share = any(c.prefix_len > 0 for name in held for c in mb[name])
        for name in held:
            ids, floats, longs = fields[name]
            own = mb[name]
            row = pack_row(virtual_order(own), ids, floats, longs, dev)
            rows.append(row)
            off = len(union_ids)
            chunks.extend(SharedChunk(c.prefix_len, tuple(m + off for m in c.members)) for c in own)
            seg_tokens.append(sum(c.cost(lengths[name]) for c in own) if share else row.n_tokens)
            union_ids.extend(ids)
        tree = runner.tree(chunks, union_ids) if share else None
        segments, start = [], 0
        for name, n in zip(held, seg_tokens):
            segments.append((parts[name].adapter, start, start + n))
            start += n
        joint = _joint_row(rows)
        scored = torch.cat([r.data["loss_mask"] > 0 for r in rows])
        with AdapterSegments(model, segments, always):
            # Backward inside: gradient checkpointing runs the layers again there,
            # and they must route each policy's tokens to its adapter then too.
            logprobs, entropy = runner.forward(
                joint, entropy_grad=any(entropy_grad[n] for n in held), scored=scored, tree=tree
            )
            total = None
            at = 0
            for name, row, n_model in zip(held, rows, seg_tokens):
                n = row.n_tokens
                lp, ent = logprobs[at : at + n], entropy[at : at + n]
                at += n
                data = dict(row.data)
                if name in to_batch:
                    # Loss functions see batch-wide sequence ids, as in one process.
                    data["seq_ids"] = to_batch[name].index_select(0, data["seq_ids"])
                data.update(scalars[name])
                loss, mb_stats = parts[name].loss_fn(lp, ent if entropy_grad[name] else ent.detach(), data)
                value = float(loss.detach()) if torch.is_tensor(loss) else float(loss)
                a = acc[name]
                a.n_model_tokens += n_model
                if not a.finite:
                    continue  # this policy's step is skipped already
                if not math.isfinite(value):
                    a.finite, a.loss = False, value
                    continue  # kept out of the backward: a NaN would reach the others' gradients
                if torch.is_tensor(loss) and loss.requires_grad:
                    total = loss if total is None else total + loss
                a.loss += value
                with torch.no_grad():
                    a.entropy_sum += float((ent.detach() * data["loss_mask"]).sum())
                merge_stats(a.stats, mb_stats or {})
            if total is not None:
                total.backward()
            elif lockstep:
                (logprobs * 0.0).sum().backward()
    return acc


def one_at_a_time(views: "Mapping[str, TrainEngine]", jobs: dict[str, PolicyJob]) -> dict[str, dict[str, float]]:
    """The fallback of a joint step: one ``train_batch`` per policy on its
    view (``views``: policy name -> its ``TrainEngine``), each policy's
    statistics with ``joint`` 0.0."""
    out = {name: dict(views[name].train_batch(job.batch, job.loss_fn, job.extra)) for name, job in jobs.items()}
    for stats in out.values():
        stats["joint"] = 0.0
    return out


def train_together(engine: "TorchTrainEngine", jobs: dict[str, PolicyJob]) -> dict[str, dict[str, float]]:
    """One optimizer step of each policy in ``jobs`` (policy name -> job),
    in micro-batches that mix the policies' sequences (module docstring). Returns each policy's ``train_batch`` statistics, plus
    ``joint`` (1.0 when the forwards were shared, 0.0 when it fell back)."""
    views: dict[str, AdapterPolicy] = {name: engine.policy(name) for name in jobs}  # type: ignore[misc]
    for name, job in jobs.items():
        check_batch(job.batch, job.extra)
    runner = engine.require_model()
    model = engine.model
    if joint_refusal(runner, model, (j.batch for j in jobs.values())) is not None:
        return one_at_a_time(views, jobs)

    t0 = time.perf_counter()
    model.zero_grad(set_to_none=True)
    lrs = {name: v.set_lr() for name, v in views.items()}
    # peft trains the active adapter only; here every job's adapter trains.
    flags = [(p, p.requires_grad) for v in views.values() for _, p in v.adapter_parameters()]
    for p, _ in flags:
        p.requires_grad_(True)
    n_loss = {name: count_loss_tokens(job.batch) for name, job in jobs.items()}
    parts = {
        name: JointPart(views[name].peft_name, job.batch, job.loss_fn, job.extra, n_loss[name], len(job.batch))
        for name, job in jobs.items()
    }
    was_training = model.training
    model.train()
    try:
        acc = joint_accumulate(runner, model, parts)
        out: dict[str, dict[str, float]] = {}
        for name in jobs:
            view, a, batch = views[name], acc[name], jobs[name].batch
            grad_norm, applied = runner.apply_gradients(
                view.optimizer, a.finite, engine.config.max_grad_norm, params=(p for _, p in view.adapter_parameters())
            )
            view.optimizer.zero_grad(set_to_none=True)
            view.step += 1
            stats = a.step_stats(batch, n_loss[name], grad_norm=grad_norm, lr=lrs[name], applied=applied)
            stats["joint"] = 1.0
            out[name] = stats
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
        model.train(was_training)
    elapsed = time.perf_counter() - t0
    for stats in out.values():
        stats["step_time_s"] = elapsed
    return out
