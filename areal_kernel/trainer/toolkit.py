"""The trainer toolkit: the parts of a run, built from a ``TrainerContext``.

A trainer plugin (``areal_register_trainers``) that uses inference servers
gets every part the built-in ``grpo`` trainer uses from here, built the same
way (the ``grpo`` trainer calls these same functions):

- ``resolve_model(ctx)``: the local model directory ``model.path`` names
  (model sources resolved) and its tokenizer, as a ``ResolvedModel``;
- ``load_datasets(ctx)``: the selected dataset's training records and the
  held-out split (``trainer.eval_size`` of them), checked under the dataset
  contract, as ``Datasets``;
- ``finetune_spec(ctx, n_train)``: the run's step count
  (``trainer.total_train_epochs``, ``trainer.batch_size``,
  ``trainer.max_steps``);
- ``open_metric_sinks(ctx, total_steps)``: the ``logging.sinks``, as one
  ``MetricSinks`` (``log(step, metrics)``, ``close()``);
- ``start_rollout(ctx, model)``: the inference servers of ``rollout:``
  started, with their client (``engine``), the workflow, the reward and the
  reward pool, as a ``Rollout`` (a context manager that stops it all;
  ``rollout.run_episodes(records)`` samples and scores a batch of records);
- ``evaluate_held_out(ctx, rollout, records)``: greedy answers to the
  held-out records, scored (``eval/reward``, ``eval/accuracy``);
  ``held_out_job`` is the same as an ``EvalJob``, and ``evaluate_together``
  asks several such jobs at once (several policies' sets share batches);
- ``start_train_engine(ctx, model, total_steps)``: the ``actor.backend``
  train engine, built and initialized;
- ``build_weight_transport(ctx, engine, rollout)``: the transport that
  ``weight_update.mode`` selects (call its ``setup()``; ``update(version)``
  then puts the train engine's weights on the servers);
- ``build_reward(ctx)`` and ``start_reward_pool(ctx)``: the selected reward
  with its settings bound, and a ``RewardPool`` of worker processes that
  calls it (the rollout has its own; these are for a trainer that scores
  outside a workflow).

Each function checks what can fail on user input first and names the
config field in its error (an ``ArealError``: one line, exit code 2). What
a function starts, the caller stops (``close``/``stop``/``destroy``), except
where the function itself failed half-way: then it stops what it started
before raising. Worked example: docs/plugin-authoring.md, "A trainer that
uses inference servers".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from areal_kernel.api.dataset import Record
from areal_kernel.api.engine import TrainEngine
from areal_kernel.api.io import FinetuneSpec, GenerationConfig
from areal_kernel.api.metric_sink import MetricSinkProtocol
from areal_kernel.api.reward import Reward
from areal_kernel.api.trainer import TrainerContext
from areal_kernel.api.weight_transport import WeightTransportContext, WeightTransportProtocol
from areal_kernel.logging import get_logger
from areal_kernel.plugins import get_plugin_manager, get_registry
from areal_kernel.trainer import components
from areal_kernel.trainer.common import make_sinks
from areal_kernel.trainer.components import Rollout
from areal_kernel.trainer.evaluate import EvalJob, evaluate_together

if TYPE_CHECKING:
    from areal_kernel.reward.pool import RewardPool

__all__ = [
    "ResolvedModel",
    "Datasets",
    "MetricSinks",
    "Rollout",
    "ENGINE_SECTION",
    "resolve_model",
    "load_datasets",
    "finetune_spec",
    "open_metric_sinks",
    "start_rollout",
    "start_train_engine",
    "build_weight_transport",
    "evaluate_held_out",
    "held_out_job",
    "EvalJob",
    "evaluate_together",
    "build_reward",
    "start_reward_pool",
    "generation_config",
]

log = get_logger(__name__)

# start_train_engine's default settings: the validated actor.<backend> section.
ENGINE_SECTION: Any = components._SECTION


@dataclass(frozen=True)
class ResolvedModel:
    """``model.path`` resolved: ``path``, a local HF model directory (a known
    name or a model source's answer, downloaded or converted as needed), and
    ``tokenizer``, its ``transformers`` tokenizer."""

    path: str
    tokenizer: Any


@dataclass(frozen=True)
class Datasets:
    """The selected dataset's records: ``train`` (in the dataset's order;
    ``RecordStream`` of ``areal_kernel.trainer.common`` hands them out in a
    seeded order) and ``held_out`` (at most ``trainer.eval_size`` records
    that are never trained on; empty when evaluation is off)."""

    train: list[Record]
    held_out: list[Record]


class MetricSinks:
    """The run's metric sinks (``logging.sinks``) as one: ``log`` hands a
    step's metrics to each, ``close`` closes each (once is enough; again is
    harmless, sinks tolerate it)."""

    def __init__(self, sinks: Sequence[MetricSinkProtocol]) -> None:
        self.sinks: list[MetricSinkProtocol] = list(sinks)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Numbers are logged; values that are not (text, ``None``, lists)
        are skipped by each sink, so a trainer may pass its whole dict."""
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

    def __iter__(self) -> Iterator[MetricSinkProtocol]:
        return iter(self.sinks)

    def __len__(self) -> int:
        return len(self.sinks)


