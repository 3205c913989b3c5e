"""The experiment configuration (pydantic v2).

Every section a user writes in YAML is a model here; sections whose content
depends on the chosen backend/type (``actor``, ``rollout``, ``dataset``,
``reward``, ``workflow``) hold that implementation's settings under its name,
validated against the model its plugin registered.

Two phases: validating these models checks the config's shape and needs no
plugin; ``areal_kernel.config.resolve(config, registry)`` then checks the
plugin names and validates each plugin's settings section. Nothing here
looks a plugin up.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from areal_kernel.config.monitor import MonitorConfig
from areal_kernel.config.offline import FORMER_ALGORITHM_FIELDS
from areal_kernel.config.sections import PluginSection, StrictModel, require_resolved, unknown_section_error
from areal_kernel.errors import ArealDeprecationWarning, ConfigError


class ModelConfig(StrictModel):
    path: str = Field(
        "smollm2-135m-instruct",
        description="Local HF directory, or a registered model name (see `areal plugins`).",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Inference weights dtype (bfloat16 only pays off on CPUs with avx512_bf16/AMX or on GPUs).",
    )


class ActorConfig(PluginSection):
    """``backend``: train engine allocation, e.g. ``torch`` or ``fsdp:d2``."""

    registry_kind = "train_engine"
    selector = "backend"
    section_path = "actor"
    allocation_selector = True
    backend: str = "torch"


class GenerationSettings(StrictModel):
    max_new_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    n_samples: int = Field(8, ge=1, description="Samples per prompt (the GRPO group size).")


class ElasticConfig(StrictModel):
    """``rollout.elastic``: the fleet grows and shrinks within ``[min, max]``
    servers while the run goes on (docs/elastic.md). The run starts with
    ``rollout.backend``'s replica count, which must lie in that range."""

    min: int = Field(1, ge=1, description="Fewest servers: a drain below it is refused, a dead server restarted.")
    max: int = Field(2, ge=1, description="Most servers: the scheduler starts no more, `areal fleet add` is refused.")
    grow_wait_fraction: float = Field(
        0.3,
        gt=0,
        le=1,
        description="Grow when the trainer waited for rollouts more than this fraction of a step, "
        "`patience` steps in a row.",
    )
    shrink_stale_dropped: int = Field(
        1,
        ge=1,
        description="Shrink when at least this many finished rollouts per step were dropped as too stale, "
        "`patience` steps in a row (rollout capacity beyond what the trainer consumes).",
    )
    patience: int = Field(2, ge=1, description="Consecutive steps a condition must hold before the fleet changes.")
    cooldown_steps: int = Field(2, ge=0, description="Steps after a change before the next one.")

    @model_validator(mode="after")
    def _range(self) -> "ElasticConfig":
        if self.max < self.min:
            raise ValueError(f"max ({self.max}) must be >= min ({self.min})")
        return self


class RolloutConfig(PluginSection):
    """``backend``: inference allocation, e.g. ``embedded`` or ``vllm:d2t1``."""

    registry_kind = "inference_engine"
    selector = "backend"
    section_path = "rollout"
    allocation_selector = True
    backend: str = "embedded"
    max_concurrent_rollouts: int = Field(16, ge=1, description="Episodes running at once.")
    max_staleness: int = Field(
        1, ge=0, description="How many weight versions a trained sample may lag behind (0 = synchronous)."
    )
    request_timeout_s: float = Field(600.0, gt=0)
    request_retries: int = Field(3, ge=0)
    schedule_policy: Literal["round_robin", "least_loaded"] = "least_loaded"
    client_keepalive_s: float = Field(
        4.0,
        gt=0,
        description="How long the client keeps an idle pooled connection to a server. Keep it below the "
        "servers' own keep-alive (vLLM and SGLang: 5 s; embedded: rollout.embedded.keepalive_s, 75 s): a "
        "connection the server closed first costs a resend.",
    )
    restart_servers: bool = Field(
        True,
        description="Restart an inference server whose process dies, on the same address with the current "
        "weights (backends whose launcher supports it; the others only fail its requests over).",
    )
    max_server_restarts: int = Field(
        3, ge=0, description="Restarts allowed per server; its next death stops the run with the server's log tail."
    )
    elastic: ElasticConfig | None = Field(
        None,
        description="Let the scheduler start and stop servers mid-run within [min, max] (docs/elastic.md). "
        "Without it the fleet still takes `areal fleet add`/`drain`, and keeps at least one server.",
    )
    drain_timeout_s: float = Field(
        30.0,
        ge=0,
        description="How long a draining server's requests may run before they are moved: aborted, and resumed "
        "on another server from their partial output.",
    )
    share_devices: bool = Field(
        False,
        description="Run the inference servers on the train ranks' devices instead of devices of their own (one "
        "GPU for both; they take turns on it). Weight updates then go through disk: a collective cannot join two "
        "processes on one device. Schedulers that cannot place this refuse it (docs/gpu.md).",
    )
    gconfig: GenerationSettings = Field(default_factory=GenerationSettings)
    eval_gconfig: GenerationSettings = Field(
        default_factory=lambda: GenerationSettings(temperature=1.0, n_samples=1),
        description="Generation settings for evaluation (greedy is always used).",
    )


