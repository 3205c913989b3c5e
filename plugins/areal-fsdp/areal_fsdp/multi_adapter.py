"""Several LoRA adapters on one sharded base in the fsdp engine: one view per policy.

With ``adapters: [{name: a, ...}, {name: b, ...}]`` in ``actor.fsdp`` (plain
data parallelism, ``fsdp:dN``; other layouts are refused by
``areal_fsdp.layout.check_layout_settings``), every rank wraps the base in
peft with all the adapters (``areal_kernel.engine.lora.apply_adapters``)
before ``fully_shard`` and builds one AdamW optimizer per adapter over that
adapter's sharded parameters. ``engine.policy(name)`` returns a
``FSDPAdapterPolicy``: the ``TrainEngine`` of that adapter alone, as the torch
engine's ``areal_kernel.engine.multi_adapter.AdapterPolicy`` is.

How a call reaches one adapter: the ranks run as a one-adapter LoRA engine of
the *active* adapter. ``use_adapter(name)`` (a rank command, sent only when
the active adapter changes) switches peft's active adapter, swaps in that
adapter's optimizer, lr-schedule step, transfer list, merge plan and
``lora`` settings, and drops every gradient (the clip counts every gradient
of the model, and another adapter's last step leaves its own). The
controller does the same swap on its side for the length of one view call
(``FSDPPolicies.acting_as``), so every existing one-adapter code path
(scoring, ``train_part``, adapter exports, disk and broadcast updates, the
weight-delivery sample, DCP of one adapter) serves the view unchanged.

Switching adapters flips ``requires_grad`` of sharded parameters. FSDP2
copies the sharded parameter's flag onto the unsharded one at every
all-gather (``FSDPParam.to_unsharded``), so the flag set here between calls
is the one the next forward uses; the switch reshards every unit first, so
peft's flags land on the sharded parameters, and sets them once more
explicitly per adapter.

Checkpoints: ``engine.save_state`` with adapters writes one DCP checkpoint
(``dcp/``) holding every adapter's sharded weights and optimizer state under
its policy's name, each rank's RNG state, and ``engine_state.json``
(``engine: fsdp-adapters``) with every policy's step, version and transfer
names; DCP reshards, so another rank count loads it. A view's
``save_state`` is the one-adapter fsdp checkpoint of its adapter.

This module imports no torch at module level (the controller imports it).
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

from areal_kernel.api.engine import AdapterSpec, TrainEngine, WeightUpdateMeta
from areal_kernel.api.io import TrajectoryBatch
from areal_kernel.engine.multi_adapter import PolicyView
from areal_kernel.engine.state import check_param_names, read_engine_state, write_engine_state
from areal_kernel.errors import ArealError, ConfigError, DataError
from areal_kernel.utils.fs import atomic_dir

if TYPE_CHECKING:
    from areal_kernel.engine.config import LoraConfig
    from areal_kernel.engine.together import PolicyJob

    from areal_fsdp.config import FSDPEngineConfig
    from areal_fsdp.engine import FSDPTrainEngine

# engine_state.json's ``engine`` of a checkpoint of every adapter: it loads
# neither as a one-adapter fsdp checkpoint nor as the torch engine's.
POLICIES_STATE = "fsdp-adapters"


# ============================================================== rank side
@dataclass
class RankAdapter:
    """One adapter's share of a rank: what ``use_adapter`` swaps in."""

    lora: "LoraConfig"
    peft_name: str
    settings: Any  # the rank's settings with ``lora`` = this adapter, ``adapters`` None
    live_names: dict[str, str]  # peft file name -> live (sharded state dict) name
    transfer_meta: list[dict[str, Any]]
    merge_plan: list[Any]
    adapter_config: dict[str, Any]
    params: list[Any] = field(default_factory=list)  # the sharded parameters, after fully_shard
    optimizer: Any = None
    step: int = 0