def resolve_model(ctx: TrainerContext) -> ResolvedModel:
    """``model.path`` as a local directory with its tokenizer. A name no
    model source knows, a missing directory or one without a usable
    tokenizer is a ``ConfigError`` naming ``model.path``."""
    path = components.resolve_model_dir(ctx.config)
    return ResolvedModel(path=path, tokenizer=components.load_tokenizer(path))


def load_datasets(ctx: TrainerContext, required: Sequence[str] | None = None, needed_by: str | None = None) -> Datasets:
    """The selected dataset (``dataset.type``, its settings, ``dataset.path``),
    built through the registry and checked under the dataset contract: every
    record has the ``required`` fields and a unique string id; train and
    held-out records never share an id. ``required`` defaults to what the
    selected workflow reads (its ``required_fields``); ``needed_by`` names
    the reader in error messages (default: the workflow). No training record
    at all is an ``ArealError`` naming the dataset."""
    cfg = ctx.config
    fields = tuple(required) if required is not None else components.workflow_required_fields(cfg)
    train, held_out = components.load_data(cfg, fields, needed_by)
    return Datasets(train=train, held_out=held_out)


def finetune_spec(ctx: TrainerContext, n_train: int) -> FinetuneSpec:
    """The run's length for ``n_train`` training records:
    ``total_train_steps`` is ``trainer.total_train_epochs`` epochs of
    ``trainer.batch_size`` records, cut at ``trainer.max_steps``."""
    t = ctx.config.trainer
    return FinetuneSpec(
        total_train_epochs=t.total_train_epochs,
        dataset_size=n_train,
        train_batch_size=t.batch_size,
        max_steps=t.max_steps,
    )


def open_metric_sinks(ctx: TrainerContext, total_steps: int) -> MetricSinks:
    """The sinks named in ``logging.sinks``, each built with its validated
    ``logging.<name>`` section and writing under ``ctx.run_dir``
    (``total_steps`` is for progress displays)."""
    return MetricSinks(make_sinks(ctx.config, ctx.run_dir, total_steps))


def generation_config(ctx: TrainerContext) -> GenerationConfig:
    """``rollout.gconfig`` as the ``GenerationConfig`` workflows sample with."""
    return components.generation_config(ctx.config)


def start_rollout(
    ctx: TrainerContext,
    model: ResolvedModel,
    *,
    recovery_hint: Callable[[], str | None] | None = None,
    adapter: str | None = None,
) -> Rollout:
    """Start the inference servers of ``rollout:`` on ``model`` and build what
    talks to them; returns the started ``Rollout``:

    - ``engine``: the client of the servers (an ``InferenceEngine``;
      ``workflow.arun_episode(engine, record)`` samples through it);
    - ``workflow``: the selected workflow (``workflow.type``), with
      ``reward`` and ``reward_pool`` wired in, so a group it returns carries
      each sample's reward;
    - ``reward`` (settings bound; ``reward.success_threshold``) and
      ``reward_pool``; ``backend``, ``scheduler`` (also the train engine's,
      pass it to ``start_train_engine``), ``addresses``;
    - ``run_episodes(records)``: the workflow's groups for ``records``
      (sampled and scored at once, on an event loop of its own);
    - ``check()`` raises when a server was lost for good,
      ``server_stats()`` counts failovers and restarts, ``stop()`` releases
      everything (also after a failed start; use ``with``, or call it from
      your trainer's ``close``).

    ``recovery_hint``: called when a server is lost for good, for the path
    of the newest checkpoint to quote in the error. ``adapter``: the LoRA
    adapter the workflow samples with (unset: the client's default).
    ``rollout.attach(config, adapter)`` builds another workflow, reward and
    reward pool on the same servers (a multi-policy run's other policies).
    If starting fails half-way, what was started is stopped before the
    error propagates."""
    rollout = Rollout(
        ctx.config, ctx.run_dir, model.path, model.tokenizer, recovery_hint=recovery_hint, adapter=adapter
    )
    try:
        return rollout.start()
    except BaseException:
        rollout.stop()
        raise


