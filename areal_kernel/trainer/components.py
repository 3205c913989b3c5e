"""Build the parts of a run from the validated config through the registry.

Shared by ``areal train`` and ``areal check`` so both see exactly the same
data, workflow, reward and inference engine; every trainer builds its train
engines with ``build_train_engine``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

from pydantic import BaseModel

from areal_kernel.api.engine import TrainEngine, TrainEngineContext
from areal_kernel.api.io import GenerationConfig
from areal_kernel.config.models import ExperimentConfig
from areal_kernel.errors import ArealError, ConfigError
from areal_kernel.logging import get_logger
from areal_kernel.plugins import get_plugin_manager, get_registry

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
    spec = get_registry().get("train_engine", alloc.backend)
    target = spec.load()
    if not (isinstance(target, type) and issubclass(target, TrainEngine)):
        raise ConfigError(
            f"actor.backend: train engine '{alloc.backend}' (plugin '{spec.plugin}') registered {spec.target}, "
            "which is not a subclass of areal_kernel.api.engine.TrainEngine; the kernel builds train engines "
            "with Engine.from_context(context)"
        )
    context = TrainEngineContext(
        settings=cfg.actor.plugin_config if settings is _SECTION else settings,
        config=cfg,
        allocation=alloc,
        platform=current_platform(),
        run_dir=run_dir,
        scheduler=scheduler,
        role=role,
    )
    return target.from_context(context)


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
    from areal_kernel.data.contract import load_dataset

    spec = get_registry().get("dataset", cfg.dataset.type)
    who = needed_by or f"workflow '{cfg.workflow.type}'"
    train, evals = load_dataset(spec, cfg.dataset, cfg.seed, required, who)
    if not train:
        raise ArealError(f"dataset '{cfg.dataset.type}' produced no training records")
    return train, evals[: cfg.trainer.eval_size]


def reward_settings(cfg: ExperimentConfig) -> dict[str, Any]:
    """The selected reward's validated ``reward.<name>`` section as JSON data
    (every field of its ``config_model``, defaults included); ``{}`` when the
    reward declares no settings. These are the keywords the reward receives."""
    return reward_keywords(cfg.reward.plugin_config)


def reward_keywords(settings: Any) -> dict[str, Any]:
    """Validated reward settings (what ``validate_settings`` returns for a
    ``reward.<name>`` section) as the keywords the reward receives; the reward
    contract suite passes its settings through here too."""
    if settings is None:
        return {}
    if isinstance(settings, BaseModel):
        # mode="json": what reaches the worker process is what JSON can carry.
        return settings.model_dump(mode="json")
    return dict(settings)


def make_reward_pool(cfg: ExperimentConfig) -> Any:
    """The run's ``RewardPool``, with the selected reward's settings bound to
    it: every ``pool.ascore(reward_target, completion, answer)`` (any
    workflow's) calls ``reward(completion, answer, **reward_settings(cfg))``."""
    from areal_kernel.reward.pool import RewardPool

    spec = get_registry().get("reward", cfg.reward.type)
    return RewardPool(
        n_workers=cfg.reward.workers,
        timeout_s=cfg.reward.timeout_s,
        # What the reward's registration asked its workers to load up front (worker_preload=).
        preload=spec.worker_preload,
        settings={spec.target: reward_settings(cfg)},
    )


def generation_config(cfg: ExperimentConfig) -> GenerationConfig:
    g = cfg.rollout.gconfig
    return GenerationConfig(
        max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, n_samples=g.n_samples
    )


@dataclass
class Rollout:
    """Inference servers + the client + the workflow + the reward pool."""

    cfg: ExperimentConfig
    run_dir: str
    model_dir: str
    tokenizer: Any
    backend: Any = None
    scheduler: Any = None
    engine: Any = None
    workflow: Any = None
    reward_pool: Any = None
    supervisor: Any = None  # restarts dead servers (rollout.restart_servers); None when off or unsupported
    # The newest recovery checkpoint's path (quoted when a server is lost for good).
    recovery_hint: Callable[[], str | None] | None = None
    addresses: list[str] = field(default_factory=list)

    def start(self) -> "Rollout":
        cfg, reg = self.cfg, get_registry()
        backend_spec = reg.get("inference_engine", cfg.rollout.allocation.backend)
        self.backend = backend_spec.load()(cfg)
        from areal_kernel.scheduling.plan import make_scheduler

        self.scheduler = make_scheduler(cfg)
        os.makedirs(self.run_dir, exist_ok=True)
        self.addresses = self.scheduler.start_inference(self.backend, self.model_dir, self.run_dir)
        self.engine = self.backend.make_client(self.addresses)
        from areal_kernel.inference.supervisor import start_supervisor

        self.supervisor = start_supervisor(self.backend, self.engine, cfg.rollout, recovery_hint=self.recovery_hint)
        reward_spec = reg.get("reward", cfg.reward.type)
        self.reward_pool = make_reward_pool(cfg)
        wf_spec = reg.get("workflow", cfg.workflow.type)
        self.workflow = wf_spec.load()(
            tokenizer=self.tokenizer,
            gconfig=generation_config(cfg),
            reward_target=reward_spec.target,
            reward_pool=self.reward_pool,
            config=cfg.workflow.plugin_config,
        )
        return self

    def check(self) -> None:
        """Raise if a server was lost for good (restart budget spent)."""
        if self.supervisor is not None:
            self.supervisor.check()

    def server_stats(self) -> dict[str, float]:
        """Failovers and restarts so far (for metrics)."""
        out: dict[str, float] = {}
        if self.engine is not None and hasattr(self.engine, "stats"):
            out["rollout/failovers"] = self.engine.stats.get("failovers", 0)
        if self.supervisor is not None:
            out["rollout/server_restarts"] = self.supervisor.total_restarts
        return out

    def stop(self) -> None:
        # The supervisor first: servers stopped below must not be restarted.
        if self.supervisor is not None:
            self.supervisor.stop()
        # A workflow may own services (the agent proxy); they go before the servers they call.
        close = getattr(self.workflow, "close", None)
        if close is not None:
            close()
        if self.engine is not None:
            self.engine.destroy()
        if self.scheduler is not None:
            self.scheduler.stop()
        if self.reward_pool is not None:
            self.reward_pool.close()


def workflow_required_fields(cfg: ExperimentConfig) -> tuple[str, ...]:
    cls = get_registry().get("workflow", cfg.workflow.type).load()
    return tuple(getattr(cls, "required_fields", ("prompt",)))
