"""The micro-batch runner: a causal LM over a ``TrajectoryBatch`` in packed
micro-batches, for scoring (logprobs, entropy) and for accumulating the
gradients of one optimizer step under the loss contract
(``areal_kernel.engine.torch_engine``).

It is shared by the built-in single-process engine and distributed engines
(areal-fsdp's ranks run it on their share of the batch). What distribution
changes is explicit, in ``MicroBatchHooks``:

- ``micro_batch_count(local)``: how many micro-batches this process runs. A
  sharded model gathers parameters in every forward and reduces gradients in
  every backward, so all ranks must run the same number: a rank with fewer
  runs 2-token *filler* micro-batches whose loss is 0.
- ``lockstep``: every micro-batch runs its forward *and* backward, even after
  a non-finite loss (then the step is skipped everywhere) and even when the
  loss has no gradient (a zero backward keeps the collectives in step). A
  single process stops at the first non-finite loss instead.
- ``all_finite(local)``: whether the step is finite on every rank.
- ``clip_grad_norm(params, max_norm)``: the *global* gradient norm before
  clipping, and the clipping itself.

The default hooks are those of one process. Losses see batch-wide
normalisers (``batch_loss_tokens``, ``batch_n_seqs``) and, with
``seq_index``, batch-wide ``seq_ids``, so summed gradients equal the
single-process gradient however the batch was split.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from areal_kernel.api.io import TrajectoryBatch
from areal_kernel.engine.packing import PackedRow, allocate_micro_batches, pack_row
from areal_kernel.engine.prefix_tree import (
    SharedChunk,
    TreeRow,
    allocate_shared_micro_batches,
    build_tree_row,
    virtual_order,
)
from areal_kernel.errors import DataError
from areal_kernel.platforms import current_platform

# The length of a filler micro-batch (``MicroBatchRunner.filler_forward``).
FILLER_TOKENS = 2

# One micro-batch: (batch indices in the order the row packs them, shared-prompt
# chunks or None when the micro-batch shares no prompt).
Plan = list[tuple[list[int], "list[SharedChunk] | None"]]


def check_batch(batch: TrajectoryBatch, extra: dict[str, list[list[float]]] | None = None) -> None:
    """``DataError`` naming the trajectory and field when ``batch`` (and the
    per-token ``extra`` rows) cannot be scored or trained on."""
    if len(batch) == 0:
        raise DataError("empty TrajectoryBatch: nothing to train on or score")
    for i, t in enumerate(batch.trajectories):
        n = len(t.input_ids)
        if n == 0:
            raise DataError(f"trajectory {i} has no tokens (input_ids is empty)")
        for name in ("loss_mask", "logprobs", "versions"):
            if len(getattr(t, name)) != n:
                raise DataError(f"trajectory {i}: {name} has length {len(getattr(t, name))}, expected {n}")
        if t.loss_mask[0]:
            raise DataError(
                f"trajectory {i}: loss_mask[0] is 1, but the first token has no context to be "
                "scored; it must be a prompt token (loss_mask 0)"
            )
    for key, rows in (extra or {}).items():
        if len(rows) != len(batch):
            raise DataError(f"extra[{key!r}] has {len(rows)} rows, expected {len(batch)} (one per trajectory)")
        for i, (row, t) in enumerate(zip(rows, batch.trajectories)):
            if len(row) != len(t.input_ids):
                raise DataError(
                    f"extra[{key!r}][{i}] has length {len(row)}, expected {len(t.input_ids)} (len(input_ids))"
                )


def count_loss_tokens(batch: TrajectoryBatch) -> int:
    """Tokens with ``loss_mask`` 1 in the whole batch; ``DataError`` when none."""
    n = sum(1 for t in batch.trajectories for m in t.loss_mask if m)
    if n == 0:
        raise DataError("the batch has no loss tokens (every loss_mask is 0): nothing to train on")
    return n


def merge_stats(acc: dict[str, float], new: dict[str, Any]) -> None:
    """Fold one micro-batch's (or rank's) ``loss_fn`` stats into ``acc``:
    summed, except keys ending in ``_max`` / ``_min`` (max / min)."""
    for k, v in new.items():
        v = float(v.detach()) if hasattr(v, "detach") else float(v)
        if k not in acc:
            acc[k] = v
        elif k.endswith("_max"):
            acc[k] = max(acc[k], v)
        elif k.endswith("_min"):
            acc[k] = min(acc[k], v)
        else:
            acc[k] += v


class MicroBatchHooks:
    """What a distributed engine changes in the micro-batch loop (see the
    module docstring). This base class is one process on its own."""

    lockstep: bool = False

    def micro_batch_count(self, local: int) -> int:
        """Micro-batches to run when this process planned ``local``."""
        return local

    def all_finite(self, local: bool) -> bool:
        """Whether the step's losses were finite in every process."""
        return local

    def clip_grad_norm(self, params: list[Any], max_norm: float | None) -> float:
        """The gradient norm over all processes before clipping; clips the
        gradients of ``params`` to ``max_norm`` (``None`` or <= 0: no clip)."""
        import torch

        clip = max_norm if (max_norm is not None and max_norm > 0) else float("inf")
        if not params:
            return 0.0
        return float(torch.nn.utils.clip_grad_norm_(params, clip, error_if_nonfinite=False))