def start_train_engine(
    ctx: TrainerContext,
    model: ResolvedModel,
    total_steps: int,
    *,
    settings: Any = ENGINE_SECTION,
    scheduler: Any = None,
    role: str = "actor",
) -> TrainEngine:
    """The ``actor.backend`` train engine (``Engine.from_context(TrainEngineContext)``),
    initialized from ``model.path`` with a learning-rate schedule over
    ``total_steps`` optimizer steps. ``settings``: the validated
    ``actor.<backend>`` section by default, or an adjusted copy
    (``section.model_copy(update=...)``); ``scheduler``: the rollout's
    (``rollout.scheduler``) when there is one, so the engine's ranks are
    placed beside the servers; ``role``: ``"actor"`` for the trained
    policy, another name (``"ref"``) for a further engine. The caller calls
    ``destroy()`` at the end; a failed ``initialize`` destroys it here."""
    engine = components.build_train_engine(ctx.config, ctx.run_dir, settings=settings, scheduler=scheduler, role=role)
    try:
        engine.initialize(model.path, total_steps)
    except BaseException:
        try:
            engine.destroy()
        except Exception as e:  # the initialize error is the one to report
            log.warning("train engine destroy after a failed initialize failed", error=repr(e))
        raise
    return engine


def build_weight_transport(ctx: TrainerContext, engine: TrainEngine, rollout: Rollout) -> WeightTransportProtocol:
    """The weight transport for this run (chosen by the
    ``areal_select_weight_transport`` hook from ``weight_update.mode``, the
    train and inference backends and the platform), built between ``engine``
    and the rollout's servers. Keep it, then call ``transport.setup()``: a
    setup that fails leaves the transport for your ``close`` to release in
    order. ``transport.update(version)`` puts ``engine``'s current weights
    on every server under ``version`` and returns its metrics; call
    ``transport.close()`` (when it has one) after ``rollout.stop()``: the
    servers may read its files or join its process group until then."""
    cfg = ctx.config
    name = get_plugin_manager().hook.areal_select_weight_transport(
        train_backend=cfg.actor.allocation.backend,
        inference_backend=cfg.rollout.allocation.backend,
        platform=rollout.scheduler.platform.name,
        mode=cfg.weight_update.mode,
    )
    if name != "disk":  # every other transport moves tensors in memory
        from areal_kernel.environments import in_memory_fallback

        why = in_memory_fallback(cfg)
        if not why and cfg.rollout.share_devices and rollout.scheduler.platform.exclusive_devices:
            # NCCL (and its kin) refuse a group with two members on one device.
            why = "rollout.share_devices puts the servers on the train ranks' devices"
        if why:
            # gloo/NCCL exchange tensors in torch's own wire format (both ends
            # need the same torch) between members on devices of their own.
            # Disk works across any two.
            log.warning("in-memory weight updates cannot reach the servers; using disk", why=why)
            name = "disk"
    transport: WeightTransportProtocol = get_registry().build(
        "weight_transport",
        name,
        WeightTransportContext(
            name=name,
            train_engine=engine,
            inference_engine=rollout.engine,
            run_dir=ctx.run_dir,
            bucket_bytes=cfg.weight_update.bucket_mb << 20,
            config=cfg,
        ),
    )
    return transport


def held_out_job(ctx: TrainerContext, rollout: Rollout, records: Sequence[Record]) -> EvalJob:
    """``evaluate_held_out``'s work as an ``EvalJob``, for
    ``evaluate_together`` (several held-out sets asked at once)."""
    return EvalJob(
        rollout.workflow,
        rollout.engine,
        list(records),
        ctx.config.rollout.gconfig.max_new_tokens,
        rollout.reward.success_threshold,
    )


def evaluate_held_out(ctx: TrainerContext, rollout: Rollout, records: Sequence[Record]) -> dict[str, Any]:
    """One greedy answer per held-out record (``workflow.aevaluate``, at
    most ``rollout.gconfig.max_new_tokens`` tokens), scored by the reward:
    ``eval/reward`` (mean reward), ``eval/accuracy`` (the fraction whose
    reward reaches the reward's ``success_threshold``), ``eval/n`` and
    ``samples`` (``(prompt, answer, completion, reward)`` per record). No
    records: NaN means and ``eval/n`` 0."""
    return evaluate_together([held_out_job(ctx, rollout, records)])[0]


def build_reward(ctx: TrainerContext) -> Reward:
    """The selected reward (``reward.type``) with its validated
    ``reward.<name>`` section bound: ``reward.fn(completion, answer,
    **reward.settings)`` is a score; ``reward.success_threshold`` is the score
    that counts as solved."""
    return components.build_reward(ctx.config)


def start_reward_pool(ctx: TrainerContext, reward: Reward | None = None) -> "RewardPool":
    """A pool of ``reward.workers`` worker processes with ``reward``'s
    settings bound (default: ``build_reward(ctx)``):
    ``await pool.ascore(reward.target, completion, answer)`` (or
    ``pool.score(...)`` outside an event loop) returns a ``RewardResult``
    (``ok``, ``score``, ``error``) within ``reward.timeout_s``. A
    ``RewardPool`` is a context manager; ``close()`` ends the workers."""
    return components.make_reward_pool(ctx.config, reward)