class WeightUpdateConfig(StrictModel):
    mode: Literal["auto", "disk", "broadcast"] = "auto"
    bucket_mb: int = Field(256, ge=1)


class DatasetConfig(PluginSection):
    """``type``: ``arithmetic`` (built-in generator), ``file`` (jsonl/json/parquet/csv) or ``hub``."""

    registry_kind = "dataset"
    selector = "type"
    section_path = "dataset"
    type: str = "arithmetic"
    path: str | None = Field(None, description="File/dir for 'file', dataset name for 'hub'.")
    split: str = "train"
    eval_split: str | None = None
    eval_fraction: float = Field(0.1, ge=0, lt=1, description="Held-out fraction when no eval split exists.")
    field_map: dict[str, str] = Field(
        default_factory=dict, description="source field -> canonical field, e.g. {question: prompt}."
    )
    limit: int | None = Field(None, ge=1)
    shuffle: bool = True


class WorkflowConfig(PluginSection):
    registry_kind = "workflow"
    selector = "type"
    section_path = "workflow"
    type: str = "rlvr"


class RewardConfig(PluginSection):
    registry_kind = "reward"
    selector = "type"
    section_path = "reward"
    type: str = "math"
    timeout_s: float = Field(10.0, gt=0, description="Per-call limit, enforced in a worker process.")
    workers: int = Field(1, ge=1)
    max_failure_fraction: float = Field(
        0.5, ge=0, le=1, description="Stop the run when more than this fraction of reward calls fail."
    )


class RLSettings(StrictModel):
    """The knobs of the RL actor (and critic) update: the one definition of
    each setting and its default. ``AlgorithmConfig`` (what users write under
    ``algorithm:``) and ``areal_kernel.algo.rl.RLConfig`` (what the RL step
    reads) both inherit these fields, and ``LossKnobs`` / ``AdvantageKnobs``
    (what losses and estimators get) copy theirs from here; none restates a
    default (tests/algo/test_algorithm_defaults.py and test_knobs.py keep it
    that way)."""

    advantage: str = Field("grpo", description="Registered advantage estimator.")
    loss: str = Field("ppo", description="Registered policy loss.")
    eps_clip: float = Field(0.2, gt=0)
    eps_clip_high: float | None = Field(None, gt=0, description="Upper clip (DAPO clip-higher); None = eps_clip.")
    # Decoupled PPO: bound on the behaviour importance weight exp(prox - old).
    behav_imp_weight_cap: float | None = Field(
        5.0, gt=1, description="Cap on the behaviour importance weight; None = no cap."
    )
    recompute_proximal: bool = Field(
        True,
        description="Score each batch with the current weights as the proximal policy (a forward pass); "
        "false: the behaviour logprobs serve as proximal policy.",
    )
    std_normalize: bool = True
    adv_eps: float = Field(1e-6, gt=0, description="Added to the std when normalising advantages.")
    kl_coef: float = Field(0.0, ge=0)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    entropy_coef: float = 0.0
    # areal_kernel/algo/rl.py uses them; docs/algorithms.md explains each.
    adv_norm: Literal["group", "batch", "none"] | None = Field(
        None, description="Advantage normalisation level; None = the estimator's default."
    )
    gamma: float = Field(1.0, ge=0, le=1, description="Discount (reinforce_pp*, gae).")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda.")
    reward_scale: float = 1.0
    reward_bias: float = 0.0
    reward_clip: float | None = Field(None, gt=0, description="Clip shaped rewards to [-clip, clip].")
    overlong_buffer_len: int | None = Field(
        None, ge=1, description="DAPO soft overlong penalty over the last N tokens before max_new_tokens."
    )
    overlong_penalty_factor: float = Field(1.0, ge=0)
    dual_clip: float | None = Field(None, gt=1, description="Dual-clip PPO bound for negative advantages.")
    ratio_level: Literal["token", "sequence"] = Field("token", description="'sequence': GSPO ratios.")
    behav_imp_weight_mode: Literal["mask", "clamp"] = "mask"
    kl_in: Literal["loss", "reward"] = "loss"
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    prox_interpolate: bool = Field(False, description="Version-interpolated proximal logprobs (no recompute pass).")
    ppo_n_minibatches: int = Field(1, ge=1, description="Optimizer steps per batch.")
    value_eps_clip: float | None = Field(0.2, gt=0, description="Critic value clipping (gae).")

    @model_validator(mode="after")
    def _rl_checks(self) -> "RLSettings":
        if self.recompute_proximal and self.prox_interpolate:
            raise ValueError("recompute_proximal and prox_interpolate are alternatives; set recompute_proximal: false")
        return self


