"""Build the parts of a run from the validated config through the registry.

Shared by ``areal train`` and ``areal check`` so both see exactly the same
data, workflow, reward and inference engine; every trainer builds its train
engines with ``build_train_engine``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence


from areal_kernel.api.engine import InferenceEngine, TrainEngine, TrainEngineContext
from areal_kernel.api.inference_engine import InferenceBackendContext, InferenceBackendProtocol
from areal_kernel.api.io import GenerationConfig, TrajectoryGroup
from areal_kernel.api.reward import Reward, RewardContext, json_settings
from areal_kernel.api.scheduler import Scheduler
from areal_kernel.api.workflow import DEFAULT_REQUIRED_FIELDS, WorkflowContext, WorkflowProtocol
from areal_kernel.config.models import ExperimentConfig
from areal_kernel.errors import ArealError, ConfigError
from areal_kernel.logging import get_logger
from areal_kernel.plugins import get_plugin_manager, get_registry

if TYPE_CHECKING:
    from areal_kernel.reward.pool import RewardPool

log = get_logger(__name__)

_SECTION = object()  # build_train_engine's default: the validated actor.<backend> section


def build_train_engine(
    cfg: ExperimentConfig,
    run_dir: str,
    *,
    settings: Any = _SECTION,
    scheduler: Any = None,
    role: str = "actor",
) -> TrainEngine:
    """The train engine of ``actor.backend``, built by its registered class as
    ``Engine.from_context(TrainEngineContext(...))`` (not yet initialized).
    ``settings`` defaults to the validated ``actor.<backend>`` section; a
    trainer passes an adjusted copy when it overrides a setting for the run."""
    from areal_kernel.platforms import current_platform

    alloc = cfg.actor.allocation
    context = TrainEngineContext(
        settings=cfg.actor.plugin_config if settings is _SECTION else settings,
        config=cfg,
        allocation=alloc,
        platform=current_platform(),
        run_dir=run_dir,
        scheduler=scheduler,
        role=role,
    )
    return get_registry().build("train_engine", alloc.backend, context)


def resolve_model_dir(cfg: ExperimentConfig) -> str:
    try:
        path = get_plugin_manager().hook.areal_resolve_model_path(name_or_path=cfg.model.path)
    except ArealError as e:
        # Resolvers name the value; the user edits the field, so name it too.
        msg = str(e)
        if msg.startswith("model.path"):
            raise
        raise type(e)(f"model.path: {msg}") from None
    if not path:
        raise ConfigError(f"model.path: cannot resolve {cfg.model.path!r} to a local model directory")
    return path


def log_model_precision(cfg: ExperimentConfig, model_dir: str) -> None:
    """Say the dtype the weights are stored in beside ``model.dtype``, the
    precision they run in, where the two differ: a known name resolves to a
    directory named for its storage dtype (smollm2-135m-instruct ->
    ...-bfloat16) while the default ``model.dtype`` is float32. Called once
    the user's input has passed its checks, so a bad-input error stays one
    line."""
    stored = stored_dtype(model_dir)
    if stored in ("bfloat16", "float16") and cfg.model.dtype == "float32":
        log.info("model", path=model_dir, weights_stored_as=stored, runs_as=f"{cfg.model.dtype} (model.dtype)")
        log.info(f"the weights are {stored} values, loaded as float32 (exactly); a known model name with "
                 "'@float32' (smollm2-135m-instruct@float32) is converted from its source in float32")  # fmt: skip


def stored_dtype(model_dir: str) -> str | None:
    """The dtype an HF directory's weights are stored in (``config.json``'s
    ``dtype``, or ``torch_dtype`` in older files), or ``None`` if it says none."""
    import json

    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    dtype = config.get("dtype") or config.get("torch_dtype")
    return str(dtype) if dtype else None


def load_tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:
        raise ConfigError(f"model.path: no usable tokenizer in {model_dir}: {type(e).__name__}: {e}") from None


def load_data(
    cfg: ExperimentConfig, required: tuple[str, ...], needed_by: str | None = None
) -> tuple[list[dict], list[dict]]:
    """``(train, eval)`` records of the selected dataset, checked under the
    dataset contract (``areal_kernel.data.contract``): every record has the
    ``required`` fields and a unique string id. ``needed_by`` names who reads
    them, for messages (default: the selected workflow)."""
    from areal_kernel.api.dataset import DatasetContext
    from areal_kernel.data.contract import finish_dataset
    from areal_kernel.plugins.blame import spec_origin

    reg = get_registry()
    spec = reg.get("dataset", cfg.dataset.type)
    context = DatasetContext(
        name=cfg.dataset.type,
        config=cfg.dataset,
        seed=cfg.seed,
        required=tuple(required),
        needed_by=needed_by or f"workflow '{cfg.workflow.type}'",
        origin=spec_origin(spec),
    )
    splits = reg.build("dataset", cfg.dataset.type, context)
    train, evals = finish_dataset(splits, spec, cfg.dataset, cfg.seed)
    if not train:
        raise ArealError(f"dataset '{cfg.dataset.type}' produced no training records")
    return train, evals[: cfg.trainer.eval_size]


def reward_settings(cfg: ExperimentConfig) -> dict[str, Any]:
    """The selected reward's validated ``reward.<name>`` section as JSON data
    (every field of its ``config_model``, defaults included); ``{}`` when the
    reward declares no settings. These are the keywords the reward receives
    (``Reward.settings`` of the built reward)."""
    # mode="json": what reaches the worker process is what JSON can carry.
    return json_settings(cfg.reward.plugin_config)


def build_reward(cfg: ExperimentConfig) -> Reward:
    """The selected reward (``reward.type``), built with its validated
    ``reward.<name>`` settings bound (``areal_kernel.api.reward.Reward``)."""
    return get_registry().build("reward", cfg.reward.type, RewardContext(cfg.reward.type, cfg.reward.plugin_config))


def make_reward_pool(cfg: ExperimentConfig, reward: Reward | None = None) -> "RewardPool":
    """The run's ``RewardPool``, with the selected reward's settings bound to
    it: every ``pool.ascore(reward.target, completion, answer)`` (any
    workflow's) calls ``reward(completion, answer, **reward_settings(cfg))``.
    ``reward``: the run's built reward (default: built here)."""
    from areal_kernel.reward.pool import RewardPool

    reward = reward if reward is not None else build_reward(cfg)
    return RewardPool(
        n_workers=cfg.reward.workers,
        timeout_s=cfg.reward.timeout_s,
        # What the reward's registration asked its workers to load up front (worker_preload=).
        preload=reward.worker_preload,
        settings={reward.target: dict(reward.settings)},
    )


def generation_config(cfg: ExperimentConfig) -> GenerationConfig:
    g = cfg.rollout.gconfig
    return GenerationConfig(
        max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, n_samples=g.n_samples
    )


@dataclass
class Rollout:
    """Inference servers + the client + the workflow + the reward pool.

    A context manager: ``with`` a started rollout stops it at the end.
    ``backend``, ``scheduler``, ``engine``, ``workflow``, ``reward`` and
    ``reward_pool`` exist once ``start()`` has built them (reading one before
    raises ``RuntimeError``); ``stop()`` releases whatever was built."""

    cfg: ExperimentConfig
    run_dir: str
    model_dir: str
    tokenizer: Any
    supervisor: Any = None  # restarts dead servers (rollout.restart_servers); None when off or unsupported
    # The newest recovery checkpoint's path (quoted when a server is lost for good).
    recovery_hint: Callable[[], str | None] | None = None
    addresses: list[str] = field(default_factory=list)
    # Who is in the fleet (``areal fleet``, ``rollout.elastic``); built by start().
    fleet: Any = None
    _backend: InferenceBackendProtocol | None = field(default=None, init=False, repr=False)
    _scheduler: Scheduler | None = field(default=None, init=False, repr=False)
    _engine: InferenceEngine | None = field(default=None, init=False, repr=False)
    _workflow: WorkflowProtocol | None = field(default=None, init=False, repr=False)
    _reward: Reward | None = field(default=None, init=False, repr=False)
    _reward_pool: "RewardPool | None" = field(default=None, init=False, repr=False)
    _stopped: bool = field(default=False, init=False, repr=False)
    # The LoRA adapter this rollout's workflow samples with (a multi-policy
    # run: the policy's); None: the client's default adapter.
    adapter: str | None = None
    # Built by ``attach``: the servers, client and scheduler are another
    # rollout's, which stops them; this one stops only its workflow and reward pool.
    _attached: bool = field(default=False, init=False, repr=False)

    @staticmethod
    def _started(part: Any, name: str) -> Any:
        if part is None:
            raise RuntimeError(f"Rollout.{name}: the rollout is not started (call start() first)")
        return part

    @property
    def backend(self) -> InferenceBackendProtocol:
        """The inference backend (``rollout.backend``) that started the servers."""
        return self._started(self._backend, "backend")

    @property
    def scheduler(self) -> Scheduler:
        """The run's scheduler (the servers' and the train engines' processes)."""
        return self._started(self._scheduler, "scheduler")

    @property
    def engine(self) -> InferenceEngine:
        """The client of the running servers."""
        return self._started(self._engine, "engine")

    @property
    def workflow(self) -> WorkflowProtocol:
        """The built workflow (``workflow.type``)."""
        return self._started(self._workflow, "workflow")

    @property
    def reward(self) -> Reward:
        """The built reward (``reward.type``), settings bound."""
        return self._started(self._reward, "reward")

    @property
    def reward_pool(self) -> "RewardPool":
        """The reward worker pool the workflow scores through."""
        return self._started(self._reward_pool, "reward_pool")

    def start(self) -> "Rollout":
        cfg, reg = self.cfg, get_registry()
        self._backend = backend = reg.build(
            "inference_engine", cfg.rollout.allocation.backend, InferenceBackendContext.for_config(cfg)
        )
        from areal_kernel.scheduling.plan import make_scheduler

        self._scheduler = scheduler = make_scheduler(cfg)
        os.makedirs(self.run_dir, exist_ok=True)
        self.addresses = scheduler.start_inference(backend, self.model_dir, self.run_dir)
        self._engine = engine = backend.make_client(self.addresses)
        from areal_kernel.inference.supervisor import start_supervisor, supports_restart

        self.supervisor = start_supervisor(backend, engine, cfg.rollout, recovery_hint=self.recovery_hint)
        if hasattr(engine, "add_server"):
            # The kernel's client can change its servers while the run goes on.
            from areal_kernel.inference.fleet import Fleet

            launcher = getattr(backend, "launcher", None)
            self.fleet = Fleet(engine, launcher if supports_restart(launcher) else None, self.model_dir, cfg.rollout)
            if self.supervisor is not None:
                self.supervisor.retire = self.fleet.retire_dead
        self._build_workflow()
        return self

    def _build_workflow(self) -> None:
        cfg = self.cfg
        self._reward = reward = build_reward(cfg)
        self._reward_pool = pool = make_reward_pool(cfg, reward)
        gconfig = generation_config(cfg)
        if self.adapter is not None:
            gconfig = dataclasses.replace(gconfig, adapter=self.adapter)
        context = WorkflowContext(
            name=cfg.workflow.type,
            tokenizer=self.tokenizer,
            gconfig=gconfig,
            reward=reward,
            reward_pool=pool,
            settings=cfg.workflow.plugin_config,
            config=cfg,
        )
        self._workflow = get_registry().build("workflow", cfg.workflow.type, context)

    def attach(self, cfg: ExperimentConfig, adapter: str | None) -> "Rollout":
        """Another workflow (``cfg``'s workflow, reward and reward pool,
        sampling with ``adapter``) on this started rollout's servers and
        client: a multi-policy run's policy. Its ``stop`` closes only what it
        built; this rollout's ``stop`` ends the servers."""
        other = Rollout(cfg, self.run_dir, self.model_dir, self.tokenizer, adapter=adapter)
        other._backend, other._scheduler, other._engine = self.backend, self.scheduler, self.engine
        other.addresses = list(self.addresses)
        other._attached = True
        try:
            other._build_workflow()
        except BaseException:
            other.stop()
            raise
        return other

    def __enter__(self) -> "Rollout":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def run_episodes(self, records: Sequence[dict], what: str = "rollout episodes") -> list[TrajectoryGroup | None]:
        """``workflow.arun_episode(engine, record)`` for every record at once
        (in order; ``None`` where the workflow rejected a record), on an event
        loop of its own that ends with the call (``what`` names it in log
        messages). Each group's trajectories carry their rewards."""
        from areal_kernel.utils import aio

        return aio.run(self._episodes(list(records)), what)

    async def _episodes(self, records: list[dict]) -> list[TrajectoryGroup | None]:
        wf, engine = self.workflow, self.engine
        try:
            return list(await asyncio.gather(*(wf.arun_episode(engine, r) for r in records)))
        finally:
            # The client's HTTP sessions belong to this loop, which ends here.
            close = getattr(engine, "aclose", None)
            if close is not None:
                await close(current_loop_only=True)

    def check(self) -> None:
        """Raise if a server was lost for good (restart budget spent)."""
        if self.supervisor is not None:
            self.supervisor.check()

    def server_stats(self) -> dict[str, float]:
        """Failovers, interrupted generations and restarts so far (for metrics)."""
        out: dict[str, float] = {}
        if self._engine is not None and hasattr(self._engine, "stats"):
            out["rollout/failovers"] = self._engine.stats.get("failovers", 0)
            # Generations cut by a weight update (or a drain) and resumed.
            out["rollout/interruptions"] = self._engine.stats.get("interruptions", 0)
        if self.supervisor is not None:
            out["rollout/server_restarts"] = self.supervisor.total_restarts
        if self.fleet is not None and not self._attached:
            out.update(self.fleet.metrics())
        return out

    def stop(self) -> None:
        """Stop what ``start()`` built (all of it or the part it got to);
        a second call does nothing."""
        if self._stopped:
            return
        self._stopped = True
        if self._attached:
            close_wf = getattr(self._workflow, "close", None)
            if close_wf is not None:
                close_wf()
            if self._reward_pool is not None:
                self._reward_pool.close()
            return
        # The supervisor first: servers stopped below must not be restarted.
        if self.supervisor is not None:
            self.supervisor.stop()
        # A workflow may own services (the agent proxy); they go before the servers they call.
        close = getattr(self._workflow, "close", None)
        if close is not None:
            close()
        if self._engine is not None:
            self._engine.destroy()
        if self._scheduler is not None:
            self._scheduler.stop()
        if self._reward_pool is not None:
            self._reward_pool.close()


def workflow_required_fields(cfg: ExperimentConfig) -> tuple[str, ...]:
    """The record fields the selected workflow reads (its class's
    ``required_fields``), known before anything is built."""
    cls = get_registry().get("workflow", cfg.workflow.type).load()
    return tuple(getattr(cls, "required_fields", DEFAULT_REQUIRED_FIELDS))
