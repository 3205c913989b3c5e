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
    if std + eps == 0.0:  # all equal (only reachable with eps=0): every centred value is 0
        return [0.0] * n
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


# ---------------------------------------------------------------------------
# Reward shaping (applied to sequence rewards before any estimator)
# ---------------------------------------------------------------------------


def shape_rewards(
    rewards: Sequence[float], *, scale: float = 1.0, bias: float = 0.0, clip: float | None = None
) -> list[float]:
    """``clip((r + bias) * scale)`` to ``[-clip, clip]`` (no clipping when ``clip`` is None)."""
    _check_finite(rewards)
    if clip is not None and clip <= 0:
        raise ConfigError(f"reward_clip must be > 0 (or None to disable), got {clip}")
    out = []
    for r in rewards:
        v = (float(r) + bias) * scale
        if clip is not None:
            v = max(-clip, min(clip, v))
        out.append(v)
    return out


def overlong_penalty(gen_lens: Sequence[int], max_new_tokens: int, buffer_len: int, factor: float = 1.0) -> list[float]:
    """DAPO soft overlong punishment, one value per sequence (<= 0), added to the reward.

    With ``L_max = max_new_tokens`` and ``L_cache = buffer_len``: 0 for
    ``L <= L_max - L_cache``; ``-factor * (L - (L_max - L_cache)) / L_cache``
    inside the last ``L_cache`` tokens; ``-factor`` beyond ``L_max``.
    """
    if buffer_len < 1 or buffer_len > max_new_tokens:
        raise ConfigError(f"overlong_buffer_len={buffer_len} must be in [1, max_new_tokens={max_new_tokens}]")
    start = max_new_tokens - buffer_len
    out = []
    for n in gen_lens:
        if n <= start:
            out.append(0.0)
        elif n <= max_new_tokens:
            out.append(-factor * (n - start) / buffer_len)
        else:
            out.append(-float(factor))
    return out


# ---------------------------------------------------------------------------
# Building blocks of the estimators
# ---------------------------------------------------------------------------


def _groups(group_ids: Sequence[str]) -> dict[str, list[int]]:
    members: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        members.setdefault(g, []).append(i)
    return members


def rloo_advantages(rewards: Sequence[float], group_ids: Sequence[str]) -> list[float]:
    """Leave-one-out baseline: ``r_i - mean(r_j, j != i)`` within the group,
    i.e. ``n / (n - 1) * (r_i - mean)``. A singleton group has no baseline
    and gets 0 (no learning signal) rather than its raw reward."""
    if len(rewards) != len(group_ids):
        raise DataError(f"{len(rewards)} rewards but {len(group_ids)} group_ids: they must align")
    _check_finite(rewards)
    out = [0.0] * len(rewards)
    for idx in _groups(group_ids).values():
        n = len(idx)
        if n < 2:
            continue
        total = sum(rewards[i] for i in idx)
        for i in idx:
            out[i] = rewards[i] - (total - rewards[i]) / (n - 1)
    return out


def _loss_positions(mask: Sequence[int]) -> list[int]:
    return [i for i, m in enumerate(mask) if m]


def token_reward_rows(
    seq_rewards: Sequence[float],
    loss_masks: Sequence[Sequence[int]],
    token_rewards: Sequence[Sequence[float]] | None = None,
) -> list[list[float]]:
    """Per-token rewards: ``token_rewards`` (e.g. a KL penalty) on loss tokens,
    plus the sequence reward on each sequence's last loss token."""
    out = []
    for k, (r, mask) in enumerate(zip(seq_rewards, loss_masks)):
        row = [0.0] * len(mask)
        pos = _loss_positions(mask)
        if token_rewards is not None:
            for i in pos:
                row[i] = float(token_rewards[k][i])
        if pos:
            row[pos[-1]] += float(r)
        out.append(row)
    return out


def discounted_returns(
    token_rewards: Sequence[Sequence[float]], loss_masks: Sequence[Sequence[int]], gamma: float
) -> list[list[float]]:
    """``G_t = r_t + gamma * G_{t+1}`` over each sequence's loss tokens (the
    tokens the policy chose; prompt/tool tokens in between are skipped, not
    discounted). 0 on non-loss tokens."""
    out = []
    for rew, mask in zip(token_rewards, loss_masks):
        row = [0.0] * len(mask)
        g = 0.0
        for i in reversed(_loss_positions(mask)):
            g = float(rew[i]) + gamma * g
            row[i] = g
        out.append(row)
    return out


def gae_advantages(
    token_rewards: Sequence[Sequence[float]],
    values: Sequence[Sequence[float]],
    loss_masks: Sequence[Sequence[int]],
    gamma: float,
    lam: float,
) -> tuple[list[list[float]], list[list[float]]]:
    """Generalised advantage estimation over each sequence's loss tokens.

    ``values[k][t]`` is the critic's value of the state in which token ``t``
    was chosen. ``delta_t = r_t + gamma * V_{t+1} - V_t`` (``V`` after the last
    loss token is 0: the episode ended), ``A_t = delta_t + gamma * lam * A_{t+1}``,
    returns ``R_t = A_t + V_t`` (the critic's regression targets). Both are
    0 on non-loss tokens."""
    advs, rets = [], []
    for rew, val, mask in zip(token_rewards, values, loss_masks):
        a_row = [0.0] * len(mask)
        r_row = [0.0] * len(mask)
        next_v, next_a = 0.0, 0.0
        for i in reversed(_loss_positions(mask)):
            v = float(val[i])
            delta = float(rew[i]) + gamma * next_v - v
            next_a = delta + gamma * lam * next_a
            a_row[i] = next_a
            r_row[i] = next_a + v
            next_v = v
        advs.append(a_row)
        rets.append(r_row)
    return advs, rets


def whiten_tokens(
    rows: Sequence[Sequence[float]],
    loss_masks: Sequence[Sequence[int]],
    level: RewardNorm,
    group_ids: Sequence[str] | None = None,
    *,
    std_normalize: bool = True,
    eps: float = 1e-6,
) -> list[list[float]]:
    """Normalise per-token values over the loss tokens of the whole batch
    (``batch``), of each group (``group``) or not at all (``none``): subtract
    the mean, divide by the population std (+eps) when ``std_normalize``.
    Non-loss tokens stay 0."""
    if level not in ("group", "batch", "none"):
        raise ConfigError(f"adv_norm={level!r} is not valid; use 'group', 'batch' or 'none'")
    out = [[float(x) if m else 0.0 for x, m in zip(row, mask)] for row, mask in zip(rows, loss_masks)]
    if level == "none":
        return out
    if level == "batch":
        sets = [list(range(len(out)))]
    else:
        if group_ids is None:
            raise DataError("group-level normalisation needs group_ids")
        sets = list(_groups(group_ids).values())
    for seqs in sets:
        vals = [out[k][i] for k in seqs for i in _loss_positions(loss_masks[k])]
        if not vals:
            continue
        normed = iter(_normalize(vals, std_normalize, eps))
        for k in seqs:
            for i in _loss_positions(loss_masks[k]):
                out[k][i] = next(normed)
    return out