@dataclass
class AccumulateResult:
    """What ``MicroBatchRunner.accumulate`` measured on this process's share."""

    loss: float = 0.0  # sum of the micro-batch losses (a share of the batch loss)
    entropy_sum: float = 0.0  # entropy summed over loss tokens
    stats: dict[str, float] = field(default_factory=dict)  # merged loss_fn stats
    finite: bool = True  # every loss was finite
    n_mbs: int = 0  # micro-batches with data (fillers not counted)
    n_model_tokens: int = 0  # tokens the model ran on (fewer than the batch's when prompts are shared)

    def step_stats(
        self, batch: TrajectoryBatch, n_loss_tokens: int, *, grad_norm: float, lr: float, applied: bool
    ) -> dict[str, float]:
        """A one-process engine's ``train_batch`` statistics for the step
        that accumulated this over ``batch`` (all but ``step_time_s``): the
        loss_fn's merged stats, then the step's own numbers."""
        out = dict(self.stats)
        out.update(
            loss=self.loss,
            grad_norm=grad_norm,
            lr=lr,
            skipped=0.0 if applied else 1.0,
            entropy=self.entropy_sum / n_loss_tokens,
            n_seqs=float(len(batch)),
            n_tokens=float(batch.n_tokens),
            n_loss_tokens=float(n_loss_tokens),
            n_mbs=float(self.n_mbs),
            n_model_tokens=float(self.n_model_tokens),
        )
        return out

    def part_answer(self, *, grad_norm: float, lr: float, applied: bool, step_time_s: float) -> dict[str, Any]:
        """What a rank answers for its share of one optimizer step: the sums
        ``RankedTrainEngine.merge_step_answers`` adds over the ranks (loss,
        entropy, the loss_fn's stats, micro-batches, model tokens) and the
        step's own numbers (the same on every rank)."""
        return {
            "loss": self.loss,
            "entropy_sum": self.entropy_sum,
            "stats": dict(self.stats),
            "grad_norm": grad_norm,
            "skipped": 0.0 if applied else 1.0,
            "lr": lr,
            "n_mbs": float(self.n_mbs),
            "n_model_tokens": float(self.n_model_tokens),
            "step_time_s": step_time_s,
        }


