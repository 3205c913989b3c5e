"""Every hook of areal-kernel, in one place, grouped by phase.

A plugin is a module (named by an ``areal.plugins`` entry point) holding
functions decorated with ``areal_kernel.hookimpl`` whose names match the specs
below. Hooks run in whichever process first asks the registry for a name:
the controller (``areal train``), a train-engine rank, or an inference-server
process. Plugin loading is idempotent there, so hooks must be cheap and free
of side effects beyond calling ``register``.

Every registered target is built by ``Registry.build(kind, name, context)``,
which checks the result against its kind's contract: one module per kind in
``areal_kernel.api`` (see ``areal_kernel.api.kinds``).

Phases
------
1. Registration (``areal_register_*``): each receives a ``register`` callback
   and registers lazy factories by name. Called once per process, when the
   registry is first used.
2. Overrides (``firstresult``): the first non-``None`` answer wins; the kernel
   registers a ``trylast`` default for each.
3. Observers (``areal_on_*``): called in the controller process as the run
   progresses; return values are ignored.

The ``register`` callback
-------------------------
``register(name, target, *, config_model=None, platforms=None,
capabilities=(), description="", success_threshold=None, worker_preload=(),
settings_section=None)``

- ``name``: what users write in config (``"fsdp"``, ``"math"``).
- ``target``: ``"pkg.module:Attr"``, imported only when the name is used.
- ``config_model``: a pydantic model (or its ``"pkg.module:Model"`` path)
  validating the factory's own config section (``actor.fsdp: {...}``,
  ``algorithm.<estimator, loss or trainer>: {...}``, ``logging.<sink>: {...}``).
- ``platforms``: platform names it runs on (``None``: all).
- ``capabilities``: free-form strings (``"pause"``, ``"broadcast_update"``).
- ``success_threshold``: rewards only; the reward of a solved sample
  (``eval/accuracy`` counts answers that reach it; default 1.0).
- ``worker_preload``: rewards only; ``"pkg.module"`` (imported) or
  ``"pkg.module:function"`` (called) in each reward worker at start.
- ``settings_section``: trainers only (with a ``config_model``); the
  section under ``algorithm:`` holding its settings when it is not the
  trainer's own name, so that several trainers share one (the kernel's
  ``ipo`` reads ``algorithm.dpo``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import pluggy

if TYPE_CHECKING:
    from areal_kernel.config.models import ExperimentConfig

PROJECT = "areal"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

Register = Callable[..., None]

# ---------------------------------------------------------------------------
# 1. Registration hooks
# ---------------------------------------------------------------------------


@hookspec
def areal_register_train_engines(register: Register) -> None:
    """Register train engines (``actor.backend``), e.g. ``torch``, ``fsdp``.

    Target: a ``TrainEngine`` subclass. The kernel builds it in the
    controller as ``Target.from_context(context)``, where ``context`` is a
    ``TrainEngineContext`` (validated settings, the whole config, the
    allocation, the platform, the run directory, the run's scheduler, the
    role); see ``areal_kernel.api.engine``. Called once per process on
    first registry use.
    """


@hookspec
def areal_register_inference_engines(register: Register) -> None:
    """Register inference backends (``rollout.backend``), e.g. ``embedded``, ``vllm``.

    Target: an ``areal_kernel.inference.backend.InferenceBackend`` subclass,
    built as ``Backend.from_context(context)`` in the controller (an
    ``InferenceBackendContext``, ``areal_kernel.api.inference_engine``; the
    default calls ``Backend(config)``); the kernel calls
    ``launch(model_dir, device_plan, run_dir) -> addresses``,
    ``make_client(addresses) -> RemoteInferenceEngine`` and ``stop()``, and
    restarts dead servers through its ``launcher`` (a ``SubprocessLauncher``).
    Called once per process on first registry use.
    """


@hookspec
def areal_register_weight_transports(register: Register) -> None:
    """Register weight transports (``disk``, ``broadcast``, ...).

    Target: a ``WeightTransport`` subclass (``areal_kernel.api.weight_transport``)
    built as ``Transport.from_context(context)``, whose default calls
    ``Transport(train_engine, inference_engine, run_dir, bucket_bytes)``,
    with ``name``, ``setup()`` and
    ``update(version) -> dict[str, float]`` (servers serve the train
    engine's weights as ``version`` when it returns), used in the
    controller; see docs/plugin-authoring.md, "Weight transports".
    Called once per process on first registry use.
    """


@hookspec
def areal_register_schedulers(register: Register) -> None:
    """Register schedulers (``local``; third parties: Ray, Slurm).

    Target: a subclass of ``areal_kernel.api.scheduler.Scheduler``,
    built as ``Scheduler.from_context(context)`` in the controller (a
    ``SchedulerContext``; the default calls ``Scheduler(config)``): ``plan()`` places each
    role's processes (node, host, devices), ``spawn`` starts one on its node,
    ``start_inference``, ``start_train_ranks``, ``health``, ``stop()``; see
    docs/plugin-authoring.md, "Schedulers". Called once per process on
    first registry use.
    """


@hookspec
def areal_register_platforms(register: Register) -> None:
    """Register platforms by name (``cpu``, ``cuda``, ``npu``) for ``AREAL_PLATFORM``.

    Target: a ``Platform`` subclass. Automatic detection uses the cheap
    probes of the ``areal.platforms`` entry-point group instead.
    """


@hookspec
def areal_register_datasets(register: Register) -> None:
    """Register dataset sources (``dataset.type``), e.g. ``file``, ``hub``, ``arithmetic``.

    Target: ``source(config, seed, required)`` returning a list of record
    dicts (the kernel holds out ``dataset.eval_fraction`` of it for
    evaluation) or a ``(train, eval)`` tuple of such lists; ``config`` is
    the ``dataset`` section (own settings in ``config.plugin_config``),
    ``required`` the fields the workflow reads. Records are checked
    (required fields, unique ``id``, generated when absent) before any
    server starts; see ``areal_kernel.data.contract``. Called in the
    controller process.
    """


@hookspec
def areal_register_rewards(register: Register) -> None:
    """Register reward functions (``reward.type``), e.g. ``math``, ``exact_match``.

    Target: ``fn(completion: str, answer: str, **settings) -> float``:
    ``answer`` is the record's ``answer`` as a string, ``settings`` the
    validated ``reward.<name>`` section as JSON values (every field of the
    ``config_model``; nothing without one). Run in a worker process with
    the kernel's timeout.
    """


@hookspec
def areal_register_workflows(register: Register) -> None:
    """Register rollout workflows (``workflow.type``), e.g. ``rlvr``, ``multi_turn``.

    Target: a ``Workflow`` subclass (``areal_kernel.api.workflow``) built as
    ``Workflow.from_context(context)``, whose default passes the keywords
    ``tokenizer``, ``gconfig``, ``reward_target``, ``reward_pool`` and
    ``config``; its ``arun_episode(engine, record)`` returns a ``TrajectoryGroup`` (or
    ``None`` to reject) and ``aevaluate(engine, record, max_new_tokens)``
    a ``(reward, text)`` pair; see docs/plugin-authoring.md, "Workflows".
    Runs in the controller's asyncio loop.
    """


@hookspec
def areal_register_advantage_estimators(register: Register) -> None:
    """Register advantage estimators (``algorithm.advantage``), e.g. ``grpo``.

    Target: ``fn(rewards, group_ids, *, loss_masks, knobs, **kwargs)``
    returning one advantage per trajectory, one row per trajectory (per
    token) or an ``areal_kernel.algo.estimators.AdvantageResult``; the
    shared algorithm knobs arrive as one ``AdvantageKnobs`` object
    (``knobs``), the fields of its ``algorithm.<name>`` settings as
    keywords; see docs/algorithms.md.
    """


@hookspec
def areal_register_losses(register: Register) -> None:
    """Register policy losses (``algorithm.loss``), e.g. ``ppo``.

    Target: ``fn(logprobs, data, *, entropy, knobs, **kwargs) -> (loss, stats)``
    following the train engine's token-sum contract; the algorithm's loss
    knobs arrive as one ``LossKnobs`` object (``knobs``), the fields of its
    ``algorithm.<name>`` settings as keywords (see docs/algorithms.md).
    """


@hookspec
def areal_register_metric_sinks(register: Register) -> None:
    """Register metric sinks (``logging.sinks``), e.g. ``console``, ``jsonl``, ``tensorboard``.

    Target: a ``MetricSink`` subclass (``areal_kernel.api.metric_sink``)
    built as ``Sink.from_context(context)``, whose default calls
    ``Sink(run_dir, total_steps=..., **settings)`` (``settings``: the fields
    of its validated ``logging.<name>`` section),
    with ``log(step: int, metrics: dict[str, float])`` and ``close()``.
    Instantiated in the controller process; see docs/plugin-authoring.md.
    """


@hookspec
def areal_register_model_sources(register: Register) -> None:
    """Register model names that resolve to a local HF directory
    (``smollm2-135m-instruct``).

    Target: ``fn(variant: str | None) -> str`` returning the directory.
    """


@hookspec
def areal_register_trainers(register: Register) -> None:
    """Register trainers (``algorithm.type``), e.g. ``grpo``, ``sft``, ``dpo``.

    Target: a factory (usually a subclass of
    ``areal_kernel.api.trainer.Trainer``) called as ``factory(context)``
    with a ``TrainerContext`` (the validated config, the trainer's validated
    ``algorithm.<name>`` settings -- or ``algorithm.<settings_section>`` --,
    the run directory); it returns a
    ``Trainer`` on which ``areal train`` calls ``setup()``, ``train()`` and
    ``close(status)``. Capability ``rollout``: the trainer uses inference
    servers (``areal check`` and ``areal plan`` include them). Called in the
    controller process.
    """


@hookspec
def areal_register_tool_parsers(register: Register) -> None:
    """Register tool-call parsers (``workflow.multi_turn.tool_parser``), e.g. ``hermes``.

    Target: a class built with no arguments whose instances satisfy
    ``areal_kernel.tools.ToolCallParser``: ``stop_strings`` (generation
    stops after one of them, the turn then ends with
    ``stop_reason=tool_call``) and ``parse(text) -> ParsedOutput``, which
    never raises on model output (a malformed call is an entry of
    ``ParsedOutput.errors``). Used in the controller by the multi-turn
    workflow and the OpenAI-compatible proxy; see docs/plugin-authoring.md,
    "Tools and tool-call parsers".
    """


@hookspec
def areal_register_tools(register: Register) -> None:
    """Register tools a model may call (``workflow.multi_turn.tools``), e.g. ``calculator``, ``python``.

    Target: a class built as ``Tool(**settings)`` (``settings``: the fields
    of its validated ``config_model``; nothing without one) whose instances
    have ``description: str``, ``parameters`` (a JSON schema of the
    arguments, OpenAI function format) and ``async call(arguments: dict)
    -> str``. A call that raises or runs past its timeout becomes an error
    message fed back to the model; the run goes on. Called in the
    controller's asyncio loop; see docs/plugin-authoring.md, "Tools and
    tool-call parsers".
    """


@hookspec
def areal_register_environments(register: Register) -> None:
    """Register managed Python environments for roles that run from their own
    interpreter (``rollout.vllm.python: vllm``), e.g. ``vllm``.

    Target: ``fn(ctx: EnvironmentContext) -> EnvironmentSpec``
    (``areal_kernel.api.environment``): the requirements ``areal env
    create NAME`` installs on ``ctx.platform``, the ones an interpreter must
    satisfy (probed by ``areal env check`` and ``areal validate``) and
    whether in-memory weight updates need its torch to equal the
    trainer's. Called in the controller; the environment itself needs
    neither the kernel nor the plugin.
    """


REGISTRATION_HOOKS: dict[str, str] = {
    # registry kind -> hook name
    "train_engine": "areal_register_train_engines",
    "inference_engine": "areal_register_inference_engines",
    "weight_transport": "areal_register_weight_transports",
    "scheduler": "areal_register_schedulers",
    "platform": "areal_register_platforms",
    "dataset": "areal_register_datasets",
    "reward": "areal_register_rewards",
    "workflow": "areal_register_workflows",
    "advantage_estimator": "areal_register_advantage_estimators",
    "loss": "areal_register_losses",
    "metric_sink": "areal_register_metric_sinks",
    "model_source": "areal_register_model_sources",
    "trainer": "areal_register_trainers",
    "tool_parser": "areal_register_tool_parsers",
    "tool": "areal_register_tools",
    "environment": "areal_register_environments",
}

# ---------------------------------------------------------------------------
# 2. Override hooks (first non-None result wins)
# ---------------------------------------------------------------------------


@hookspec(firstresult=True)
def areal_select_weight_transport(train_backend: str, inference_backend: str, platform: str, mode: str) -> str | None:
    """Choose the weight transport name for a train/inference pair.

    ``mode`` is the user's ``weight_update.mode`` (``auto``, ``disk``,
    ``broadcast``). Called in the controller before the first update. The
    kernel default returns ``mode`` unless it is ``auto``, then ``broadcast``
    when the inference backend has the capability, else ``disk``.
    """


@hookspec(firstresult=True)
def areal_resolve_model_path(name_or_path: str) -> str | None:
    """Turn ``model.path`` into a local HF directory.

    Called in the controller before anything starts. Return ``None`` to let
    other plugins (and the kernel default: local directory or registered
    model source) answer.
    """


@hookspec(firstresult=True)
def areal_select_scheduler(config: "ExperimentConfig") -> str | None:
    """Choose the scheduler name when ``scheduler.type`` is ``auto``.

    Called in the controller. Kernel default: ``local``.
    """


# ---------------------------------------------------------------------------
# 3. Observer hooks (controller process; results ignored)
# ---------------------------------------------------------------------------


@hookspec
def areal_on_run_start(config: "ExperimentConfig", run_dir: str) -> None:
    """After the config is validated and the run directory exists, before servers start."""


@hookspec
def areal_on_rollout_batch(step: int, stats: dict[str, Any]) -> None:
    """After a training batch was collected from the rollout executor."""


@hookspec
def areal_on_train_step(step: int, metrics: dict[str, float]) -> None:
    """After each optimizer step, with the step's metrics."""


@hookspec
def areal_on_weight_update(version: int, transport: str, seconds: float) -> None:
    """After inference servers switched to weight ``version``."""


@hookspec
def areal_on_checkpoint(step: int, path: str) -> None:
    """After a checkpoint was completely written to ``path``."""


@hookspec
def areal_on_run_end(status: str, run_dir: str) -> None:
    """When the run ends; ``status`` is ``completed``, ``failed`` or ``interrupted``."""
