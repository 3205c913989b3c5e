"""``TorchTrainEngine``: the built-in single-process PyTorch train engine.

One HF causal LM on ``current_platform().device()``, AdamW, a warm-up + decay
lr schedule, micro-batching by token budget with sequence packing, optional
bf16 autocast and gradient checkpointing.

Loss contract: ``train_batch`` calls ``loss_fn(logprobs, entropy, data) ->
(loss, stats)`` once per micro-batch under the contract written in
``areal_kernel.api.loss`` (token sums normalised by batch totals).

Weight transfer: ``send_weights`` with ``kind="disk"`` writes an HF dir at
``meta.path``; with ``kind="broadcast"`` it streams
``named_weights_for_transfer()`` through
``areal_kernel.weights.broadcast.send_buckets`` over the group in
``meta.extra["group"]`` or, if absent, the group made by
``init_weight_group(...)``.

LoRA (``lora: {...}`` in the settings): the model is wrapped by ``peft``
(``areal_kernel.engine.lora``) after loading; only the adapter's matrices are
in the optimizer, in ``save_state`` checkpoints (with their optimizer
moments) and in weight transfers (``adapter_spec`` tells the transports);
``save_hf`` writes an adapter directory or the merged model (``lora.export``).

Several adapters (``adapters: [{name: a, ...}, {name: b, ...}]``): one frozen
base shared by one adapter per policy; ``engine.policy(name)`` is that
policy's ``TrainEngine`` (``areal_kernel.engine.multi_adapter``), and the
per-policy calls (scoring, ``train_batch``, exports, weight transfer) go
through it. The engine itself then only initializes, saves and loads the
state of every policy at once, and destroys.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Callable

from areal_kernel.api.engine import AdapterSpec, TrainEngine, WeightUpdateMeta
from areal_kernel.api.io import TrajectoryBatch
from areal_kernel.engine.config import TorchEngineConfig
from areal_kernel.engine.hf import load_causal_lm, save_hf_dir, weights_for_transfer
from areal_kernel.engine.lr_schedule import scheduled_lr
from areal_kernel.engine.microbatch import MicroBatchRunner, check_batch, count_loss_tokens
from areal_kernel.engine.optimizer_state import load_optimizer_state, save_optimizer_state
from areal_kernel.engine.state import (
    check_param_names,
    load_rng_state,
    make_optimizer,
    python_random_state,
    read_engine_state,
    save_rng_state,
    set_lr,
    set_python_random_state,
    torch_dtype,
    write_engine_state,
)
from areal_kernel.errors import ArealError, ConfigError, DataError
from areal_kernel.platforms import current_platform
from areal_kernel.utils.fs import atomic_dir

if TYPE_CHECKING:
    from areal_kernel.engine.together import PolicyJob


class TorchTrainEngine(TrainEngine):
    """Single-process train engine; see the module docstring for the loss contract.

    Built by the kernel as ``TorchTrainEngine.from_context(context)`` (the
    inherited default: ``TorchTrainEngine(context.settings)``); scripts and
    tests construct it directly from a settings dict. Subclasses with another
    model or head override ``load_model`` and ``make_runner``
    (``areal_kernel.engine.scalar_head``)."""

    def __init__(self, config: TorchEngineConfig | dict[str, Any] | None = None) -> None:
        self.config = TorchEngineConfig.parse(config)
        self.model: Any = None
        self.optimizer: Any = None
        self.runner: MicroBatchRunner | None = None
        self.model_path: str | None = None
        self.total_train_steps = 0
        self._step = 0  # optimizer steps taken (skipped ones included): drives the lr schedule
        self._version = 0
        self._weight_group: Any = None
        self._policies: dict[str, Any] = {}  # name -> AdapterPolicy, with ``adapters:``
        self.active_adapter: str | None = None  # the peft adapter the model runs with, with ``adapters:``

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
        model = self.load_model(model_path, torch_dtype(cfg.param_dtype))
        if cfg.lora is not None:
            from areal_kernel.engine.lora import apply_lora

            model = apply_lora(model, cfg.lora, section=f"{self.settings_path}.lora")
        if cfg.adapters is not None:
            from areal_kernel.engine.lora import apply_adapters

            model = apply_adapters(model, cfg.adapters, section=f"{self.settings_path}.adapters")
        model.to(self.device)
        if cfg.gradient_checkpointing:
            # Non-reentrant checkpointing gives the same gradients and works
            # with inputs that do not require grad.
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        self.model = model
        self.runner = self.make_runner(model)
        from areal_kernel.models import vision

        if vision.is_vision_model(model_path):
            self.runner.vision = vision.ImageTensors(model_path)
        self.model_path = os.path.abspath(model_path)
        self.total_train_steps = int(total_train_steps)
        if cfg.adapters is not None:
            from areal_kernel.engine.multi_adapter import AdapterPolicy
            from areal_kernel.engine.lora import peft_adapter_name

            self._policies = {a.name: AdapterPolicy(self, a, peft_adapter_name(i)) for i, a in enumerate(cfg.adapters)}
            self.active_adapter = peft_adapter_name(0)
            return
        self.optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad], cfg)
        self._step = 0
        self._set_lr()

    # Where the settings live in a config, for error messages.
    settings_path = "actor.torch"

    def load_model(self, model_path: str, dtype: Any) -> Any:
        """The HF model to train (on the host); subclasses with another head override it."""
        return load_causal_lm(model_path, dtype, self.config.attn_implementation)

    def make_runner(self, model: Any) -> MicroBatchRunner:
        """The micro-batch runner over ``model``; subclasses with another forward override it."""
        return MicroBatchRunner(model, self.config, self.device)

    def require_model(self) -> MicroBatchRunner:
        """The runner of an initialized engine (whatever its policies);
        ``ArealError`` before ``initialize``."""
        if self.model is None or self.runner is None:
            raise ArealError("TorchTrainEngine is not initialized: call initialize(model_path, total_train_steps)")
        return self.runner

    def _require_init(self) -> MicroBatchRunner:
        runner = self.require_model()
        if self._policies:
            raise ConfigError(
                f"this engine trains several adapters ({', '.join(self._policies)}): make per-policy calls "
                "through engine.policy(name) (the kernel's trainers drive one policy per engine so far: "
                "for a run, use lora:)"
            )
        return runner

    # ------------------------------------------------------------- policies
    def policy_names(self) -> list[str]:
        """The policies this engine trains, in config order: the names of
        ``adapters``, else one (``lora.name``, or ``"policy"`` for full weights)."""
        if self.config.adapters is not None:
            return [a.name for a in self.config.adapters]
        return [self.config.lora.name if self.config.lora is not None else "policy"]

    def policy(self, name: str) -> TrainEngine:
        """The ``TrainEngine`` of the policy ``name``: with ``adapters``, a view
        that trains, scores with, exports and sends only that adapter
        (``areal_kernel.engine.multi_adapter.AdapterPolicy``); without, this
        engine itself (so that single-policy code may call it the same way).
        ``ConfigError`` listing the valid names for any other name."""
        names = self.policy_names()
        if name not in names:
            raise ConfigError(f"unknown policy {name!r}: this engine trains {', '.join(map(repr, names))}")
        if not self._policies:
            self.require_model()
            return self
        return self._policies[name]

    def run_with_adapter(self, adapter: str) -> MicroBatchRunner:
        """The runner, with the peft ``adapter`` active (trainable, the others
        frozen and unused): what every ``AdapterPolicy`` call goes through."""
        runner = self.require_model()
        if self.active_adapter != adapter:
            self.model.set_adapter(adapter)
            self.active_adapter = adapter
        return runner

    def train_policies(self, jobs: dict[str, PolicyJob]) -> dict[str, dict[str, float]]:
        """One optimizer step of each policy in ``jobs`` (name -> its batch,
        loss and extra fields), in micro-batches that mix the policies'
        sequences, each adapter updating its own tokens, the base run once
        per micro-batch (``areal_kernel.engine.together``); each policy's
        ``train_batch`` statistics, plus ``joint`` (1.0 when forwards were
        shared). Equals one ``policy(name).train_batch`` per policy within
        float rounding. Needs ``adapters``."""
        from areal_kernel.engine.together import train_together

        self.require_model()
        if not self._policies:
            raise ConfigError("train_policies: this engine holds no adapters (adapters:); use train_batch")
        return train_together(self, jobs)

    def score_base(self, batch: TrajectoryBatch, only_loss_tokens: bool = False) -> list[list[float]]:
        """Per-token logprobs of the frozen base with every adapter switched
        off (peft's ``disable_adapter``), for an engine with ``adapters``.
        Adapters start as no-ops (``lora_B`` is zero), so this is every
        policy's initial policy: a multi-policy run's reference model for
        ``kl_coef``, with no second copy of the model."""
        runner = self.require_model()
        if not self._policies:
            raise ConfigError("score_base: this engine holds no adapters (adapters:); score with a reference engine")
        check_batch(batch)
        with self.model.disable_adapter():
            return runner.score(batch, only_loss_tokens)[0]

    def current_lr(self) -> float:
        return scheduled_lr(self.config, self._step, self.total_train_steps)

    def _set_lr(self) -> float:
        return set_lr(self.optimizer, self.current_lr())

    # ---------------------------------------------------------------- scoring
    def compute_logprobs(self, batch: TrajectoryBatch, only_loss_tokens: bool = False) -> list[list[float]]:
        """Per-token logprobs under the current weights (entry 0 of each row is 0.0).
        ``only_loss_tokens``: score only tokens with loss_mask 1 (others 0.0), cheaper."""
        runner = self._require_init()
        check_batch(batch)
        return runner.score(batch, only_loss_tokens)[0]

    def compute_logprobs_and_entropy(self, batch: TrajectoryBatch) -> tuple[list[list[float]], list[list[float]]]:
        """Like ``compute_logprobs``, plus the per-token entropy (for statistics)."""
        runner = self._require_init()
        check_batch(batch)
        return runner.score(batch)

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
        runner = self._require_init()
        check_batch(batch, extra)
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self._set_lr()
        out = self.optimizer_step(runner, self.optimizer, lr, batch, loss_fn, extra)
        self._step += 1
        out["step_time_s"] = time.perf_counter() - t0
        return out

    def optimizer_step(
        self,
        runner: MicroBatchRunner,
        optimizer: Any,
        lr: float,
        batch: TrajectoryBatch,
        loss_fn: Callable[..., Any],
        extra: dict[str, list[list[float]]] | None,
    ) -> dict[str, float]:
        """The body of ``train_batch`` for ``optimizer`` (gradients zeroed, lr
        set): accumulate, clip, step; its statistics but ``step_time_s``."""
        n_loss_tokens = count_loss_tokens(batch)
        self.model.train()
        acc = runner.accumulate(batch, loss_fn, extra, batch_loss_tokens=n_loss_tokens, batch_n_seqs=len(batch))
        grad_norm, applied = runner.apply_gradients(optimizer, acc.finite, self.config.max_grad_norm)
        current_platform().synchronize()
        return acc.step_stats(batch, n_loss_tokens, grad_norm=grad_norm, lr=lr, applied=applied)

    # ---------------------------------------------------------------- weights
    def adapter_spec(self) -> AdapterSpec | None:
        lora = self.config.lora
        if lora is None:
            if self._policies:
                self._require_init()  # each policy's view has its own spec
            return None
        from areal_kernel.engine.lora import adapter_config

        self._require_init()
        return AdapterSpec(lora.name, adapter_config(self.model, self.model_path))

    def named_weights_for_transfer(self) -> list[tuple[str, Any]]:
        """(HF name, tensor) pairs of the model's state dict with tied aliases
        dropped (``areal_kernel.engine.hf.weights_for_transfer``); with LoRA,
        the adapter's tensors under peft's file names. Tensors are detached
        views of the live weights, not copies."""
        self._require_init()
        if self.config.lora is not None:
            from areal_kernel.engine.lora import adapter_weights

            return adapter_weights(self.model)
        return weights_for_transfer(self.model)

    def weight_sample(self, positions: dict[str, list[int]]) -> dict[str, Any]:
        """The weight-delivery check's sample, read from the named parameters
        (and buffers) directly: building ``named_weights_for_transfer`` walks
        the whole state dict, which was most of the check's trainer-side cost
        on SmolLM2. With LoRA, the adapter's file names differ from the live
        ones: the default path."""
        self._require_init()
        if self.config.lora is not None:
            return super().weight_sample(positions)
        from areal_kernel.utils.tensor_sample import sample_named

        def live(name: str) -> Any:
            try:
                return self.model.get_parameter(name).detach()
            except AttributeError:
                return self.model.get_buffer(name)

        return sample_named(((n, live(n)) for n in positions), positions)

    def _trained_tensors(self) -> list[tuple[str, Any]]:
        """What a recovery checkpoint stores: every weight, or with LoRA the
        adapter's parameters under their live names (the frozen base is the
        model directory's)."""
        if self.config.lora is not None:
            from areal_kernel.engine.lora import trainable_named_params

            return [(n, p.detach()) for n, p in trainable_named_params(self.model)]
        return self.named_weights_for_transfer()

    def weight_transfer_meta(self) -> list[dict[str, Any]]:
        """``[{"name", "dtype", "shape"}]`` of ``named_weights_for_transfer()``
        in send order: what broadcast receivers need before ``recv_buckets``."""
        from areal_kernel.weights.broadcast import tensor_meta

        return tensor_meta(self.named_weights_for_transfer())

    def save_hf(self, path: str) -> None:
        """Write an HF model dir (config, safetensors, tokenizer/generation
        files copied from the source dir), atomically
        (``areal_kernel.engine.hf.save_hf_dir``)."""
        self._require_init()
        lora = self.config.lora
        if lora is None:
            save_hf_dir(path, self.model, self.model_path)
            return
        from areal_kernel.engine import lora as L

        if lora.export == "merged":
            L.save_merged_hf_dir(path, self.model, self.model_path)
        else:
            spec = self.adapter_spec()
            assert spec is not None
            L.save_adapter_hf_dir(path, self.named_weights_for_transfer(), spec.config, self.model_path)

    def write_adapter(self, path: str) -> None:
        """The adapter alone as a peft directory at ``path`` (what a disk weight update ships)."""
        from areal_kernel.engine.lora import write_adapter_dir

        spec = self.adapter_spec()
        if spec is None:
            raise ConfigError("write_adapter: this engine trains no LoRA adapter (set lora: in its settings)")
        write_adapter_dir(path, self.named_weights_for_transfer(), spec.config)

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
        write = self.write_adapter if self.config.lora is not None else self.save_hf
        self.send_by_kind(meta, write, self.named_weights_for_transfer)

    def send_by_kind(
        self, meta: WeightUpdateMeta, write_disk: Callable[[str], None], named: Callable[[], list[tuple[str, Any]]]
    ) -> None:
        """``send_weights``' dispatch, shared with the per-policy views: a
        directory written by ``write_disk`` at ``meta.path`` (disk), or the
        tensors ``named()`` over ``meta.extra['group']`` or this engine's
        weight group (broadcast)."""
        if meta.kind == "disk":
            if not meta.path:
                raise ConfigError("WeightUpdateMeta.path is required for kind='disk'")
            write_disk(meta.path)
        elif meta.kind == "broadcast":
            group = meta.extra.get("group", self._weight_group)
            if group is None:
                raise ArealError(
                    "kind='broadcast' needs a process group: call engine.init_weight_group(...) first "
                    "or pass WeightUpdateMeta.extra['group']"
                )
            from areal_kernel.weights.broadcast import send_buckets

            send_buckets(group, named(), meta.bucket_bytes)
            current_platform().synchronize()
        else:
            raise ConfigError(f"WeightUpdateMeta.kind={meta.kind!r} is not supported; valid: 'disk', 'broadcast'")

    # ------------------------------------------------------------- checkpoint
    def save_state(self, path: str) -> None:
        """Model, optimizer, lr-schedule step, version and RNG states, for exact
        recovery. Tensors in safetensors, the rest in JSON; written atomically.
        With LoRA the weights are the adapter's only (the base is frozen)."""
        from safetensors.torch import save_file

        if self._policies:
            from areal_kernel.engine.multi_adapter import save_policies_state

            save_policies_state(self, path)
            return
        self._require_init()
        with atomic_dir(path) as tmp:
            save_file(
                {n: t.contiguous() for n, t in self._trained_tensors()},
                os.path.join(tmp, "model.safetensors"),
            )
            opt = save_optimizer_state(self.optimizer, os.path.join(tmp, "optimizer.safetensors"))
            save_rng_state(os.path.join(tmp, "rng.safetensors"))
            write_engine_state(tmp, "torch", {
                "step": self._step,
                "version": self.get_version(),
                "total_train_steps": self.total_train_steps,
                "param_names": [n for n, _ in self.model.named_parameters()],
                "optimizer_param_groups": opt["param_groups"],
                "optimizer_scalars": opt["scalars"],
                "python_random": python_random_state(),
                "config": self.config.model_dump(),
            })  # fmt: skip

    def load_state(self, path: str) -> None:
        """Restore what ``save_state`` wrote into an initialized engine of the
        same architecture."""
        import torch
        from safetensors.torch import load_file

        if self._policies:
            from areal_kernel.engine.multi_adapter import load_policies_state

            load_policies_state(self, path)
            return
        self._require_init()
        meta = read_engine_state(path, "torch")
        check_param_names(path, meta["param_names"], [n for n, _ in self.model.named_parameters()])

        dev = self.device
        weights = load_file(os.path.join(path, "model.safetensors"), device=str(dev))
        expected = {n for n, _ in self._trained_tensors()}
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
        load_rng_state(os.path.join(path, "rng.safetensors"))
        set_python_random_state(meta["python_random"])
        self._step = int(meta["step"])
        self.set_version(int(meta["version"]))
        self._set_lr()

    def destroy(self) -> None:
        self.model = None
        self.runner = None
        self.optimizer = None
        self._weight_group = None
        self._policies = {}
        current_platform().empty_cache()
