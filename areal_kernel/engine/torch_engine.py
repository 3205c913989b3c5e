"""``TorchTrainEngine``: the built-in single-process PyTorch train engine.

One HF causal LM on ``current_platform().device()``, AdamW, a warm-up + decay
lr schedule, micro-batching by token budget with sequence packing, optional
bf16 autocast and gradient checkpointing.

Loss contract (what ``train_batch`` promises ``loss_fn`` and expects back)
--------------------------------------------------------------------------
``loss_fn(logprobs, entropy, data) -> (loss, stats)`` is called once per
micro-batch. All tensors are 1-D and aligned with the packed row (the
micro-batch's sequences concatenated):

* ``logprobs[i]`` = log p(token i | tokens before it in its own sequence),
  computed as ``log_softmax(logits / temperature)``; 0.0 at each sequence's
  first token. Carries gradients.
* ``entropy[i]``: entropy of the distribution that produced token i (0.0 at
  sequence starts). Detached unless ``loss_fn.needs_entropy_grad`` is True.
* ``data``: ``input_ids``, ``position_ids``, ``seq_ids`` (batch index of the
  token's trajectory), ``versions`` (int64), and float32 ``loss_mask`` (0/1),
  ``old_logprobs`` (= ``Trajectory.logprobs``, the behaviour policy),
  ``rewards`` (the trajectory reward on every token), ``seq_loss_tokens``
  (loss tokens of the token's trajectory), every key of ``extra`` (e.g.
  ``advantages``, ``prox_logprobs``, ``ref_logprobs``), and two 0-d float32
  tensors describing the *whole batch*: ``batch_loss_tokens`` and
  ``batch_n_seqs``.

``loss`` must be this micro-batch's *share* of the batch loss, i.e. a sum of
per-token terms normalised by batch-level quantities, e.g.
``(tok_loss * loss_mask).sum() / batch_loss_tokens`` (token mean) or
``(tok_loss * loss_mask / seq_loss_tokens).sum() / batch_n_seqs`` (sequence
mean of token means). The engine back-propagates each share and sums them, so
the step does not depend on how the batch was split into micro-batches.
``stats`` follow the same rule: values are summed over micro-batches, except
keys ending in ``_max`` / ``_min`` (max / min).

Weight transfer: ``send_weights`` with ``kind="disk"`` writes an HF dir at
``meta.path``; with ``kind="broadcast"`` it streams
``named_weights_for_transfer()`` through
``areal_kernel.weights.broadcast.send_buckets`` over the group in
``meta.extra["group"]`` or, if absent, the group made by
``init_weight_group(...)``.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import tempfile
import time
import uuid
from typing import Any, Callable

from areal_kernel.api.engine import TrainEngine, WeightUpdateMeta
from areal_kernel.api.io import TrajectoryBatch
from areal_kernel.engine.config import TorchEngineConfig
from areal_kernel.engine.lr_schedule import lr_factor
from areal_kernel.engine.optimizer_state import load_optimizer_state, save_optimizer_state
from areal_kernel.engine.packing import PackedRow, allocate_micro_batches, pack_row
from areal_kernel.engine.prefix_tree import (
    SharedChunk,
    TreeRow,
    allocate_shared_micro_batches,
    build_tree_row,
    virtual_order,
)
from areal_kernel.errors import ArealError, ConfigError, DataError
from areal_kernel.platforms import current_platform

# Files never copied from the source model dir into an exported HF dir:
# weights are re-written by save_pretrained, config.json too.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".index.json")
_STATE_FORMAT = 1


def _atomic_replace_dir(tmp: str, dst: str) -> None:
    """Move the finished directory ``tmp`` to ``dst``. A directory rename is
    atomic; an existing ``dst`` is moved aside first and deleted after, so a
    reader never sees a half-written ``dst``."""
    if not os.path.exists(dst):
        os.rename(tmp, dst)
        return
    old = f"{dst}.old-{uuid.uuid4().hex[:8]}"
    os.rename(dst, old)
    os.rename(tmp, dst)
    shutil.rmtree(old, ignore_errors=True)


def _tmp_dir_beside(path: str) -> str:
    parent = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(path))}.tmp-", dir=parent)


class TorchTrainEngine(TrainEngine):
    """Single-process train engine; see the module docstring for the loss contract."""

    def __init__(self, config: TorchEngineConfig | dict[str, Any] | None = None) -> None:
        self.config = TorchEngineConfig.parse(config)
        self.model: Any = None
        self.optimizer: Any = None
        self.model_path: str | None = None
        self.total_train_steps = 0
        self._step = 0  # optimizer steps taken (skipped ones included): drives the lr schedule
        self._version = 0
        self._weight_group: Any = None

    # ------------------------------------------------------------------ setup
    @property
    def device(self) -> Any:
        return current_platform().device()

    @property
    def temperature(self) -> float:
        return self.config.temperature

    @property
    def step(self) -> int:
        return self._step

    def initialize(self, model_path: str, total_train_steps: int) -> None:
        import torch

        if not os.path.isfile(os.path.join(model_path, "config.json")):
            raise ConfigError(
                f"model_path {model_path!r} is not an HF model directory (no config.json); "
                "pass a local directory written by save_pretrained"
            )
        if total_train_steps < 1:
            raise ConfigError(f"total_train_steps must be >= 1, got {total_train_steps}")
        from transformers.utils import logging as hf_logging

        # Per-tensor loading/writing bars would interleave with the trainer's
        # progress line; the engine reports its own timings.
        hf_logging.disable_progress_bar()
        cfg = self.config
        current_platform().manual_seed(cfg.seed)
        dtype = torch.float32 if cfg.param_dtype == "float32" else torch.bfloat16
        model = self._load_model(model_path, dtype)
        model.to(self.device)
        if cfg.gradient_checkpointing:
            # Non-reentrant checkpointing gives the same gradients and works
            # with inputs that do not require grad.
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        self.model = model
        self.model_path = os.path.abspath(model_path)
        self.total_train_steps = int(total_train_steps)
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=cfg.lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
        )
        self._step = 0
        self._set_lr()

    def _load_model(self, model_path: str, dtype: Any) -> Any:
        """The HF model to train; subclasses with another head override it
        (``areal_kernel.engine.scalar_head``)."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(
            model_path, dtype=dtype, attn_implementation=self.config.attn_implementation
        )

    def _require_init(self) -> None:
        if self.model is None:
            raise ArealError("TorchTrainEngine is not initialized: call initialize(model_path, total_train_steps)")

    def current_lr(self) -> float:
        c = self.config
        return c.lr * lr_factor(
            self._step,
            self.total_train_steps,
            scheduler=c.lr_scheduler,
            warmup_steps_proportion=c.warmup_steps_proportion,
            min_lr_ratio=c.min_lr_ratio,
        )

    def _set_lr(self) -> float:
        lr = self.current_lr()
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        return lr

    # --------------------------------------------------------------- batching
    def _check_batch(self, batch: TrajectoryBatch, extra: dict[str, list[list[float]]] | None) -> None:
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

    def _micro_batches(self, batch: TrajectoryBatch) -> list[list[int]]:
        """Batch indices per micro-batch, in the order each virtual row packs them."""
        return [order for order, _ in self._plan(batch)]

    def _plan(self, batch: TrajectoryBatch) -> list[tuple[list[int], list[SharedChunk] | None]]:
        """``(virtual order, chunks)`` per micro-batch; ``chunks`` is None when the
        micro-batch shares no prompt (plain packing is then exact and cheaper)."""
        trajs = batch.trajectories
        ids = [t.input_ids for t in trajs]
        budget = self.config.max_tokens_per_mb
        if not self.config.share_prompts:
            return [(mb, None) for mb in allocate_micro_batches([len(x) for x in ids], budget)]
        plan = []
        for chunks in allocate_shared_micro_batches(ids, [t.loss_mask for t in trajs], budget):
            shared = any(c.prefix_len > 0 for c in chunks)
            plan.append((virtual_order(chunks), chunks if shared else None))
        return plan

    def _tree(self, chunks: list[SharedChunk] | None, ids: list[list[int]]) -> TreeRow | None:
        if chunks is None:
            return None
        import torch

        eager = self.config.attn_implementation == "eager"
        dtype = next(self.model.parameters()).dtype if eager else None
        if eager and self.config.autocast_bf16:
            dtype = torch.bfloat16
        return build_tree_row(chunks, ids, self.device, additive_mask_dtype=dtype)

    def _autocast(self) -> Any:
        import torch

        if not self.config.autocast_bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type=current_platform().device_type, dtype=torch.bfloat16)

    def _head_split(self) -> tuple[Any, Any] | None:
        """(decoder, lm_head) when logits are exactly ``lm_head(decoder(x))``,
        so the head can run on the scored positions only; else ``None``."""
        m = self.model
        cfg = getattr(m, "config", None)
        if any(getattr(cfg, k, None) not in (None, 1.0) for k in ("final_logit_softcapping", "logit_scale")):
            return None
        get_dec = getattr(m, "get_decoder", None)
        head = m.get_output_embeddings() if hasattr(m, "get_output_embeddings") else None
        dec = get_dec() if get_dec is not None else None
        if dec is None or head is None or dec is m:
            return None
        return dec, head

    def _forward(
        self, row: PackedRow, *, entropy_grad: bool, scored: Any = None, tree: TreeRow | None = None
    ) -> tuple[Any, Any]:
        """Token-aligned logprobs (with grad if enabled) and entropy of one packed row.

        ``scored``: optional bool mask of the tokens whose logprob is needed
        (the loss tokens). The LM head and the vocabulary-wide softmax then run
        on those positions only; other entries are 0. With ~50k-word
        vocabularies and prompts longer than answers this is most of the
        head's cost. ``tree``: run the model on the shared-prompt tree row
        instead of ``row`` (see ``prefix_tree``); outputs stay aligned with
        ``row``."""
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
        split = self._head_split()
        with self._autocast():
            if split is None:
                out = self.model(**kwargs, use_cache=False)  # no cache: required for exact packing
                logits = out.logits[0].index_select(0, pred_pos)
            else:
                decoder, head = split
                hidden = decoder(**kwargs, use_cache=False).last_hidden_state[0]
                logits = head(hidden.index_select(0, pred_pos))
        logits = logits.float()
        if self.config.temperature != 1.0:
            logits = logits / self.config.temperature
        lse = torch.logsumexp(logits, dim=-1)
        labels = row.input_ids.index_select(0, target_pos)
        lp_sel = logits.gather(-1, labels[:, None])[:, 0] - lse
        logprobs = torch.zeros(n, dtype=lp_sel.dtype, device=dev).index_put((target_pos,), lp_sel)
        ctx = contextlib.nullcontext() if entropy_grad else torch.no_grad()
        with ctx:
            z = logits if entropy_grad else logits.detach()
            l = lse if entropy_grad else lse.detach()
            ent = l - (torch.softmax(z, dim=-1) * z).sum(-1)
            entropy = torch.zeros(n, dtype=ent.dtype, device=dev).index_put((target_pos,), ent)
        return logprobs, entropy

    def _score(self, batch: TrajectoryBatch, only_loss_tokens: bool = False) -> tuple[list[list[float]], list[list[float]]]:
        import torch

        self._require_init()
        self._check_batch(batch, None)
        ids = [t.input_ids for t in batch.trajectories]
        out_lp: list[list[float]] = [[] for _ in ids]
        out_ent: list[list[float]] = [[] for _ in ids]
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for mb, chunks in self._plan(batch):
                    tree = self._tree(chunks, ids)
                    if only_loss_tokens:
                        masks = {"loss_mask": [[1.0 if m else 0.0 for m in t.loss_mask] for t in batch.trajectories]}
                        row = pack_row(mb, ids, masks, {}, self.device)
                        lp, ent = self._forward(row, entropy_grad=False, scored=row.data["loss_mask"] > 0, tree=tree)
                    else:
                        row = pack_row(mb, ids, {}, {}, self.device)
                        lp, ent = self._forward(row, entropy_grad=False, tree=tree)
                    lp_l, ent_l = lp.cpu().tolist(), ent.cpu().tolist()
                    for k, i in enumerate(row.seq_index):
                        a, b = row.cu_seqlens[k], row.cu_seqlens[k + 1]
                        out_lp[i] = lp_l[a:b]
                        out_ent[i] = ent_l[a:b]
        finally:
            self.model.train(was_training)
        return out_lp, out_ent

    def compute_logprobs(self, batch: TrajectoryBatch, only_loss_tokens: bool = False) -> list[list[float]]:
        """Per-token logprobs under the current weights (entry 0 of each row is 0.0).
        ``only_loss_tokens``: score only tokens with loss_mask 1 (others 0.0), cheaper."""
        return self._score(batch, only_loss_tokens)[0]

    def compute_logprobs_and_entropy(self, batch: TrajectoryBatch) -> tuple[list[list[float]], list[list[float]]]:
        """Like ``compute_logprobs``, plus the per-token entropy (for statistics)."""
        return self._score(batch)

    # --------------------------------------------------------------- training
    def train_batch(
        self,
        batch: TrajectoryBatch,
        loss_fn: Callable[..., Any],
        extra: dict[str, list[list[float]]] | None = None,
    ) -> dict[str, float]:
        """One optimizer step over ``batch`` (see the module docstring for the
        ``loss_fn`` contract). Returns the summed ``loss_fn`` stats plus
        ``loss``, ``grad_norm`` (before clipping), ``lr``, ``skipped`` (1 when
        the loss or grad norm was NaN/inf and the step was not applied),
        ``entropy`` (mean over loss tokens), ``n_seqs``, ``n_tokens``,
        ``n_loss_tokens``, ``n_mbs``, ``n_model_tokens`` (tokens the model ran on, fewer than
        ``n_tokens`` when prompts are shared) and ``step_time_s``."""
        import torch

        self._require_init()
        self._check_batch(batch, extra)
        t0 = time.perf_counter()
        trajs = batch.trajectories
        loss_tokens = [int(sum(1 for m in t.loss_mask if m)) for t in trajs]
        n_loss_tokens = sum(loss_tokens)
        if n_loss_tokens == 0:
            raise DataError("the batch has no loss tokens (every loss_mask is 0): nothing to train on")
        ids = [t.input_ids for t in trajs]
        float_fields: dict[str, list[list[float]]] = {
            "loss_mask": [[1.0 if m else 0.0 for m in t.loss_mask] for t in trajs],
            "old_logprobs": [list(t.logprobs) for t in trajs],
            "rewards": [[float(t.reward)] * len(t.input_ids) for t in trajs],
            "seq_loss_tokens": [[float(max(c, 1))] * len(t.input_ids) for c, t in zip(loss_tokens, trajs)],
        }
        for key, rows in (extra or {}).items():
            float_fields[key] = rows
        long_fields = {"versions": [list(t.versions) for t in trajs]}
        dev = self.device
        batch_scalars = {
            "batch_loss_tokens": torch.tensor(float(n_loss_tokens), device=dev),
            "batch_n_seqs": torch.tensor(float(len(trajs)), device=dev),
        }
        entropy_grad = bool(getattr(loss_fn, "needs_entropy_grad", False))

        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self._set_lr()
        mbs = self._plan(batch)
        total_loss = 0.0
        entropy_sum = 0.0
        stats: dict[str, float] = {}
        finite = True
        model_tokens = 0
        for mb, chunks in mbs:
            row = pack_row(mb, ids, float_fields, long_fields, dev)
            tree = self._tree(chunks, ids)
            model_tokens += (tree or row).n_tokens
            data = dict(row.data)
            data.update(batch_scalars)
            logprobs, entropy = self._forward(
                row, entropy_grad=entropy_grad, scored=data["loss_mask"] > 0, tree=tree
            )
            loss, mb_stats = loss_fn(logprobs, entropy, data)
            loss_val = float(loss.detach()) if torch.is_tensor(loss) else float(loss)
            if not math.isfinite(loss_val):
                finite = False
                total_loss = loss_val
                break  # the step is skipped anyway; do not waste the rest
            if torch.is_tensor(loss) and loss.requires_grad:
                loss.backward()
            total_loss += loss_val
            with torch.no_grad():
                entropy_sum += float((entropy.detach() * data["loss_mask"]).sum())
            self._merge_stats(stats, mb_stats or {})

        grad_norm = float("nan")
        if finite:
            max_norm = self.config.max_grad_norm
            clip = max_norm if (max_norm is not None and max_norm > 0) else float("inf")
            params = [p for p in self.model.parameters() if p.grad is not None]
            if params:
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip, error_if_nonfinite=False))
            else:
                grad_norm = 0.0
            finite = math.isfinite(grad_norm)
        if finite:
            self.optimizer.step()
        else:
            # Leave weights and optimizer moments untouched.
            self.optimizer.zero_grad(set_to_none=True)
        self._step += 1
        current_platform().synchronize()

        out = dict(stats)
        out.update(
            loss=total_loss,
            grad_norm=grad_norm,
            lr=lr,
            skipped=0.0 if finite else 1.0,
            entropy=entropy_sum / n_loss_tokens,
            n_seqs=float(len(trajs)),
            n_tokens=float(batch.n_tokens),
            n_loss_tokens=float(n_loss_tokens),
            n_mbs=float(len(mbs)),
            n_model_tokens=float(model_tokens),
            step_time_s=time.perf_counter() - t0,
        )
        return out

    @staticmethod
    def _merge_stats(acc: dict[str, float], new: dict[str, Any]) -> None:
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

    # ---------------------------------------------------------------- weights
    def named_weights_for_transfer(self) -> list[tuple[str, Any]]:
        """(HF name, tensor) pairs of the model's state dict with tied aliases
        dropped (the first name of a shared storage is kept, e.g.
        ``model.embed_tokens.weight`` and not ``lm_head.weight``), exactly what
        ``from_pretrained`` / ``load_state_dict(strict=False)`` accept.
        Tensors are detached views of the live weights, not copies."""
        self._require_init()
        seen: set[tuple[int, tuple[int, ...], str]] = set()
        out: list[tuple[str, Any]] = []
        for name, t in self.model.state_dict().items():
            key = (t.data_ptr(), tuple(t.shape), str(t.dtype))
            if t.numel() > 0 and key in seen:
                continue
            seen.add(key)
            out.append((name, t.detach()))
        return out

    def weight_transfer_meta(self) -> list[dict[str, Any]]:
        """``[{"name", "dtype", "shape"}]`` of ``named_weights_for_transfer()``
        in send order: what broadcast receivers need before ``recv_buckets``."""
        from areal_kernel.weights.broadcast import tensor_meta

        return tensor_meta(self.named_weights_for_transfer())

    def save_hf(self, path: str) -> None:
        """Write an HF model dir (config, safetensors, tokenizer/generation
        files copied from the source dir), atomically: a temporary sibling dir
        is renamed onto ``path`` only once complete."""
        self._require_init()
        tmp = _tmp_dir_beside(path)
        try:
            self.model.save_pretrained(tmp)
            src = self.model_path
            if src and os.path.isdir(src):
                for name in os.listdir(src):
                    s = os.path.join(src, name)
                    if (
                        not os.path.isfile(s)
                        or name.endswith(_WEIGHT_SUFFIXES)
                        or os.path.exists(os.path.join(tmp, name))
                    ):
                        continue
                    shutil.copy2(s, os.path.join(tmp, name))
            _atomic_replace_dir(tmp, os.path.abspath(path))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def init_weight_group(
        self,
        master_addr: str,
        master_port: int,
        world_size: int,
        rank: int = 0,
        group_name: str = "areal_weights",
        backend: str | None = None,
        timeout_s: float = 300,
    ) -> Any:
        """Join the weight-broadcast group (this engine is the sender, rank 0
        by convention) and keep it for ``send_weights(kind="broadcast")``."""
        from areal_kernel.weights.broadcast import init_weight_group

        self._weight_group = init_weight_group(
            master_addr, master_port, world_size, rank, group_name, backend=backend, timeout_s=timeout_s
        )
        return self._weight_group

    def send_weights(self, meta: WeightUpdateMeta) -> None:
        self._require_init()
        if meta.kind == "disk":
            if not meta.path:
                raise ConfigError("WeightUpdateMeta.path is required for kind='disk'")
            self.save_hf(meta.path)
        elif meta.kind == "broadcast":
            group = meta.extra.get("group", self._weight_group)
            if group is None:
                raise ArealError(
                    "kind='broadcast' needs a process group: call engine.init_weight_group(...) first "
                    "or pass WeightUpdateMeta.extra['group']"
                )
            from areal_kernel.weights.broadcast import send_buckets

            send_buckets(group, self.named_weights_for_transfer(), meta.bucket_bytes)
            current_platform().synchronize()
        else:
            raise ConfigError(f"WeightUpdateMeta.kind={meta.kind!r} is not supported; valid: 'disk', 'broadcast'")

    # ------------------------------------------------------------- checkpoint
    def save_state(self, path: str) -> None:
        """Model, optimizer, lr-schedule step, version and RNG states, for exact
        recovery. Tensors in safetensors, the rest in JSON; written atomically."""
        import torch
        from safetensors.torch import save_file

        self._require_init()
        tmp = _tmp_dir_beside(path)
        try:
            save_file(
                {n: t.contiguous() for n, t in self.named_weights_for_transfer()},
                os.path.join(tmp, "model.safetensors"),
            )
            opt = save_optimizer_state(self.optimizer, os.path.join(tmp, "optimizer.safetensors"))
            rng = {"torch_cpu": torch.get_rng_state()}
            dev_rng = current_platform().device_rng_state()
            if dev_rng is not None:
                rng["device"] = dev_rng
            save_file(rng, os.path.join(tmp, "rng.safetensors"))
            meta = {
                "format": _STATE_FORMAT,
                "step": self._step,
                "version": self.get_version(),
                "total_train_steps": self.total_train_steps,
                "param_names": [n for n, _ in self.model.named_parameters()],
                "optimizer_param_groups": opt["param_groups"],
                "optimizer_scalars": opt["scalars"],
                "python_random": _py_random_state_to_json(random.getstate()),
                "config": self.config.model_dump(),
            }
            with open(os.path.join(tmp, "engine_state.json"), "w") as f:
                json.dump(meta, f, indent=1)
            _atomic_replace_dir(tmp, os.path.abspath(path))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def load_state(self, path: str) -> None:
        """Restore what ``save_state`` wrote into an initialized engine of the
        same architecture."""
        import torch
        from safetensors.torch import load_file

        self._require_init()
        meta_path = os.path.join(path, "engine_state.json")
        if not os.path.isfile(meta_path):
            raise DataError(f"{path!r} is not an engine checkpoint (no engine_state.json)")
        with open(meta_path) as f:
            meta = json.load(f)
        if meta.get("format") != _STATE_FORMAT:
            raise DataError(f"{meta_path}: unsupported checkpoint format {meta.get('format')!r}")
        names = [n for n, _ in self.model.named_parameters()]
        if meta["param_names"] != names:
            raise DataError(f"{path!r} was saved from a different model architecture (parameter names differ)")

        dev = self.device
        weights = load_file(os.path.join(path, "model.safetensors"), device=str(dev))
        expected = {n for n, _ in self.named_weights_for_transfer()}
        if set(weights) != expected:
            raise DataError(
                f"{path}/model.safetensors: tensor names differ from the model "
                f"(missing {sorted(expected - set(weights))[:3]}, unexpected {sorted(set(weights) - expected)[:3]})"
            )
        with torch.no_grad():
            self.model.load_state_dict(weights, strict=False)

        load_optimizer_state(
            self.optimizer,
            os.path.join(path, "optimizer.safetensors"),
            {"param_groups": meta["optimizer_param_groups"], "scalars": meta["optimizer_scalars"]},
            str(dev),
        )

        rng = load_file(os.path.join(path, "rng.safetensors"))
        torch.set_rng_state(rng["torch_cpu"])
        current_platform().set_device_rng_state(rng.get("device"))
        random.setstate(_py_random_state_from_json(meta["python_random"]))
        self._step = int(meta["step"])
        self._version = int(meta["version"])
        self._set_lr()

    def destroy(self) -> None:
        self.model = None
        self.optimizer = None
        self._weight_group = None
        current_platform().empty_cache()


def _py_random_state_to_json(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _py_random_state_from_json(data: list) -> tuple:
    version, internal, gauss = data
    return (version, tuple(internal), gauss)
