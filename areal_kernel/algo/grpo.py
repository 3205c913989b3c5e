"""GRPO, the default RL recipe: kept as names for existing callers.

``GRPOConfig`` is ``RLConfig`` (whose defaults are GRPO: group mean/std
advantages, decoupled PPO loss, token-mean aggregation) and
``grpo_train_step`` is ``rl_train_step``; see ``areal_kernel.algo.rl``.
"""

from __future__ import annotations

from areal_kernel.algo.advantages import normalize_rewards
from areal_kernel.algo.rl import RLConfig, rl_train_step
from areal_kernel.api.io import TrajectoryBatch

GRPOConfig = RLConfig
grpo_train_step = rl_train_step


def sequence_advantages(batch: TrajectoryBatch, cfg: RLConfig) -> list[float]:
    """One GRPO advantage per trajectory from its reward, normalised per
    ``cfg.adv_norm`` (default ``group``)."""
    rewards = [t.reward for t in batch.trajectories]
    # A trajectory without a group id forms its own group rather than merging with others.
    gids = [t.group_id or f"__single_{i}" for i, t in enumerate(batch.trajectories)]
    return normalize_rewards(rewards, gids, cfg.adv_norm or "group", std_normalize=cfg.std_normalize, eps=cfg.adv_eps)