def rl_settings_of(algorithm: RLSettings) -> dict[str, Any]:
    """Every ``RLSettings`` field of ``algorithm`` by name (what the RL step is built from)."""
    return {name: getattr(algorithm, name) for name in RLSettings.model_fields}


class TrainerChoice(StrictModel):
    """``algorithm.type``: a base of ``AlgorithmConfig`` only so that it comes
    first in the section (and in ``config.yaml``)."""

    type: str = Field("grpo", description="Registered trainer (areal plugins lists them).")


class AlgorithmConfig(RLSettings, TrainerChoice):
    """``type`` selects the trainer (a registered name, see ``areal plugins``;
    built in: ``grpo`` for the asynchronous RL loop, ``sft``, ``dpo``,
    ``ipo``, ``rm``). The RL knobs (``RLSettings``) are what the RL step
    reads; every estimator and loss receives its share of them as one frozen
    object (``LossKnobs`` / ``AdvantageKnobs``, areal_kernel.config.knobs).
    An estimator, loss or trainer that registered a ``config_model`` takes
    its own settings from ``algorithm.<its name>: {...}`` (a trainer's
    registered ``settings_section`` instead, when it gave one), validated
    against that model by ``resolve()``; see ``advantage_settings`` /
    ``loss_settings`` / ``trainer_settings``. The kernel's offline trainers
    are registered that way too: ``algorithm.sft``, ``algorithm.dpo`` (for
    ``dpo`` and ``ipo``) and ``algorithm.rm`` are their sections, not fields
    of this model."""

    # Extra keys are the settings sections; _settings_sections checks each.
    model_config = ConfigDict(extra="allow", validate_assignment=True)

    critic_lr: float | None = Field(None, gt=0, description="Critic learning rate; None = the actor's.")
    dynamic_filter: bool = Field(True, description="Drop groups whose rewards are all equal.")
    filter_retry_budget: int = Field(4, ge=0, description="Extra groups per batch slot before accepting unfiltered.")

    # Set by resolve(): kind -> (the selected name, its validated settings;
    # None: it declares no config_model). Keyed by kind, not by name, because
    # an estimator and a loss may share a name; the name is kept so that a
    # later change of the selection reads as unresolved, not as stale settings.
    _settings: dict[str, tuple[str, Any]] | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _old_kwargs(cls, data: Any) -> Any:
        # The untyped option bags were replaced; say where their content goes now.
        if isinstance(data, dict):
            for key, field in (("advantage_kwargs", "advantage"), ("loss_kwargs", "loss")):
                if key in data:
                    name = data.get(field) or cls.model_fields[field].default
                    raise ConfigError(
                        f"algorithm.{key}: no longer exists; write the {field}'s settings as "
                        f"algorithm.{name}: {{...}} (validated against the config_model it registered)"
                    )
        return data

    @model_validator(mode="after")
    def _settings_sections(self) -> "AlgorithmConfig":
        # The shape only: a settings section is a mapping, named after a
        # selected factory or (a trainer's settings_section, which only the
        # registry knows) checked by resolve(). What a section holds is
        # validated by resolve() too, against the registry.
        selected = self.selected_factories()
        for key, value in (self.__pydantic_extra__ or {}).items():
            if key not in selected.values() and not isinstance(value, (dict, BaseModel)):
                raise unknown_section_error(
                    "algorithm",
                    key,
                    [*type(self).model_fields, *sorted(set(selected.values()))],
                    f"a settings section is named after the selected advantage '{self.advantage}' or loss "
                    f"'{self.loss}', or the trainer '{self.type}' (algorithm.type)",
                )
        return self

    if not TYPE_CHECKING:

        def __getattr__(self, name: str) -> Any:
            try:
                return super().__getattr__(name)
            except AttributeError:
                if name not in FORMER_ALGORITHM_FIELDS:
                    raise
            # Deprecated: sft/dpo/rm were fields until the offline trainers registered
            # their own config_model; a section not selected now reads as its defaults.
            from areal_kernel.config import offline

            warnings.warn(
                f"AlgorithmConfig.{name} is deprecated and goes away in the next minor release: the settings of "
                f"the selected trainer are config.algorithm.trainer_settings (TrainerContext.settings); "
                f"algorithm.type {self.type!r} does not read algorithm.{name}, these are its defaults",
                ArealDeprecationWarning,
                stacklevel=2,
            )
            return getattr(offline, offline.FORMER_ALGORITHM_FIELDS[name])()

    def selected_factories(self) -> dict[str, str]:
        """Registry kind -> the name this section selects of it."""
        return {"advantage_estimator": self.advantage, "loss": self.loss, "trainer": self.type}

    @property
    def advantage_settings(self) -> Any:
        """The estimator's validated ``algorithm.<advantage>`` settings (``None`` without a config_model)."""
        return self._settings_for("advantage_estimator", self.advantage)

    @property
    def loss_settings(self) -> Any:
        """The loss's validated ``algorithm.<loss>`` settings (``None`` without a config_model)."""
        return self._settings_for("loss", self.loss)

    @property
    def trainer_settings(self) -> Any:
        """The trainer's validated ``algorithm.<type>`` settings (``None`` without a config_model)."""
        return self._settings_for("trainer", self.type)

    def _settings_for(self, kind: str, name: str) -> Any:
        resolved = (self._settings or {}).get(kind)
        require_resolved(resolved is not None and resolved[0] == name, f"algorithm.{name}")
        assert resolved is not None
        return resolved[1]


