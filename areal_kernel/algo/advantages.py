"""Reward normalisation and advantage estimators (pure Python, no torch).

Standard deviations are population std (ddof=0). A group whose rewards are
all equal has std 0 and gets advantage 0 (``(r - mean) / (0 + eps)`` with
``r == mean``), never NaN.
"""
from __future__ import annotations

import math
from typing import Literal, Sequence

from areal_kernel.errors import ConfigError, DataError

RewardNorm = Literal["group", "batch", "none"]


def _normalize(values: Sequence[float], std_normalize: bool, eps: float) -> list[float]:
    n = len(values)
    mean = sum(values) / n
    centered = [v - mean for v in values]
    if not std_normalize:
        return centered
    std = math.sqrt(sum(c * c for c in centered) / n)
    return [c / (std + eps) for c in centered]


def _check_finite(rewards: Sequence[float]) -> None:
    for i, r in enumerate(rewards):
        if not math.isfinite(r):
            raise DataError(f"reward {i} is {r}: rewards must be finite numbers")


def grpo_advantages(
    rewards: Sequence[float],
    group_ids: Sequence[str],
    *,
    std_normalize: bool = True,
    eps: float = 1e-6,
) -> list[float]:
    """GRPO advantages: each reward minus its group's mean, divided by the
    group's std (+eps) when ``std_normalize``. Groups are identified by
    ``group_ids`` (any order; members need not be contiguous)."""
    if len(rewards) != len(group_ids):
        raise DataError(f"{len(rewards)} rewards but {len(group_ids)} group_ids: they must align")
    _check_finite(rewards)
    members: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        members.setdefault(g, []).append(i)
    out = [0.0] * len(rewards)
    for idx in members.values():
        for i, a in zip(idx, _normalize([rewards[i] for i in idx], std_normalize, eps)):
            out[i] = a
    return out


def batch_advantages(rewards: Sequence[float], *, std_normalize: bool = True, eps: float = 1e-6) -> list[float]:
    """Rewards normalised over the whole batch (mean, and std when asked)."""
    _check_finite(rewards)
    if not rewards:
        return []
    return _normalize(list(rewards), std_normalize, eps)


def normalize_rewards(
    rewards: Sequence[float],
    group_ids: Sequence[str],
    mode: RewardNorm = "group",
    *,
    std_normalize: bool = True,
    eps: float = 1e-6,
) -> list[float]:
    """Sequence-level advantages: ``group`` (GRPO), ``batch`` or ``none`` (raw rewards)."""
    if mode == "group":
        return grpo_advantages(rewards, group_ids, std_normalize=std_normalize, eps=eps)
    if mode == "batch":
        return batch_advantages(rewards, std_normalize=std_normalize, eps=eps)
    if mode == "none":
        _check_finite(rewards)
        return [float(r) for r in rewards]
    raise ConfigError(f"reward_norm={mode!r} is not valid; use 'group', 'batch' or 'none'")


def broadcast_to_tokens(seq_values: Sequence[float], loss_masks: Sequence[Sequence[int]]) -> list[list[float]]:
    """Per-token rows: the sequence value on loss tokens, 0.0 elsewhere."""
    if len(seq_values) != len(loss_masks):
        raise DataError(f"{len(seq_values)} sequence values but {len(loss_masks)} loss masks")
    return [[float(v) if m else 0.0 for m in mask] for v, mask in zip(seq_values, loss_masks)]
