"""``TorchCriticEngine``: a value model for PPO on the torch train engine's settings.

A separate module (and a separate model) so the actor path is untouched: the
critic is the same HF causal LM's decoder with a scalar head in place of the
LM head, trained with ``areal_kernel.algo.losses.value_loss`` by AdamW on the
same micro-batching (``max_tokens_per_mb``) and lr schedule as the actor.

Alignment: ``values[i]`` is the value of the state in which token ``i`` was
chosen, i.e. the head applied to the hidden state at position ``i - 1``
(0.0 at each sequence's first token), like ``logprobs[i]``.
"""

from __future__ import annotations

import math
from typing import Any

from areal_kernel.api.io import TrajectoryBatch
from areal_kernel.engine.config import TorchEngineConfig
from areal_kernel.engine.lr_schedule import lr_factor
from areal_kernel.engine.optimizer_state import load_optimizer_state, save_optimizer_state
from areal_kernel.engine.packing import PackedRow, allocate_micro_batches, pack_row
from areal_kernel.errors import ArealError, ConfigError, DataError
from areal_kernel.platforms import current_platform


class TorchCriticEngine:
    """Value model: ``compute_values`` (no grad) and ``train_values`` (one step)."""

    def __init__(self, config: TorchEngineConfig | dict[str, Any] | None = None) -> None:
        self.config = TorchEngineConfig.parse(config)
        self.decoder: Any = None
        self.head: Any = None
        self.optimizer: Any = None
        self.total_train_steps = 0
        self._step = 0

    @property
    def device(self) -> Any:
        return current_platform().device()

    def initialize(self, model_path: str, total_train_steps: int) -> None:
        import os

        import torch
        from transformers import AutoModelForCausalLM

        if not os.path.isfile(os.path.join(model_path, "config.json")):
            raise ConfigError(f"critic model_path {model_path!r} is not an HF model directory (no config.json)")
        if total_train_steps < 1:
            raise ConfigError(f"total_train_steps must be >= 1, got {total_train_steps}")
        cfg = self.config
        current_platform().manual_seed(cfg.seed)
        dtype = torch.float32 if cfg.param_dtype == "float32" else torch.bfloat16
        lm = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation=cfg.attn_implementation)
        decoder = lm.get_decoder()
        hidden = int(lm.config.hidden_size)
        del lm  # only the decoder is kept; the LM head is not needed
        decoder.to(self.device)
        if cfg.gradient_checkpointing:
            decoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        decoder.train()
        # A zero head: initial values are 0, so the first GAE advantages are the
        # plain (discounted) returns rather than noise from a random head.
        head = torch.nn.Linear(hidden, 1, dtype=torch.float32, device=self.device)
        torch.nn.init.zeros_(head.weight)
        torch.nn.init.zeros_(head.bias)
        self.decoder, self.head = decoder, head
        self.total_train_steps = int(total_train_steps)
        self.optimizer = torch.optim.AdamW(
            list(decoder.parameters()) + list(head.parameters()),
            lr=cfg.lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
        )
        self._step = 0

    def _require_init(self) -> None:
        if self.decoder is None:
            raise ArealError("TorchCriticEngine is not initialized: call initialize(model_path, total_train_steps)")

    def _values(self, row: PackedRow) -> Any:
        import contextlib

        import torch

        ctx = (
            torch.autocast(device_type=current_platform().device_type, dtype=torch.bfloat16)
            if self.config.autocast_bf16
            else contextlib.nullcontext()
        )
        with ctx:
            hidden = self.decoder(
                input_ids=row.input_ids[None], position_ids=row.position_ids[None], use_cache=False
            ).last_hidden_state[0]
        v = self.head(hidden.float())[:, 0]
        # Position j's state chooses token j+1.
        return torch.roll(v, 1).masked_fill(row.seq_start, 0.0)

    def _check(self, batch: TrajectoryBatch, rows: dict[str, list[list[float]]]) -> None:
        if len(batch) == 0:
            raise DataError("empty TrajectoryBatch: nothing for the critic to score")
        for key, vals in rows.items():
            if len(vals) != len(batch) or any(len(r) != len(t.input_ids) for r, t in zip(vals, batch.trajectories)):
                raise DataError(f"critic {key}: expected one row per trajectory, one value per token")

    def compute_values(self, batch: TrajectoryBatch) -> list[list[float]]:
        """Per-token values under the current critic weights (0.0 at sequence starts)."""
        import torch

        self._require_init()
        self._check(batch, {})
        ids = [t.input_ids for t in batch.trajectories]
        out: list[list[float]] = [[] for _ in ids]
        self.decoder.eval()
        try:
            with torch.no_grad():
                for mb in allocate_micro_batches([len(x) for x in ids], self.config.max_tokens_per_mb):
                    row = pack_row(mb, ids, {}, {}, self.device)
                    vals = self._values(row).cpu().tolist()
                    for k, i in enumerate(row.seq_index):
                        out[i] = vals[row.cu_seqlens[k] : row.cu_seqlens[k + 1]]
        finally:
            self.decoder.train()
        return out

    def train_values(
        self,
        batch: TrajectoryBatch,
        returns: list[list[float]],
        old_values: list[list[float]],
        *,
        value_eps_clip: float | None = 0.2,
    ) -> dict[str, float]:
        """One optimizer step of the clipped value loss towards ``returns``
        (token mean over the batch's loss tokens). Returns the loss stats plus
        ``grad_norm``, ``lr`` and ``skipped``."""
        import torch

        from areal_kernel.algo.losses import value_loss

        self._require_init()
        self._check(batch, {"returns": returns, "old_values": old_values})
        trajs = batch.trajectories
        n_loss = sum(1 for t in trajs for m in t.loss_mask if m)
        if n_loss == 0:
            raise DataError("the batch has no loss tokens: nothing for the critic to fit")
        ids = [t.input_ids for t in trajs]
        fields = {
            "loss_mask": [[1.0 if m else 0.0 for m in t.loss_mask] for t in trajs],
            "returns": returns,
            "old_values": old_values,
        }
        c = self.config
        lr = c.lr * lr_factor(
            self._step,
            self.total_train_steps,
            scheduler=c.lr_scheduler,
            warmup_steps_proportion=c.warmup_steps_proportion,
            min_lr_ratio=c.min_lr_ratio,
        )
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        norm = torch.tensor(float(n_loss), device=self.device)
        stats: dict[str, float] = {}
        finite = True
        for mb in allocate_micro_batches([len(x) for x in ids], c.max_tokens_per_mb):
            row = pack_row(mb, ids, fields, {}, self.device)
            data = dict(row.data, batch_loss_tokens=norm)
            loss, st = value_loss(self._values(row), data, value_eps_clip=value_eps_clip)
            if not math.isfinite(float(loss.detach())):
                finite = False
                break
            loss.backward()
            for k, v in st.items():
                stats[k] = stats.get(k, 0.0) + float(v)
        params = [p for p in list(self.decoder.parameters()) + list(self.head.parameters()) if p.grad is not None]
        grad_norm = float("nan")
        if finite:
            clip = c.max_grad_norm if (c.max_grad_norm is not None and c.max_grad_norm > 0) else float("inf")
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip)) if params else 0.0
            finite = math.isfinite(grad_norm)
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._step += 1
        stats.update(grad_norm=grad_norm, lr=lr, skipped=0.0 if finite else 1.0)
        return stats

    # ------------------------------------------------------------- checkpoint
    def save_state(self, path: str) -> None:
        """Decoder + head weights, optimizer moments and the step (safetensors + JSON)."""
        import json
        import os

        from safetensors.torch import save_file

        self._require_init()
        os.makedirs(path, exist_ok=True)
        weights = {f"decoder.{k}": v.detach().contiguous() for k, v in self.decoder.state_dict().items()}
        weights.update({f"head.{k}": v.detach().contiguous() for k, v in self.head.state_dict().items()})
        save_file(weights, os.path.join(path, "critic.safetensors"))
        opt = save_optimizer_state(self.optimizer, os.path.join(path, "critic_optimizer.safetensors"))
        with open(os.path.join(path, "critic_state.json"), "w", encoding="utf-8") as f:
            json.dump({"step": self._step, **opt}, f)

    def load_state(self, path: str) -> None:
        """Restore what ``save_state`` wrote into an initialized critic."""
        import json
        import os

        import torch
        from safetensors.torch import load_file

        self._require_init()
        meta_path = os.path.join(path, "critic_state.json")
        if not os.path.isfile(meta_path):
            raise DataError(f"{path!r} is not a critic checkpoint (no critic_state.json)")
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
        w = load_file(os.path.join(path, "critic.safetensors"), device=str(self.device))
        with torch.no_grad():
            self.decoder.load_state_dict({k[8:]: v for k, v in w.items() if k.startswith("decoder.")})
            self.head.load_state_dict({k[5:]: v for k, v in w.items() if k.startswith("head.")})
        load_optimizer_state(self.optimizer, os.path.join(path, "critic_optimizer.safetensors"), meta, str(self.device))
        self._step = int(meta["step"])

    def destroy(self) -> None:
        self.decoder = self.head = self.optimizer = None
        current_platform().empty_cache()