class TrainerConfig(StrictModel):
    batch_size: int = Field(8, ge=1, description="Prompts (groups) per training step.")
    total_train_epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1)
    eval_every: int = Field(0, ge=0, description="Evaluate every N steps (0: only before and after).")
    eval_size: int = Field(32, ge=0)
    max_skipped_steps: int = Field(
        3,
        ge=0,
        description="Stop the run after more than this many consecutive steps skipped for NaN/inf loss or gradients.",
    )
    policy_order: Literal["weight", "ready", "together"] = Field(
        "weight",
        description="With policies: which policy takes the next step. weight: the one furthest behind its share "
        "(steps per unit of weight), waiting for its batch; the order is the same in every run. ready: the same "
        "preference, but a policy whose batch is not ready yet is passed over for the next one whose batch is, "
        "so slow rollouts of one policy do not hold the others back. together: that policy and every other "
        "that would not get ahead of it step at once, their micro-batches sharing the base's forwards (equal "
        "weights: all policies every step; torch engine) (docs/multi-policy.md).",
    )


class CheckpointConfig(StrictModel):
    save_hf_every: int = Field(0, ge=0, description="Save an HF checkpoint every N steps (0: at the end only).")
    keep_last: int = Field(2, ge=1, description="Checkpoints of each kind kept (HF step<N> and recovery).")
    save_every: int = Field(
        10,
        ge=0,
        description="Write a recovery checkpoint (model, optimizer, RNG, data position, rollout state) every N "
        "steps under <run_dir>/recover (0: never periodically; see on_interrupt).",
    )
    on_interrupt: bool = Field(
        True,
        description="On the first SIGINT (Ctrl-C) or SIGTERM, finish the current step and write a recovery "
        "checkpoint before exiting, so that the same command resumes from that step (a second signal exits at once).",
    )
    interrupt_timeout_s: float = Field(
        120.0,
        gt=0,
        description="At most this long for the checkpoint written on an interrupt (running rollouts finish first, "
        "then the engine writes its state); past it the run exits without it.",
    )