def per_token_fields(
    batch: TrajectoryBatch, extra: dict[str, list[list[float]]] | None = None
) -> tuple[list[list[int]], dict[str, list[list[float]]], dict[str, list[list[int]]]]:
    """The per-token inputs of a training pass over ``batch``: token ids per
    sequence, the float fields the loss reads (``loss_mask``,
    ``old_logprobs``, ``rewards``, ``seq_loss_tokens``, plus ``extra``) and
    the integer ones (``versions``), one list per sequence. Shared by every
    engine that packs rows (``MicroBatchRunner.accumulate``, the FSDP
    plugin's pipeline stages), so a new field reaches them all."""
    trajs = batch.trajectories
    loss_tokens = [int(sum(1 for m in t.loss_mask if m)) for t in trajs]
    ids = [list(t.input_ids) for t in trajs]
    float_fields: dict[str, list[list[float]]] = {
        "loss_mask": [[1.0 if m else 0.0 for m in t.loss_mask] for t in trajs],
        "old_logprobs": [list(t.logprobs) for t in trajs],
        "rewards": [[float(t.reward)] * len(t.input_ids) for t in trajs],
        "seq_loss_tokens": [[float(max(c, 1))] * len(t.input_ids) for c, t in zip(loss_tokens, trajs)],
    }
    float_fields.update(extra or {})
    long_fields = {"versions": [list(t.versions) for t in trajs]}
    return ids, float_fields, long_fields


