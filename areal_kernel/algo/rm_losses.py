"""Bradley-Terry reward-model loss on pairs of scalar scores.

``P(chosen > rejected) = sigmoid(r_chosen - r_rejected)``; the loss is its
negative log-likelihood. Scores come from the scalar head of
``areal_kernel.engine.scalar_head`` at each sequence's last token; the
trainer sends the gradient through ``train_batch`` with the same two-pass
scheme as DPO (``areal_kernel.algo.dpo_losses``).
"""

from __future__ import annotations

from typing import Any

from areal_kernel.errors import ConfigError


def bradley_terry_losses(chosen: Any, rejected: Any, *, center_coef: float = 0.0) -> Any:
    """Per-pair ``-log sigmoid(r_c - r_r) + center_coef * (r_c + r_r)^2``
    (the second term only pins the free offset of the scores to 0)."""
    import torch.nn.functional as F

    if center_coef < 0:
        raise ConfigError(f"center_coef must be >= 0, got {center_coef}")
    losses = -F.logsigmoid(chosen - rejected)
    if center_coef:
        losses = losses + center_coef * (chosen + rejected) ** 2
    return losses


def rm_stats(chosen: Any, rejected: Any) -> dict[str, float]:
    margin = chosen - rejected
    return {
        "rewards/chosen": float(chosen.mean()),
        "rewards/rejected": float(rejected.mean()),
        "rewards/margin": float(margin.mean()),
        "rewards/accuracy": float((margin > 0).float().mean()),
    }