class RankAdapters:
    """The ``FSDPRankEngine`` half of several adapters (mixed into it).
    Expects the rank engine's ``model``, ``config``, ``optimizer``, ``step``,
    ``live_names``, ``transfer_meta``, ``merge_plan``, ``adapter_config``,
    ``set_lr``, ``score_part``, ``barrier`` and DCP helpers."""

    model: Any
    config: Any
    optimizer: Any
    step: int
    rank: int
    live_names: dict[str, str]
    transfer_meta: list[dict[str, Any]]
    merge_plan: list[Any]
    adapter_config: dict[str, Any] | None
    adapters: dict[str, RankAdapter]
    active_adapter: str | None

    total_train_steps: int
    set_lr: Callable[[], float]
    score_part: Callable[..., Any]
    _runner: Callable[[], Any]
    barrier: Callable[[], None]
    _state_dict_options: Callable[[], Any]
    _trained_only: Callable[[dict[str, Any]], dict[str, Any]]

    def wrap_adapters(self, model: Any) -> Any:
        """Before ``model.to`` and ``fully_shard``: every adapter of
        ``config.adapters`` on the base (peft names ``adapter<i>``)."""
        from areal_kernel.engine.lora import apply_adapters

        self.adapters = {}
        self.active_adapter = None
        return apply_adapters(model, self.config.adapters, section="actor.fsdp.adapters")

    def describe_adapters(self, model: Any, model_path: str) -> None:
        """On the whole (unsharded) model: each adapter's transfer list (peft
        file names, as the torch engine's views send), merge plan and
        ``adapter_config.json``; then the rank runs as adapter 0's engine."""
        from areal_kernel.engine.lora import adapter_config, adapter_params, merge_plan, peft_adapter_name
        from areal_kernel.weights.broadcast import tensor_meta

        base = self.config
        for i, lora in enumerate(base.adapters):
            peft_name = peft_adapter_name(i)
            named = adapter_params(model, peft_name)
            live = {n: live for (n, _), (live, _) in zip(named, _live_params(model, peft_name))}
            self.adapters[lora.name] = RankAdapter(
                lora=lora,
                peft_name=peft_name,
                settings=base.model_copy(update={"lora": lora, "adapters": None}),
                live_names=live,
                transfer_meta=tensor_meta(named),
                merge_plan=merge_plan(model, peft_name),
                adapter_config=adapter_config(model, os.path.abspath(model_path), peft_name),
            )
        self._enter(next(iter(self.adapters)))

    def adapter_optimizers(self) -> None:
        """After ``fully_shard``: one optimizer per adapter over its sharded parameters."""
        from areal_kernel.engine.state import make_optimizer

        params = dict(self.model.named_parameters())
        for rec in self.adapters.values():
            rec.params = [params[live] for live in rec.live_names.values()]
            rec.optimizer = make_optimizer(rec.params, rec.settings)
        self.optimizer = self.adapters[self.active_adapter or ""].optimizer

    def adapter_info(self) -> dict[str, Any]:
        """What ``initialize`` reports per adapter (the controller's views)."""
        return {
            "adapters": {
                n: {"transfer_meta": r.transfer_meta, "adapter_config": r.adapter_config}
                for n, r in self.adapters.items()
            }
        }

    def _enter(self, name: str) -> None:
        """Swap in adapter ``name``'s state (its record keeps the step)."""
        if self.active_adapter is not None:
            self.adapters[self.active_adapter].step = self.step
        rec = self.adapters[name]
        self.active_adapter = name
        self.config = rec.settings
        self.live_names = rec.live_names
        self.transfer_meta = rec.transfer_meta
        self.merge_plan = rec.merge_plan
        self.adapter_config = rec.adapter_config
        self.optimizer = rec.optimizer
        self.step = rec.step

    def use_adapter(self, name: str) -> None:
        """Rank command: make ``name`` the active adapter (see the module docstring)."""
        if name not in self.adapters:
            raise ConfigError(f"fsdp rank: no adapter {name!r} (have {', '.join(self.adapters)})")
        self._reshard()
        self.model.set_adapter(self.adapters[name].peft_name)
        self._enter(name)
        self._sync_requires_grad()
        # Gradients the last adapter left would enter the clip's norm.
        self.model.zero_grad(set_to_none=True)
        self.set_lr()

    def _reshard(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def _sync_requires_grad(self) -> None:
        for name, rec in self.adapters.items():
            for p in rec.params:
                p.requires_grad_(name == self.active_adapter)

    def score_base_part(
        self, part: TrajectoryBatch, only_loss_tokens: bool, with_entropy: bool
    ) -> tuple[list, list | None] | None:
        """``score_part`` with every adapter switched off (the shared base)."""
        self._reshard()
        try:
            with self.model.disable_adapter():
                return self.score_part(part, only_loss_tokens, with_entropy)  # type: ignore[no-any-return]
        finally:
            # Leaving disable_adapter re-enables the active adapter's layers through peft.
            self._reshard()
            self._sync_requires_grad()

    def train_policies_part(self, jobs: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """Rank command: this rank's share of one optimizer step of each
        policy in ``jobs`` (policy name -> ``part``, ``global_index``,
        ``extra``, ``loss_fn``, ``batch_loss_tokens``, ``batch_n_seqs``, as
        ``train_part`` takes them), in micro-batches that mix the policies'
        sequences over the base (``areal_kernel.engine.together``). Every
        job's adapter trains in the same forwards (each its own tokens, the
        others a zero share, so every rank reduces the same gradients); then
        each adapter clips and steps on its own (its optimizer, its lr
        schedule's step), in ``jobs``' order on every rank. The active
        adapter stays the active one. ``{"refused": why}`` (nothing done)
        where a joint forward cannot hold on this model (the same answer on
        every rank; the controller keeps batches with images away, which
        one rank's share could hold and another's not); else
        ``{"policies": {name: train_part's answer}}``."""
        from areal_kernel.engine.state import set_lr
        from areal_kernel.engine.lr_schedule import scheduled_lr
        from areal_kernel.engine.together import JointPart, joint_accumulate, joint_refusal
        from areal_kernel.platforms import current_platform

        unknown = [n for n in jobs if n not in self.adapters]
        if unknown:
            raise ConfigError(f"fsdp rank: no adapter {unknown[0]!r} (have {', '.join(self.adapters)})")
        runner = self._runner()
        why = joint_refusal(runner, self.model, (j["part"] for j in jobs.values()))
        if why is not None:
            return {"refused": why}
        t0 = time.perf_counter()
        active = self.active_adapter or ""
        self.adapters[active].step = self.step  # the active adapter's step lives in self.step
        recs = {n: self.adapters[n] for n in jobs}
        # The flags land on the sharded parameters; the next all-gather copies them.
        self._reshard()
        for name, rec in self.adapters.items():
            for p in rec.params:
                p.requires_grad_(name in recs)
        self.model.zero_grad(set_to_none=True)
        lrs = {
            n: set_lr(r.optimizer, scheduled_lr(r.settings, r.step, self.total_train_steps)) for n, r in recs.items()
        }
        parts = {
            n: JointPart(
                recs[n].peft_name,
                j["part"],
                j["loss_fn"],
                j["extra"],
                int(j["batch_loss_tokens"]),
                int(j["batch_n_seqs"]),
                list(j["global_index"]),
            )
            for n, j in jobs.items()
        }
        self.model.train()
        try:
            acc = joint_accumulate(runner, self.model, parts)
            steps = {}
            for n, rec in recs.items():
                steps[n] = runner.apply_gradients(rec.optimizer, acc[n].finite, rec.settings.max_grad_norm, rec.params)
                rec.optimizer.zero_grad(set_to_none=True)
                rec.step += 1
        finally:
            self.step = self.adapters[active].step
            self._reshard()
            self._sync_requires_grad()
            self.model.zero_grad(set_to_none=True)
        current_platform().synchronize()
        elapsed = time.perf_counter() - t0
        return {
            "policies": {
                n: acc[n].part_answer(grad_norm=norm, lr=lrs[n], applied=applied, step_time_s=elapsed)
                for n, (norm, applied) in steps.items()
            }
        }

    def _adapter_states(self) -> dict[str, Any]:
        """Every adapter's DCP entries (weights, optimizer), by policy name."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        out: dict[str, Any] = {}
        for name in self.adapters:
            self.use_adapter(name)
            msd, osd = get_state_dict(self.model, self.optimizer, options=self._state_dict_options())
            out[name] = {"model": self._trained_only(msd), "optim": osd}
        return out

    def adapters_dcp_save(self, tmp_dir: str) -> None:
        """Rank command: every adapter and its optimizer state into one DCP
        checkpoint (``tmp_dir/dcp``), and this rank's RNG state."""
        import torch.distributed.checkpoint as dcp

        from areal_kernel.engine.state import save_rng_state

        active = self.active_adapter or ""
        states = self._adapter_states()
        self.use_adapter(active)
        dcp.save(states, checkpoint_id=os.path.join(tmp_dir, "dcp"))
        save_rng_state(os.path.join(tmp_dir, f"rng-rank{self.rank}.safetensors"))
        self.barrier()

    def adapters_dcp_load(self, path: str, steps: dict[str, int]) -> None:
        """Rank command: restore what ``adapters_dcp_save`` wrote; ``steps``
        holds each adapter's lr-schedule step (from ``engine_state.json``)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from areal_kernel.engine.state import load_rng_state

        active = self.active_adapter or ""
        states = self._adapter_states()
        dcp.load(states, checkpoint_id=os.path.join(path, "dcp"))
        for name, st in states.items():
            self.use_adapter(name)
            set_state_dict(
                self.model, self.optimizer, model_state_dict=st["model"], optim_state_dict=st["optim"],
                options=self._state_dict_options(),
            )  # fmt: skip
            self.step = int(steps[name])
        self.use_adapter(active)
        rng_path = os.path.join(path, f"rng-rank{self.rank}.safetensors")
        if os.path.isfile(rng_path):  # absent when resuming with more ranks than were saved
            load_rng_state(rng_path)
        self.barrier()


def _live_params(model: Any, peft_name: str) -> list[tuple[str, Any]]:
    """``(live name, parameter)`` of one adapter, in the order of
    ``adapter_params`` (model order), whatever its ``requires_grad``."""
    marks = (f".lora_A.{peft_name}.", f".lora_B.{peft_name}.")
    return [(n, p) for n, p in model.named_parameters() if any(m in n for m in marks)]


# ======================================================== controller side
class FSDPAdapterPolicy(PolicyView):
    """One adapter of an ``FSDPTrainEngine`` with ``adapters``, as a
    ``TrainEngine`` (see the module docstring). Built by the engine; never
    initialized or destroyed on its own."""

    def __init__(
        self,
        engine: "FSDPTrainEngine",
        settings: "FSDPEngineConfig",
        transfer_meta: list[dict[str, Any]],
        adapter_config: dict[str, Any],
    ) -> None:
        assert settings.lora is not None
        self.engine = engine
        self.settings = settings  # the engine's, with lora = this adapter
        self.lora = settings.lora
        self.name = settings.lora.name
        self.transfer_meta = transfer_meta
        self.adapter_config = adapter_config
        self.step = 0

    def compute_logprobs(self, batch: TrajectoryBatch, only_loss_tokens: bool = False) -> list[list[float]]:
        with self.engine.acting_as(self):
            return self.engine.compute_logprobs(batch, only_loss_tokens)

    def compute_logprobs_and_entropy(self, batch: TrajectoryBatch) -> tuple[list[list[float]], list[list[float]]]:
        with self.engine.acting_as(self):
            return self.engine.compute_logprobs_and_entropy(batch)

    def train_batch(
        self,
        batch: TrajectoryBatch,
        loss_fn: Callable[..., Any],
        extra: dict[str, list[list[float]]] | None = None,
    ) -> dict[str, float]:
        """One step of this adapter's optimizer (statistics as the engine's)."""
        with self.engine.acting_as(self):
            return self.engine.train_batch(batch, loss_fn, extra)

    def adapter_spec(self) -> AdapterSpec:
        return AdapterSpec(self.name, dict(self.adapter_config))

    def named_weights_for_transfer(self) -> list[tuple[str, Any]]:
        """This adapter's tensors as meta tensors (the data lives in the ranks)."""
        with self.engine.acting_as(self):
            return self.engine.named_weights_for_transfer()

    def weight_transfer_meta(self) -> list[dict[str, Any]]:
        return [dict(m) for m in self.transfer_meta]

    def weight_sample(self, positions: dict[str, list[int]]) -> dict[str, Any]:
        with self.engine.acting_as(self):
            return self.engine.weight_sample(positions)

    def full_weights(self) -> dict[str, Any]:
        """This adapter's tensors in this process (small models, tests)."""
        with self.engine.acting_as(self):
            return self.engine.full_weights()

    def write_adapter(self, path: str) -> None:
        """This adapter alone as a peft directory at ``path`` (a disk weight update)."""
        with self.engine.acting_as(self):
            self.engine.write_disk_weights(path)

    def save_hf(self, path: str, max_shard_bytes: int | None = None) -> None:
        """A peft adapter directory of this adapter, or the base with it merged
        in (``lora.export``), with the source model's tokenizer files."""
        with self.engine.acting_as(self):
            self.engine.save_hf(path, max_shard_bytes)

    def send_weights(self, meta: WeightUpdateMeta) -> None:
        """This adapter only: a peft directory (disk) or its tensors (broadcast)."""
        with self.engine.acting_as(self):
            self.engine.send_weights(meta)

    def save_state(self, path: str) -> None:
        """This adapter's weights, optimizer state, step and version (the
        engine's one-adapter DCP checkpoint; it holds the ranks' RNG too)."""
        with self.engine.acting_as(self):
            self.engine.save_state(path)

    def load_state(self, path: str) -> None:
        with self.engine.acting_as(self):
            self.engine.load_state(path)


class FSDPPolicies:
    """The ``FSDPTrainEngine`` half of several adapters (mixed in before
    ``RankedTrainEngine``): the views, the per-view swap, ``score_base``,
    the engine-level checkpoint of every adapter, and the refusal of
    one-policy calls on an engine that holds several."""

    config: Any
    _adapter_config: dict[str, Any] | None
    total_train_steps: int
    call_ranks: Callable[..., list[Any]]
    require_initialized: Callable[[], None]
    state_meta: Callable[[], dict[str, Any]]
    get_version: Callable[[], int]
    set_version: Callable[[int], None]
    policy_state: Callable[[], dict[str, Any]]
    set_policy_state: Callable[[dict[str, Any]], None]
    score_parts: Callable[..., tuple[list[list[float]], list[list[float]]]]
    partition: Callable[[TrajectoryBatch], list[list[int]]]
    part_arguments: Callable[..., tuple[list[TrajectoryBatch], list[dict[str, Any]]]]
    merge_step_answers: Callable[..., dict[str, float]]
    world_size: int

    _policies: dict[str, FSDPAdapterPolicy]
    _acting: FSDPAdapterPolicy | None = None
    _ranks_adapter: str | None = None

    def build_policies(self, answer: dict[str, Any]) -> None:
        """From rank 0's ``initialize`` answer: one view per adapter."""
        self._policies = {}
        self._acting = None
        if self.config.adapters is None:
            return
        for lora in self.config.adapters:
            got = answer["adapters"][lora.name]
            settings = self.config.model_copy(update={"lora": lora, "adapters": None})
            self._policies[lora.name] = FSDPAdapterPolicy(
                self,  # type: ignore[arg-type]
                settings,
                got["transfer_meta"],
                got["adapter_config"],
            )
        self._ranks_adapter = self.config.adapters[0].name

    def policy_names(self) -> list[str]:
        """The policies this engine trains, in config order (as the torch engine's)."""
        if self.config.adapters is not None:
            return [a.name for a in self.config.adapters]
        return [self.config.lora.name if self.config.lora is not None else "policy"]

    def policy(self, name: str) -> TrainEngine:
        """The ``TrainEngine`` of the policy ``name``: with ``adapters`` the
        adapter's view, else this engine. ``ConfigError`` for another name."""
        names = self.policy_names()
        if name not in names:
            raise ConfigError(f"unknown policy {name!r}: this engine trains {', '.join(map(repr, names))}")
        self.require_initialized()
        if not self._policies:
            return self  # type: ignore[return-value]
        return self._policies[name]

    @contextmanager
    def acting_as(self, view: FSDPAdapterPolicy) -> Iterator[None]:
        """For one view call: the ranks with ``view``'s adapter active, and
        this engine wearing the view's settings, transfer list, step and
        version (written back to the view afterwards)."""
        if self._acting is not None:
            raise ArealError(f"policy {view.name!r}: a call of policy {self._acting.name!r} is under way")
        if self._ranks_adapter != view.name:
            self._ranks_adapter = None  # unknown should the switch fail half-way
            self.call_ranks("use_adapter", {"name": view.name})
            self._ranks_adapter = view.name
        saved, saved_adapter = self.policy_state(), self._adapter_config
        self.set_policy_state(
            {"settings": view.settings, "transfer_meta": view.transfer_meta, "step": view.step,
             "version": view.get_version()}
        )  # fmt: skip
        self._adapter_config = view.adapter_config
        self._acting = view
        try:
            yield
        finally:
            now = self.policy_state()
            view.step = int(now["step"])
            view.set_version(int(now["version"]))
            self.set_policy_state(saved)
            self._adapter_config = saved_adapter
            self._acting = None

    def check_policy_call(self, what: str) -> None:
        """``ConfigError`` for a one-policy call on an engine holding several adapters."""
        if getattr(self, "_policies", None) and self._acting is None:
            raise ConfigError(
                f"{what}: this engine trains several adapters ({', '.join(self._policies)}): make per-policy "
                "calls through engine.policy(name)"
            )

    def score_base(self, batch: TrajectoryBatch, only_loss_tokens: bool = False) -> list[list[float]]:
        """Per-token logprobs of the shared base with every adapter off: a
        multi-policy run's KL reference (as ``TorchTrainEngine.score_base``)."""
        self.require_initialized()
        if not getattr(self, "_policies", None):
            raise ConfigError("score_base: this engine holds no adapters (adapters:); score with a reference engine")
        return self.score_parts(batch, only_loss_tokens, False, cmd="score_base_part")[0]

    def train_policies(self, jobs: dict[str, "PolicyJob"]) -> dict[str, dict[str, float]]:
        """One optimizer step of each policy in ``jobs`` (name -> its batch,
        loss and extra fields), in micro-batches that mix the policies'
        sequences over the sharded base, each adapter updating its own
        tokens (``train_policies_part`` on every rank); each policy's
        ``train_batch`` statistics plus ``joint`` (1.0 when forwards were
        shared). Each policy's batch is split over the ranks as its own
        ``train_batch`` splits it. Equals one ``policy(name).train_batch``
        per policy within float rounding; falls back to exactly that where
        a joint forward cannot hold (one job, a batch with images: the
        ranks' ``joint_refusal``). The ranks run the whole model on each
        row, LM head included, so an adapter on the head shares the
        forwards too."""
        from areal_kernel.engine.microbatch import check_batch, count_loss_tokens
        from areal_kernel.engine.together import batches_refusal, one_at_a_time

        self.require_initialized()
        if not getattr(self, "_policies", None):
            raise ConfigError("train_policies: this engine holds no adapters (adapters:); use train_batch")
        views = {name: self.policy(name) for name in jobs}  # unknown names: one ConfigError naming the valid ones
        for job in jobs.values():
            check_batch(job.batch, job.extra)

        # Decided here on the whole batches: a rank sees its own share only, and
        # ranks that decided differently would wait on each other's collectives.
        if batches_refusal(j.batch for j in jobs.values()) is not None:
            return one_at_a_time(views, jobs)
        t0 = time.perf_counter()
        n_loss = {n: count_loss_tokens(j.batch) for n, j in jobs.items()}
        split = {n: self.partition(j.batch) for n, j in jobs.items()}
        per_rank: list[dict[str, Any]] = [{"jobs": {}} for _ in range(self.world_size)]
        for n, job in jobs.items():
            if len(split[n]) != self.world_size:  # adapters run on plain data parallelism: a part per rank
                raise ArealError(f"train_policies: {len(split[n])} data-parallel parts for {self.world_size} ranks")
            subs, per_part = self.part_arguments(job.batch, job.extra, split[n])
            for r, (sub, own) in enumerate(zip(subs, per_part)):
                per_rank[r]["jobs"][n] = {
                    "part": sub, **own, "loss_fn": job.loss_fn, "batch_loss_tokens": n_loss[n],
                    "batch_n_seqs": len(job.batch),
                }  # fmt: skip
        answers = self.call_ranks("train_policies_part", per_rank)
        if "refused" in answers[0]:
            return one_at_a_time(views, jobs)
        elapsed = time.perf_counter() - t0
        out: dict[str, dict[str, float]] = {}
        for n, job in jobs.items():
            stats = self.merge_step_answers([a["policies"][n] for a in answers], job.batch, n_loss[n], elapsed)
            stats["joint"] = 1.0
            out[n] = stats
            self._policies[n].step += 1
        return out

    # One-policy calls: refused on the engine itself with several adapters.
    def compute_logprobs(self, batch: TrajectoryBatch, only_loss_tokens: bool = False) -> list[list[float]]:
        self.check_policy_call("compute_logprobs")
        return super().compute_logprobs(batch, only_loss_tokens)  # type: ignore[misc,no-any-return]

    def compute_logprobs_and_entropy(self, batch: TrajectoryBatch) -> tuple[list[list[float]], list[list[float]]]:
        self.check_policy_call("compute_logprobs_and_entropy")
        return super().compute_logprobs_and_entropy(batch)  # type: ignore[misc,no-any-return]

    def train_batch(
        self,
        batch: TrajectoryBatch,
        loss_fn: Callable[..., Any],
        extra: dict[str, list[list[float]]] | None = None,
    ) -> dict[str, float]:
        self.check_policy_call("train_batch")
        return super().train_batch(batch, loss_fn, extra)  # type: ignore[misc,no-any-return]

    def named_weights_for_transfer(self) -> list[tuple[str, Any]]:
        self.check_policy_call("named_weights_for_transfer")
        return super().named_weights_for_transfer()  # type: ignore[misc,no-any-return]

    def weight_transfer_meta(self) -> list[dict[str, Any]]:
        self.check_policy_call("weight_transfer_meta")
        return super().weight_transfer_meta()  # type: ignore[misc,no-any-return]

    def weight_sample(self, positions: dict[str, list[int]]) -> dict[str, Any]:
        self.check_policy_call("weight_sample")
        return super().weight_sample(positions)  # type: ignore[misc,no-any-return]

    def full_weights(self) -> dict[str, Any]:
        self.check_policy_call("full_weights")
        return super().full_weights()  # type: ignore[misc,no-any-return]

    def save_hf(self, path: str, max_shard_bytes: int | None = None) -> None:
        self.check_policy_call("save_hf")
        super().save_hf(path, max_shard_bytes)  # type: ignore[misc]

    def send_weights(self, meta: WeightUpdateMeta) -> None:
        self.check_policy_call("send_weights")
        super().send_weights(meta)  # type: ignore[misc]

    # Checkpoints: every adapter at once on the engine, one adapter in a view.
    def save_state(self, path: str) -> None:
        if not getattr(self, "_policies", None) or self._acting is not None:
            super().save_state(path)  # type: ignore[misc]
            return
        self.require_initialized()
        with atomic_dir(path) as tmp:
            self.call_ranks("adapters_dcp_save", {"tmp_dir": tmp})
            write_engine_state(tmp, POLICIES_STATE, {
                "policies": {
                    n: {"step": v.step, "version": v.get_version(), "param_names": [m["name"] for m in v.transfer_meta]}
                    for n, v in self._policies.items()
                },
                "version": self.get_version(),
                "total_train_steps": self.total_train_steps,
                **self.state_meta(),
                "config": self.config.model_dump(),
            })  # fmt: skip

    def load_state(self, path: str) -> None:
        if not getattr(self, "_policies", None) or self._acting is not None:
            super().load_state(path)  # type: ignore[misc]
            return
        self.require_initialized()
        meta = read_engine_state(path, POLICIES_STATE)
        saved = meta["policies"]
        if sorted(saved) != sorted(self._policies):
            raise DataError(f"{path!r} holds the policies {list(saved)}, this engine trains {list(self._policies)}")
        for n, v in self._policies.items():
            check_param_names(path, saved[n]["param_names"], [m["name"] for m in v.transfer_meta])
        self.call_ranks(
            "adapters_dcp_load",
            {"path": os.path.abspath(path), "steps": {n: int(s["step"]) for n, s in saved.items()}},
        )
        for n, v in self._policies.items():
            v.step = int(saved[n]["step"])
            v.set_version(int(saved[n]["version"]))
        self.set_version(int(meta["version"]))