class MicroBatchRunner:
    """Runs ``model`` over batches in micro-batches of at most
    ``config.max_tokens_per_mb`` tokens (``TorchEngineConfig`` fields:
    ``max_tokens_per_mb``, ``share_prompts``, ``temperature``,
    ``attn_implementation``, ``autocast_bf16``).

    ``split_head``: the runner may call the decoder and the LM head
    separately, the head on the scored positions only (most of the head's
    cost with large vocabularies). A sharded model must be called as a whole
    (its root unit gathers embedding, final norm and head), so FSDP passes
    ``False``; the head then still runs on the scored positions only where
    the model's forward takes transformers' ``logits_to_keep`` as a tensor
    of positions (``select_in_model``; the causal LM classes do). Subclasses
    with another head override ``forward`` (``areal_kernel.engine.scalar_head``).
    """

    # Whether a model called whole may be handed the scored positions
    # (``logits_to_keep``); a runner whose head input is laid out otherwise
    # (a tensor-parallel one) turns it off until it is checked there.
    select_in_model: bool = True

    def __init__(
        self, model: Any, config: Any, device: Any, *, hooks: MicroBatchHooks | None = None, split_head: bool = True
    ) -> None:
        self.model = model
        self.config = config
        self.device = device
        self.hooks = hooks or MicroBatchHooks()
        self.split_head = split_head
        # The whole-model call may take the scored positions as transformers'
        # ``logits_to_keep`` (the head then runs on those rows only).
        self.keeps_positions: bool = self.select_in_model and _forward_takes(model, "logits_to_keep")
        # Image files -> pixel tensors (``areal_kernel.models.vision.ImageTensors``)
        # for a vision-language model; engines set it after building the runner.
        self.vision: Any = None

    # ------------------------------------------------------------ planning
    def plan(self, batch: TrajectoryBatch) -> Plan:
        """``(virtual order, chunks)`` per micro-batch; ``chunks`` is None when
        the micro-batch shares no prompt (plain packing is then exact and cheaper)."""
        trajs = batch.trajectories
        if not trajs:
            return []
        ids = [t.input_ids for t in trajs]
        budget = self.config.max_tokens_per_mb
        # Prompt sharing is off for batches with images: a shared-prompt tree
        # row reorders sequences and keeps one copy of a shared prefix, and the
        # model fills image placeholders with image features strictly in token
        # order. Plain packing stays exact (1-D positions, per-image features).
        if not self.config.share_prompts or any(t.images is not None for t in trajs):
            return [(mb, None) for mb in allocate_micro_batches([len(x) for x in ids], budget)]
        plan: Plan = []
        for chunks in allocate_shared_micro_batches(ids, [t.loss_mask for t in trajs], budget):
            shared = any(c.prefix_len > 0 for c in chunks)
            plan.append((virtual_order(chunks), chunks if shared else None))
        return plan

    def tree(self, chunks: list[SharedChunk] | None, ids: list[list[int]]) -> TreeRow | None:
        """The shared-prompt tree row of a planned micro-batch (None without chunks)."""
        if chunks is None:
            return None
        import torch

        eager = self.config.attn_implementation == "eager"
        dtype = next(self.model.parameters()).dtype if eager else None
        if eager and self.config.autocast_bf16:
            dtype = torch.bfloat16
        return build_tree_row(chunks, ids, self.device, additive_mask_dtype=dtype)

    # ------------------------------------------------------------- forward
    def autocast(self) -> Any:
        """bf16 autocast on the platform's device when ``autocast_bf16`` is on."""
        import torch

        if not self.config.autocast_bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type=current_platform().device_type, dtype=torch.bfloat16)

    def head_split(self) -> tuple[Any, Any] | None:
        """(decoder, lm_head) when logits are exactly ``lm_head(decoder(x))``
        and ``split_head`` allows it; else ``None``."""
        if not self.split_head:
            return None
        m = self.model
        cfg = getattr(m, "config", None)
        if any(getattr(cfg, k, None) not in (None, 1.0) for k in ("final_logit_softcapping", "logit_scale")):
            return None
        get_dec = getattr(m, "get_decoder", None)
        head = m.get_output_embeddings() if hasattr(m, "get_output_embeddings") else None
        dec = get_dec() if get_dec is not None else None
        if self.vision is not None:
            # The text decoder alone cannot take images; the model's base
            # (vision tower + connector + text decoder) can, and returns hidden states.
            dec = getattr(m, "model", None)
        if dec is None or head is None or dec is m:
            return None
        return dec, head

    def image_kwargs(self, batch: TrajectoryBatch, order: list[int]) -> dict[str, Any]:
        """The forward's image keywords for the sequences ``order`` of ``batch``
        packed in that order ({} without images). ``DataError`` naming the
        trajectory when its placeholder tokens do not match its images."""
        trajs = [batch.trajectories[i] for i in order]
        if all(t.images is None for t in trajs):
            return {}
        if self.vision is None:
            raise DataError(
                "the batch has trajectories with images, but the train engine's model is not a "
                "vision-language model (its runner has no image processor)"
            )
        per_image = self.vision.tokens_per_image()
        for i, t in zip(order, trajs):
            n_ph = self.vision.count_placeholders(t.input_ids)
            n_img = len(t.images) if t.images is not None else 0
            if n_ph != n_img * per_image:
                raise DataError(
                    f"trajectory {i} ({t.sample_id or t.group_id or 'no id'}) has {n_ph} image placeholder "
                    f"tokens but {n_img} image(s) x {per_image} tokens each"
                )
        dtype = next(self.model.parameters()).dtype
        return self.vision.batch([t.images for t in trajs], dtype, self.device)

    def forward(
        self,
        row: PackedRow,
        *,
        entropy_grad: bool,
        scored: Any = None,
        tree: TreeRow | None = None,
        images: dict[str, Any] | None = None,
    ) -> tuple[Any, Any]:
        """Token-aligned logprobs (with grad if enabled) and entropy of one packed row.

        ``scored``: optional bool mask of the tokens whose logprob is needed
        (the loss tokens); the LM head and the vocabulary-wide softmax then run
        on those positions only (with ``head_split``), other entries are 0.
        ``tree``: run the model on the shared-prompt tree row instead of
        ``row`` (see ``prefix_tree``); outputs stay aligned with ``row``.
        ``images``: image keywords for the row's sequences in packing order
        (``image_kwargs``); never together with ``tree``."""
        import torch

        n = row.input_ids.shape[0]
        dev = row.input_ids.device
        wanted = ~row.seq_start if scored is None else (scored & ~row.seq_start)
        # Virtual token i is predicted by the hidden state of virtual token i-1.
        target_pos = torch.nonzero(wanted, as_tuple=False)[:, 0]
        pred_pos = target_pos - 1
        if tree is None:
            kwargs = dict(input_ids=row.input_ids[None], position_ids=row.position_ids[None])
        else:
            kwargs = dict(
                input_ids=tree.input_ids[None],
                position_ids=tree.position_ids[None],
                attention_mask=tree.attention_mask,
            )
            pred_pos = tree.virt_to_tree.index_select(0, pred_pos)
        if images:
            kwargs.update(images)
        elif self.vision is not None and self.hooks.lockstep:
            # Sharded ranks reduce gradients together: the vision tower must
            # get (zero) gradients on a rank whose micro-batch has no images too.
            kwargs.update(self.vision.blank_kwargs(next(self.model.parameters()).dtype, self.device))
        split = self.head_split()
        with self.autocast():
            if split is None and self.keeps_positions:
                # The model's own head on the scored positions only.
                logits = self.model(**kwargs, use_cache=False, logits_to_keep=pred_pos).logits[0]
            elif split is None:
                out = self.model(**kwargs, use_cache=False)  # no cache: required for exact packing
                logits = out.logits[0].index_select(0, pred_pos)
            else:
                decoder, head = split
                hidden = decoder(**kwargs, use_cache=False).last_hidden_state[0]
                logits = head(hidden.index_select(0, pred_pos))
        logits = logits.float()
        if self.config.temperature != 1.0:
            logits = logits / self.config.temperature
        labels = row.input_ids.index_select(0, target_pos)
        lp_sel, ent = self.token_scores(logits, labels, entropy_grad)
        logprobs = torch.zeros(n, dtype=lp_sel.dtype, device=dev).index_put((target_pos,), lp_sel)
        entropy = torch.zeros(n, dtype=ent.dtype, device=dev).index_put((target_pos,), ent)
        return logprobs, entropy

    def token_scores(self, logits: Any, labels: Any, entropy_grad: bool) -> tuple[Any, Any]:
        """Logprob of ``labels`` and entropy per row of ``logits`` (``(m, V)``,
        float, temperature applied); the entropy carries a gradient only with
        ``entropy_grad``. Subclasses whose logits are a slice of the
        vocabulary override it (``areal_fsdp.tensor_parallel.TensorRunner``)."""
        import torch

        lse = torch.logsumexp(logits, dim=-1)
        lp_sel = logits.gather(-1, labels[:, None])[:, 0] - lse
        ctx = contextlib.nullcontext() if entropy_grad else torch.no_grad()
        with ctx:
            z = logits if entropy_grad else logits.detach()
            l = lse if entropy_grad else lse.detach()
            ent = l - (torch.softmax(z, dim=-1) * z).sum(-1)
        return lp_sel, ent

    def filler_forward(self, entropy_grad: bool = False) -> Any:
        """A 2-token forward that only keeps this process in step with
        processes that have more micro-batches; returns its logprobs."""
        row = pack_row([0], [[0] * FILLER_TOKENS], {}, {}, self.device)
        lp, _ = self.forward(row, entropy_grad=entropy_grad)
        return lp

    # ------------------------------------------------------------- scoring
    def score(
        self, batch: TrajectoryBatch, only_loss_tokens: bool = False
    ) -> tuple[list[list[float]], list[list[float]]]:
        """Per-token logprobs and entropies of every trajectory under the
        current weights (no gradients; the model's train/eval mode is
        restored). ``only_loss_tokens``: score loss tokens only (others 0.0)."""
        import torch

        trajs = batch.trajectories
        ids = [t.input_ids for t in trajs]
        out_lp: list[list[float]] = [[] for _ in ids]
        out_ent: list[list[float]] = [[] for _ in ids]
        plan = self.plan(batch)
        n_mbs = self.hooks.micro_batch_count(len(plan))
        masks = {"loss_mask": [[1.0 if m else 0.0 for m in t.loss_mask] for t in trajs]} if only_loss_tokens else {}
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for j in range(n_mbs):
                    if j >= len(plan):
                        self.filler_forward()
                        continue
                    mb, chunks = plan[j]
                    tree = self.tree(chunks, ids)
                    row = pack_row(mb, ids, masks, {}, self.device)
                    scored = row.data["loss_mask"] > 0 if only_loss_tokens else None
                    images = self.image_kwargs(batch, list(row.seq_index))
                    lp, ent = self.forward(row, entropy_grad=False, scored=scored, tree=tree, images=images)
                    lp_l, ent_l = lp.cpu().tolist(), ent.cpu().tolist()
                    for k, i in enumerate(row.seq_index):
                        a, b = row.cu_seqlens[k], row.cu_seqlens[k + 1]
                        out_lp[i] = lp_l[a:b]
                        out_ent[i] = ent_l[a:b]
        finally:
            self.model.train(was_training)
        return out_lp, out_ent

    # ------------------------------------------------------------ training
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
        """Forward and backward of every micro-batch of ``batch`` (gradients
        accumulate in the model; the caller zeroes them first and steps after,
        see ``apply_gradients``). ``batch_loss_tokens`` / ``batch_n_seqs``
        describe the whole batch (of which ``batch`` may be one rank's share);
        ``seq_index[i]``: the batch index of ``batch``'s trajectory ``i``."""
        import torch

        ids, float_fields, long_fields = per_token_fields(batch, extra)
        dev = self.device
        batch_scalars = {
            "batch_loss_tokens": torch.tensor(float(batch_loss_tokens), device=dev),
            "batch_n_seqs": torch.tensor(float(batch_n_seqs), device=dev),
        }
        to_batch = None if seq_index is None else torch.tensor(seq_index or [0], dtype=torch.long, device=dev)
        entropy_grad = bool(getattr(loss_fn, "needs_entropy_grad", False))
        lockstep = self.hooks.lockstep

        plan = self.plan(batch)
        n_mbs = self.hooks.micro_batch_count(len(plan))
        res = AccumulateResult(n_mbs=len(plan))
        for j in range(n_mbs):
            if j >= len(plan):
                (self.filler_forward() * 0.0).sum().backward()
                continue
            mb, chunks = plan[j]
            row = pack_row(mb, ids, float_fields, long_fields, dev)
            tree = self.tree(chunks, ids)
            res.n_model_tokens += (tree or row).n_tokens
            data = dict(row.data)
            if to_batch is not None:
                # Loss functions see batch-wide sequence ids, as in one process.
                data["seq_ids"] = to_batch.index_select(0, data["seq_ids"])
            data.update(batch_scalars)
            images = self.image_kwargs(batch, list(row.seq_index))
            logprobs, entropy = self.forward(
                row, entropy_grad=entropy_grad, scored=data["loss_mask"] > 0, tree=tree, images=images
            )
            loss, mb_stats = loss_fn(logprobs, entropy, data)
            loss_val = float(loss.detach()) if torch.is_tensor(loss) else float(loss)
            if not math.isfinite(loss_val):
                res.finite = False
                if not lockstep:
                    res.loss = loss_val
                    break  # the step is skipped anyway; do not waste the rest
            if torch.is_tensor(loss) and loss.requires_grad:
                loss.backward()
            elif lockstep:
                (logprobs * 0.0).sum().backward()
            res.loss += loss_val
            with torch.no_grad():
                res.entropy_sum += float((entropy.detach() * data["loss_mask"]).sum())
            merge_stats(res.stats, mb_stats or {})
        return res

    def apply_gradients(
        self, optimizer: Any, finite: bool, max_grad_norm: float | None, params: Iterable[Any] | None = None
    ) -> tuple[float, bool]:
        """Clip and step when the step is finite everywhere, else drop the
        gradients (weights and optimizer moments untouched). The norm is
        over ``params`` (default: every parameter of the model), counting
        those with a gradient; ``optimizer`` should step those. Returns
        ``(grad_norm before clipping, applied)``."""
        finite = self.hooks.all_finite(finite)
        grad_norm = float("nan")
        if finite:
            pool = self.model.parameters() if params is None else params
            params = [p for p in pool if p.grad is not None]
            grad_norm = self.hooks.clip_grad_norm(params, max_grad_norm)
            finite = math.isfinite(grad_norm)
        if finite:
            optimizer.step()
        else:
            optimizer.zero_grad(set_to_none=True)
        return grad_norm, finite


def _forward_takes(model: Any, name: str) -> bool:
    """Whether ``model``'s class's ``forward`` has a parameter ``name``."""
    import inspect

    try:
        return name in inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError, AttributeError):
        return False
