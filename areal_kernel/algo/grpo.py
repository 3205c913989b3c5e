"""GRPO step glue: sequence advantages -> per-token advantages -> one
``train_batch`` with the decoupled PPO loss."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from areal_kernel.algo.advantages import broadcast_to_tokens, normalize_rewards
from areal_kernel.algo.losses import make_ppo_loss_fn
from areal_kernel.api.engine import TrainEngine
from areal_kernel.api.io import TrajectoryBatch
from areal_kernel.errors import ConfigError, DataError


class GRPOConfig(BaseModel):
    """Options of the GRPO actor update."""

    model_config = ConfigDict(extra="forbid")

    group_size: int = Field(8, ge=1, description="samples per prompt (used by workflows to build groups)")
    eps_clip: float = Field(0.2, ge=0)
    eps_clip_high: float | None = Field(None, ge=0, description="upper clip (DAPO clip-higher); None = eps_clip")
    behav_imp_weight_cap: float | None = Field(
        None, gt=0, description="drop tokens whose behaviour importance weight exceeds this; None = keep all"
    )
    kl_coef: float = Field(0.0, ge=0)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    entropy_coef: float = 0.0
    reward_norm: Literal["group", "batch", "none"] = "group"
    std_normalize: bool = True
    adv_eps: float = Field(1e-6, gt=0)
    recompute_proximal: bool = Field(
        False, description="score the batch with the current weights as proximal policy (decoupled PPO)"
    )
    temperature: float = Field(1.0, gt=0, description="must equal the train engine's and the sampler's temperature")


def sequence_advantages(batch: TrajectoryBatch, cfg: GRPOConfig) -> list[float]:
    """One advantage per trajectory from its reward, normalised per ``cfg.reward_norm``."""
    rewards = [t.reward for t in batch.trajectories]
    # A trajectory without a group id forms its own group rather than merging with others.
    gids = [t.group_id or f"__single_{i}" for i, t in enumerate(batch.trajectories)]
    return normalize_rewards(rewards, gids, cfg.reward_norm, std_normalize=cfg.std_normalize, eps=cfg.adv_eps)


def grpo_train_step(
    batch: TrajectoryBatch,
    engine: TrainEngine,
    cfg: GRPOConfig,
    *,
    ref_logprobs: list[list[float]] | None = None,
) -> dict[str, Any]:
    """Compute advantages, optionally recompute proximal logprobs, and run one
    optimizer step. ``ref_logprobs`` (per token, from a reference model) is
    required when ``cfg.kl_coef > 0``. Returns the engine's stats plus
    ``reward`` (batch mean) and ``adv_abs`` (mean |advantage| per sequence)."""
    if len(batch) == 0:
        raise DataError("GRPO step got an empty batch")
    engine_temp = getattr(engine, "temperature", None)
    if engine_temp is not None and abs(float(engine_temp) - cfg.temperature) > 1e-9:
        raise ConfigError(
            f"GRPOConfig.temperature={cfg.temperature} differs from the train engine's temperature={engine_temp}: "
            "logprob ratios would compare different distributions"
        )
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ConfigError(f"kl_coef={cfg.kl_coef} needs ref_logprobs (scores of a reference model)")

    seq_adv = sequence_advantages(batch, cfg)
    extra: dict[str, list[list[float]]] = {
        "advantages": broadcast_to_tokens(seq_adv, [t.loss_mask for t in batch.trajectories])
    }
    if cfg.recompute_proximal:
        extra["prox_logprobs"] = engine.compute_logprobs(batch, only_loss_tokens=True)
    if ref_logprobs is not None:
        extra["ref_logprobs"] = ref_logprobs

    loss_fn = make_ppo_loss_fn(
        eps_clip=cfg.eps_clip,
        eps_clip_high=cfg.eps_clip_high,
        behav_imp_weight_cap=cfg.behav_imp_weight_cap,
        kl_coef=cfg.kl_coef,
        kl_estimator=cfg.kl_estimator,
        entropy_coef=cfg.entropy_coef,
    )
    stats = dict(engine.train_batch(batch, loss_fn, extra))
    rewards = [t.reward for t in batch.trajectories]
    stats["reward"] = sum(rewards) / len(rewards)
    stats["adv_abs"] = sum(abs(a) for a in seq_adv) / len(seq_adv)
    return stats