class LoggingConfig(StrictModel):
    """``sinks``: the metric sinks, by registered name. A sink that registered
    a ``config_model`` takes its settings from ``logging.<sink name>: {...}``
    (e.g. ``logging.wandb: {project: x, mode: offline}``); a section is
    allowed only for a sink listed in ``sinks``, like the other kinds."""

    # Extra keys are the sinks' settings sections; _sink_sections checks each.
    model_config = ConfigDict(extra="allow", validate_assignment=True)

    sinks: list[str] = Field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    level: Literal["debug", "info", "warning", "error"] = "info"
    json_logs: bool = False

    # Set by resolve(): the sinks whose settings sections it validated.
    _resolved_sinks: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="after")
    def _sink_sections(self) -> "LoggingConfig":
        # The shape only; resolve() checks the names and validates the settings.
        for key in self.__pydantic_extra__ or {}:
            if key not in self.sinks:
                raise unknown_section_error(
                    "logging",
                    key,
                    [*type(self).model_fields, *self.sinks],
                    f"a settings section is named after a sink in logging.sinks: {', '.join(self.sinks)}",
                )
        return self

    def sink_settings(self, name: str) -> Any:
        """Sink ``name``'s validated ``logging.<name>`` settings (``None`` without a config_model)."""
        require_resolved(name in self._resolved_sinks, f"logging.{name}")
        return (self.__pydantic_extra__ or {}).get(name)


class SchedulerConfig(StrictModel):
    """``type``: the scheduler by registered name. A scheduler that registered
    a ``config_model`` takes its settings from ``scheduler.<name>: {...}``
    (e.g. ``scheduler.ray: {address: auto}``); with ``type: auto`` a section
    may be given for any registered scheduler (the hook picks one of them)."""

    # Extra keys are schedulers' settings sections; _scheduler_sections checks each.
    model_config = ConfigDict(extra="allow", validate_assignment=True)

    type: str = Field("auto", description="'auto' asks the areal_select_scheduler hook (default: local).")

    # Set by resolve(): scheduler name -> its validated settings (the section
    # given, else its config_model's defaults; None without a config_model).
    _sections: dict[str, Any] | None = PrivateAttr(default=None)
    _resolved_type: str | None = PrivateAttr(default=None)

    def section(self, name: str) -> Any:
        """Scheduler ``name``'s validated ``scheduler.<name>`` settings: the
        section given, else its ``config_model``'s defaults (``None`` for a
        scheduler without one, or not registered under ``name``)."""
        require_resolved(self._sections is not None and self._resolved_type == self.type, f"scheduler.{name}")
        assert self._sections is not None
        return self._sections.get(name)


class PolicyConfig(StrictModel):
    """One policy of a multi-policy run (``policies.<name>``): a LoRA adapter
    on the shared base model with its own data, reward and knobs. Sections
    given here replace or extend the run's own: a section that names another
    ``type`` than the run's replaces it, otherwise its keys are merged over
    the run's (``policy_config_data``). ``model``, ``actor``, ``rollout``
    (servers) and ``logging`` stay shared."""

    lora: dict[str, Any] = Field(
        default_factory=dict,
        description="The adapter's settings: the actor engine's lora fields (rank, alpha, target_modules, ...) "
        "without name, which is the policy's name.",
    )
    dataset: dict[str, Any] = Field(default_factory=dict, description="This policy's dataset section (see above).")
    workflow: dict[str, Any] = Field(default_factory=dict, description="This policy's workflow section.")
    reward: dict[str, Any] = Field(default_factory=dict, description="This policy's reward section.")
    algorithm: dict[str, Any] = Field(
        default_factory=dict, description="This policy's algorithm knobs (eps_clip, loss settings, ...)."
    )
    batch_size: int | None = Field(
        None, ge=1, description="Prompts per step of this policy; unset: trainer.batch_size."
    )
    max_staleness: int | None = Field(
        None, ge=0, description="This policy's staleness bound; unset: rollout.max_staleness."
    )
    weight: float = Field(
        1.0, gt=0, description="Steps are taken in proportion to the policies' weights (docs/multi-policy.md)."
    )
    episodes_from: str | None = Field(
        None,
        description="Another policy whose episodes feed this one (a second role in the same episodes): this "
        "policy runs no episodes of its own; after each step of that policy it trains on the trajectories of "
        "those episodes that name its adapter (docs/multi-policy.md, Several roles in one episode). Its dataset "
        "and workflow then serve its held-out evaluation only.",
    )


