"""One RL actor update with the estimator and loss chosen by name.

``rl_train_step``: shaped rewards -> (KL-in-reward token penalties) ->
(critic values) -> registered advantage estimator -> per-token advantages ->
one or more ``train_batch`` calls with the registered policy loss -> (critic
update). The defaults reproduce plain GRPO with the decoupled PPO loss.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from pydantic import BaseModel, ConfigDict, Field, model_validator

from areal_kernel.algo.advantages import overlong_penalty, shape_rewards
from areal_kernel.algo.estimators import to_token_rows
from areal_kernel.api.engine import TrainEngine
from areal_kernel.api.io import TrajectoryBatch
from areal_kernel.config.knobs import AdvantageKnobs, LossKnobs, legacy_keywords
from areal_kernel.config.models import GenerationSettings, RLSettings, rl_settings_of
from areal_kernel.errors import ArealDeprecationWarning, ConfigError, DataError
from areal_kernel.monitor.mismatch import finish as finish_mismatch
from areal_kernel.monitor.mismatch import measured_loss

if TYPE_CHECKING:
    from areal_kernel.api.advantage_estimator import AdvantageEstimator
    from areal_kernel.api.loss import PolicyLoss
    from areal_kernel.config.models import ExperimentConfig


class RLConfig(RLSettings):
    """Options of the RL actor (and critic) update.

    The knobs and their defaults are ``RLSettings``'s, the same fields users
    write under ``algorithm:``; ``from_config`` builds the step's options
    from a validated config (what ``areal train`` does). The fields below
    come from other config sections or from the registry."""

    model_config = ConfigDict(extra="forbid", validate_assignment=False)

    max_new_tokens: int | None = Field(
        None, ge=1, description="generation limit, rollout.gconfig.max_new_tokens (needed for overlong shaping)"
    )
    temperature: float = Field(
        GenerationSettings.model_fields["temperature"].default,
        gt=0,
        description="rollout.gconfig.temperature; must equal the train engine's and the sampler's temperature",
    )
    advantage_settings: Any = Field(
        None,
        description="the estimator's settings (its registered config_model; a mapping is validated against it)",
    )
    loss_settings: Any = Field(
        None, description="the loss's settings (its registered config_model; a mapping is validated against it)"
    )

    @classmethod
    def from_config(cls, cfg: "ExperimentConfig") -> "RLConfig":
        """The RL step's options of a validated config: every ``algorithm``
        knob as the user set it (or its one default), the generation limit
        and temperature of ``rollout.gconfig``, and the validated settings of
        the selected estimator and loss."""
        a = cfg.algorithm
        return cls(
            **rl_settings_of(a),
            max_new_tokens=cfg.rollout.gconfig.max_new_tokens,
            temperature=cfg.rollout.gconfig.temperature,
            advantage_settings=a.advantage_settings,
            loss_settings=a.loss_settings,
        )

    @model_validator(mode="after")
    def _checks(self) -> "RLConfig":
        if self.overlong_buffer_len is not None and self.max_new_tokens is None:
            raise ValueError("overlong_buffer_len needs max_new_tokens (the generation limit)")
        # A registered name's settings are validated here even when left unset,
        # so a config_model's defaults reach a step built without a config file.
        # An unregistered name (a callable passed to rl_train_step) keeps its mapping.
        from areal_kernel.config.sections import validate_settings
        from areal_kernel.plugins import get_registry

        reg = get_registry()
        for kind, name, attr in (
            ("advantage_estimator", self.advantage, "advantage_settings"),
            ("loss", self.loss, "loss_settings"),
        ):
            spec = reg.find(kind, name)
            if spec is not None:
                settings = validate_settings(f"algorithm.{name}", kind, name, getattr(self, attr), spec=spec)
                object.__setattr__(self, attr, settings)
        return self


def kl_token_value(log_ratio: float, estimator: str) -> float:
    """Python twin of ``losses.kl_penalty`` for the KL-in-reward penalty."""
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio * log_ratio
    return math.exp(-log_ratio) - 1.0 + log_ratio


def prox_interpolation_alpha(versions: list[int], loss_mask: list[int], v_prox: float, v_theta: float) -> list[float]:
    """Interpolation weight per token for the proximal-logprob approximation.

    A token sampled by version ``v_b`` has behaviour logprob ``old``; the
    policy being trained is at (possibly fractional) version ``v_theta`` with
    logprob ``cur``; the proximal policy is version ``v_prox``. Treating the
    log-probability as linear in the version between ``v_b`` and ``v_theta``:
    ``prox = old + alpha * (cur - old)``, ``alpha = (v_prox - v_b) / (v_theta - v_b)``
    clamped to [0, 1]; ``alpha = 1`` when ``v_theta <= v_b`` (nothing to
    interpolate: the current policy is the proximal one). 0 off loss tokens.
    """
    out = []
    for v, m in zip(versions, loss_mask):
        if not m:
            out.append(0.0)
        elif v_theta <= v:
            out.append(1.0)
        else:
            out.append(min(1.0, max(0.0, (v_prox - v) / (v_theta - v))))
    return out


def _spec(kind: str, name: str) -> Any:
    from areal_kernel.plugins import get_registry

    return get_registry().get(kind, name, platform="")


def _estimator(cfg: "RLConfig") -> "AdvantageEstimator":
    from areal_kernel.api.advantage_estimator import AdvantageEstimatorContext
    from areal_kernel.plugins import get_registry

    ctx = AdvantageEstimatorContext(cfg.advantage, cfg.advantage_settings)
    return get_registry().build("advantage_estimator", cfg.advantage, ctx, platform="")


def _loss(cfg: "RLConfig") -> "PolicyLoss":
    from areal_kernel.api.loss import LossContext
    from areal_kernel.plugins import get_registry

    return get_registry().build("loss", cfg.loss, LossContext(cfg.loss, cfg.loss_settings), platform="")


def _settings_kwargs(settings: Any) -> dict[str, Any]:
    from areal_kernel.config.sections import settings_kwargs

    if settings is None or isinstance(settings, BaseModel):
        return settings_kwargs(settings)
    return dict(settings)


def takes_knobs(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` declares a ``knobs`` parameter (the current calling
    convention of losses and estimators); one that does not is called the
    old way, with the knobs as keywords (deprecated)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no introspectable signature: assume the old convention
        return False
    p = params.get("knobs")
    return p is not None and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)


def _who(kind: str, name: str, fn: Callable[..., Any]) -> str:
    from areal_kernel.api.kinds import origin
    from areal_kernel.plugins import get_registry

    spec = get_registry().find(kind, name)
    if spec is not None and spec.target.rsplit(":", 1)[-1] == getattr(fn, "__name__", None):
        return f"{origin(spec)}, {spec.target}"
    return f"{kind} {getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def knob_arguments(fn: Callable[..., Any], knobs: LossKnobs | AdvantageKnobs, kind: str, name: str) -> dict[str, Any]:
    """How ``knobs`` reach ``fn``: ``{"knobs": knobs}``, or, for a callable
    written before the knobs objects (no ``knobs`` parameter), every knob as
    a keyword, with a ``DeprecationWarning`` naming it (that convention
    stops working in the next minor release)."""
    if takes_knobs(fn):
        return {"knobs": knobs}
    cls = type(knobs).__name__
    warnings.warn(
        f"{_who(kind, name, fn)} takes the shared knobs as keywords; that is deprecated and stops working in "
        f"the next minor release: declare a `knobs` parameter and read them from it "
        f"(areal_kernel.api.{'loss' if kind == 'loss' else 'advantage_estimator'}.{cls})",
        ArealDeprecationWarning,
        stacklevel=3,
    )
    return legacy_keywords(knobs)


def loss_options(cfg: RLConfig) -> dict[str, Any]:
    """Deprecated: the shared knobs as keywords plus every field of
    ``cfg.loss_settings``. The RL step passes ``LossKnobs.of(cfg)`` whole now."""
    warnings.warn(
        "areal_kernel.algo.rl.loss_options is deprecated: use LossKnobs.of(cfg) (areal_kernel.api.loss) and "
        "bind_loss(loss, knobs, cfg.loss_settings)",
        ArealDeprecationWarning,
        stacklevel=2,
    )
    return {**legacy_keywords(LossKnobs.of(cfg)), **_settings_kwargs(cfg.loss_settings)}


def bind_loss(
    loss: Callable[..., Any], knobs: LossKnobs | Mapping[str, Any], settings: Any = None, *, name: str = "loss"
) -> Callable[[Any, Any, dict[str, Any]], Any]:
    """``loss(logprobs, data, entropy=..., knobs=knobs, **settings)`` as a
    ``train_batch`` loss_fn (``settings``: the loss's validated settings,
    passed as keywords; ``name``: the registered name, for warnings). A loss
    without a ``knobs`` parameter gets the knobs as keywords (deprecated).
    The old form ``bind_loss(loss, options)`` with a mapping of keywords is
    deprecated too."""
    if isinstance(knobs, Mapping):
        warnings.warn(
            "bind_loss(loss, options) with a mapping of keywords is deprecated: pass "
            "bind_loss(loss, LossKnobs.of(cfg), settings)",
            ArealDeprecationWarning,
            stacklevel=2,
        )
        opts = dict(knobs)
        needs_grad = opts.get("entropy_coef", 0.0) != 0.0
    else:
        opts = {**knob_arguments(loss, knobs, "loss", name), **_settings_kwargs(settings)}
        needs_grad = knobs.entropy_coef != 0.0

    def loss_fn(logprobs: Any, entropy: Any, data: dict[str, Any]) -> Any:
        return loss(logprobs, data, entropy=entropy, **opts)

    loss_fn.needs_entropy_grad = needs_grad  # type: ignore[attr-defined]
    return loss_fn


def shaped_rewards(batch: TrajectoryBatch, cfg: RLConfig) -> list[float]:
    """Rewards after scale/bias/clip and the DAPO overlong penalty."""
    trajs = batch.trajectories
    out = shape_rewards([t.reward for t in trajs], scale=cfg.reward_scale, bias=cfg.reward_bias, clip=cfg.reward_clip)
    if cfg.overlong_buffer_len is not None:
        assert cfg.max_new_tokens is not None  # RLConfig refuses overlong_buffer_len without it
        pen = overlong_penalty(
            [t.n_generated for t in trajs], cfg.max_new_tokens, cfg.overlong_buffer_len, cfg.overlong_penalty_factor
        )
        out = [r + p for r, p in zip(out, pen)]
    return out


def compute_advantages(
    batch: TrajectoryBatch,
    cfg: RLConfig,
    *,
    estimator: Callable[..., Any] | None = None,
    ref_logprobs: list[list[float]] | None = None,
    values: list[list[float]] | None = None,
) -> tuple[list[list[float]], list[list[float]] | None]:
    """Per-token advantages (and critic returns, for critic-based estimators)."""
    est = estimator if estimator is not None else _estimator(cfg)
    trajs = batch.trajectories
    masks = [t.loss_mask for t in trajs]
    token_rewards = None
    if cfg.kl_in == "reward" and cfg.kl_coef > 0:
        if ref_logprobs is None:
            raise ConfigError(f"kl_coef={cfg.kl_coef} with kl_in='reward' needs ref_logprobs")
        token_rewards = [
            [
                -cfg.kl_coef * kl_token_value(o - r, cfg.kl_estimator) if m else 0.0
                for o, r, m in zip(t.logprobs, ref, t.loss_mask)
            ]
            for t, ref in zip(trajs, ref_logprobs)
        ]
    gids = [t.group_id or f"__single_{i}" for i, t in enumerate(trajs)]
    result = est(
        shaped_rewards(batch, cfg),
        gids,
        loss_masks=masks,
        token_rewards=token_rewards,
        values=values,
        **knob_arguments(est, AdvantageKnobs.of(cfg), "advantage_estimator", cfg.advantage),
        **_settings_kwargs(cfg.advantage_settings),
    )
    return to_token_rows(result, masks, cfg.advantage)


def _split(n: int, parts: int) -> list[list[int]]:
    base, extra = divmod(n, parts)
    out, start = [], 0
    for k in range(parts):
        size = base + (1 if k < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def rl_train_step(
    batch: TrajectoryBatch,
    engine: TrainEngine,
    cfg: RLConfig,
    *,
    ref_logprobs: list[list[float]] | None = None,
    critic: Any = None,
    estimator: Callable[..., Any] | None = None,
    loss: Callable[..., Any] | None = None,
    mismatch_threshold: float = 0.5,
) -> dict[str, Any]:
    """Advantages, then ``cfg.ppo_n_minibatches`` optimizer steps of the actor
    (and one critic step when the estimator uses values). ``estimator`` /
    ``loss`` default to the registry entries ``cfg.advantage`` / ``cfg.loss``.
    ``ref_logprobs`` is required when ``cfg.kl_coef > 0``; ``critic`` (with
    ``compute_values`` and ``train_values``) when the estimator has
    ``needs_values`` in its registered capabilities. Returns the actor's stats (averaged over minibatches),
    ``critic_*`` stats, ``reward`` (raw batch mean) and ``adv_abs`` (mean over
    sequences of the mean |advantage| on their loss tokens), and ``mismatch``:
    the train/inference mismatch of the first minibatch's tokens sampled with
    the engine's current weights (``areal_kernel.monitor.mismatch``; tokens
    whose log-probabilities differ by more than ``mismatch_threshold`` count
    in its ``frac_over``).

    In three parts, so that a trainer can step several policies' minibatches
    together (``trainer.policy_order: together``): ``plan_rl_step`` (all that
    comes before the actor's optimizer steps), one ``engine.train_batch`` per
    entry of its ``minibatches``, in order, then ``finish_rl_step``;
    ``run_rl_plan`` does the last two."""
    plan = plan_rl_step(
        batch, engine, cfg, ref_logprobs=ref_logprobs, critic=critic, estimator=estimator, loss=loss,
        mismatch_threshold=mismatch_threshold,
    )  # fmt: skip
    return run_rl_plan(plan, engine)


def run_rl_plan(plan: "RLStepPlan", engine: TrainEngine) -> dict[str, Any]:
    """The rest of ``rl_train_step`` after ``plan_rl_step``: ``engine``
    (the actor the plan was made for) takes one optimizer step per
    minibatch, in order, then ``finish_rl_step``."""
    return finish_rl_step(plan, [dict(engine.train_batch(*mb)) for mb in plan.minibatches])


@dataclass
class RLStepPlan:
    """What ``plan_rl_step`` prepared: the actor's minibatches as
    ``(batch, loss_fn, extra)`` (``train_batch``'s arguments, in order),
    and what ``finish_rl_step`` needs afterwards."""

    batch: TrajectoryBatch
    cfg: RLConfig
    minibatches: list[tuple[TrajectoryBatch, Callable[..., Any], dict[str, list[list[float]]]]]
    advantages: list[list[float]]
    returns: Any
    values: Any
    critic: Any


def plan_rl_step(
    batch: TrajectoryBatch,
    engine: TrainEngine,
    cfg: RLConfig,
    *,
    ref_logprobs: list[list[float]] | None = None,
    critic: Any = None,
    estimator: Callable[..., Any] | None = None,
    loss: Callable[..., Any] | None = None,
    mismatch_threshold: float = 0.5,
) -> RLStepPlan:
    """The part of ``rl_train_step`` before the actor's optimizer steps:
    checks, values, advantages, proximal logprobs and each minibatch's
    loss and extra fields. Changes no weights."""
    if len(batch) == 0:
        raise DataError("RL step got an empty batch")
    engine_temp = getattr(engine, "temperature", None)
    if engine_temp is not None and abs(float(engine_temp) - cfg.temperature) > 1e-9:
        raise ConfigError(
            f"temperature={cfg.temperature} differs from the train engine's temperature={engine_temp}: "
            "logprob ratios would compare different distributions"
        )
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ConfigError(f"kl_coef={cfg.kl_coef} needs ref_logprobs (scores of a reference model)")
    if cfg.ppo_n_minibatches > len(batch):
        raise ConfigError(f"ppo_n_minibatches={cfg.ppo_n_minibatches} exceeds the batch's {len(batch)} sequences")
    est = estimator if estimator is not None else _estimator(cfg)
    loss_impl = loss if loss is not None else _loss(cfg)

    values = None
    # Read from the registration (capabilities=["needs_values"]) of the
    # configured estimator, which is what a third-party estimator can declare.
    if "needs_values" in _spec("advantage_estimator", cfg.advantage).capabilities:
        if critic is None:
            raise ConfigError(f"advantage estimator '{cfg.advantage}' needs a critic (values), none was given")
        values = critic.compute_values(batch)
    adv, returns = compute_advantages(batch, cfg, estimator=est, ref_logprobs=ref_logprobs, values=values)

    trajs = batch.trajectories
    prox_all = engine.compute_logprobs(batch, only_loss_tokens=True) if cfg.recompute_proximal else None
    v_prox = float(engine.get_version()) if hasattr(engine, "get_version") else 0.0
    loss_fn = bind_loss(loss_impl, LossKnobs.of(cfg), cfg.loss_settings, name=cfg.loss)
    # The first minibatch is scored before this step's first optimizer
    # update: its log-probabilities are compared with the servers' (mismatch).
    first_fn = measured_loss(loss_fn, int(v_prox), mismatch_threshold)
    n_mb = cfg.ppo_n_minibatches
    minibatches = []
    for k, idx in enumerate(_split(len(trajs), n_mb)):
        sub = TrajectoryBatch([trajs[i] for i in idx])
        extra: dict[str, list[list[float]]] = {"advantages": [adv[i] for i in idx]}
        if prox_all is not None:
            extra["prox_logprobs"] = [prox_all[i] for i in idx]
        elif cfg.prox_interpolate:
            # Minibatch k trains weights that are k/n of the way to the next version.
            v_theta = v_prox + k / n_mb
            extra["prox_alpha"] = [
                prox_interpolation_alpha(trajs[i].versions, trajs[i].loss_mask, v_prox, v_theta) for i in idx
            ]
        if ref_logprobs is not None:
            extra["ref_logprobs"] = [ref_logprobs[i] for i in idx]
        minibatches.append((sub, first_fn if k == 0 else loss_fn, extra))
    return RLStepPlan(batch, cfg, minibatches, adv, returns, values, critic)


def finish_rl_step(plan: RLStepPlan, per_mb: list[dict[str, Any]]) -> dict[str, Any]:
    """The part of ``rl_train_step`` after the actor's optimizer steps
    (``per_mb``: each minibatch's ``train_batch`` statistics, in order):
    the critic's step and the step's statistics."""
    cfg, critic, trajs = plan.cfg, plan.critic, plan.batch.trajectories
    stats: dict[str, Any] = {}
    for key in per_mb[0]:
        vals = [s[key] for s in per_mb if isinstance(s.get(key), (int, float))]
        if not vals:
            continue
        stats[key] = (
            max(vals) if key.endswith("_max") else (min(vals) if key.endswith("_min") else sum(vals) / len(vals))
        )
    stats["mismatch"] = finish_mismatch(stats)
    if critic is not None and plan.returns is not None:
        cstats = critic.train_values(plan.batch, plan.returns, plan.values, value_eps_clip=cfg.value_eps_clip)
        stats.update({f"critic_{k}": v for k, v in cstats.items()})
    rewards = [t.reward for t in trajs]
    stats["reward"] = sum(rewards) / len(rewards)
    abs_means = []
    for row, t in zip(plan.advantages, trajs):
        n = sum(1 for m in t.loss_mask if m)
        abs_means.append(sum(abs(a) for a in row) / n if n else 0.0)
    stats["adv_abs"] = sum(abs_means) / len(abs_means)
    return stats