class ExperimentConfig(StrictModel):
    experiment_name: str = "areal-run"
    seed: int = 1
    run_dir: str | None = Field(None, description="Default: runs/<experiment_name>.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    actor: ActorConfig = Field(default_factory=ActorConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    weight_update: WeightUpdateConfig = Field(default_factory=WeightUpdateConfig)
    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    workflow: WorkflowConfig = Field(default_factory=WorkflowConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    monitor: MonitorConfig = Field(
        default_factory=MonitorConfig, description="Checks that watch the run for silent failures (docs/monitoring.md)."
    )
    policies: dict[str, PolicyConfig] = Field(
        default_factory=dict,
        description="Several policies in one run, each a LoRA adapter on the shared base (docs/multi-policy.md); "
        "empty: one policy, the run's own sections.",
    )
    # Set on each policy's own config (``config.loader.check_policies``): the
    # adapters of the whole run (``ServedAdapters``), which the inference
    # backends built from a policy's config must be able to serve.
    _run_adapters: Any = PrivateAttr(default=None)
    recover: Literal["auto", "off"] = Field(
        "auto",
        description="auto: resume an interrupted run from the newest complete recovery checkpoint in run_dir; "
        "off: always start from step 0 (refused while run_dir holds an unfinished run's checkpoints).",
    )

    @field_validator("recover", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        # YAML reads a bare `off` as false (and `on` as true).
        if v is False:
            return "off"
        if v is True:
            return "auto"
        return v

    @field_validator("experiment_name")
    @classmethod
    def _name_is_path_safe(cls, v: str) -> str:
        if not v or any(c in v for c in "/\\") or v in {".", ".."}:
            raise ValueError("must be a non-empty name without '/' (it names the run directory)")
        return v

    @field_validator("policies")
    @classmethod
    def _policy_names(cls, v: dict[str, PolicyConfig]) -> dict[str, PolicyConfig]:
        for name in v:
            # The name is the adapter's on the servers and a directory name in run_dir.
            if not name or not all(c.isalnum() or c in "-_." for c in name) or name in {".", ".."}:
                raise ValueError(f"policy name {name!r}: use letters, digits, '-', '_' or '.' (it names an adapter)")
        for name, p in v.items():
            src = p.episodes_from
            if src is None:
                continue
            if src not in v or src == name:
                raise ValueError(f"{name}.episodes_from: {src!r} is not another policy of this run ({', '.join(v)})")
            if v[src].episodes_from is not None:
                raise ValueError(
                    f"{name}.episodes_from: policy {src!r} runs no episodes of its own (its episodes_from is "
                    f"{v[src].episodes_from!r}); name a policy that does"
                )
            given = [k for k in ("batch_size", "max_staleness") if getattr(p, k) is not None]
            given += ["weight"] if p.weight != 1.0 else []
            if given:
                raise ValueError(
                    f"{name}: {', '.join(given)} does not apply to a policy fed by the episodes of {src!r} (it "
                    f"steps after each step of {src!r}, on its share of the same episodes); drop it"
                )
        return v

    @model_validator(mode="after")
    def _cross_checks(self) -> "ExperimentConfig":
        if self.dataset.type in ("file", "hub") and not self.dataset.path:
            raise ValueError(f"dataset.path is required when dataset.type is '{self.dataset.type}'")
        return self

    def resolved_run_dir(self) -> str:
        return self.run_dir or f"runs/{self.experiment_name}"

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json")
