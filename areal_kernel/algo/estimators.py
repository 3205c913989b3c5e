"""The advantage estimators registered by the kernel (``algorithm.advantage``).

Contract (what a plugin's estimator must accept; see docs/algorithms.md)::

    fn(rewards, group_ids, *, loss_masks, token_rewards, values, knobs, **settings)
        -> list[float] | list[list[float]] | AdvantageResult

* ``rewards``: one (shaped) reward per trajectory; ``group_ids``: its group.
* ``loss_masks``: per-token 0/1 rows (1 = a token the policy chose).
* ``token_rewards``: per-token rewards to add (the KL penalty when
  ``algorithm.kl_in: reward``), or ``None``.
* ``values``: per-token critic values (only for estimators registered with
  ``capabilities=["needs_values"]``), else ``None``.
* ``knobs``: the shared knobs (``AdvantageKnobs``: ``gamma``, ``lam``,
  ``adv_norm`` (``group``/``batch``/``none``, ``None`` meaning the
  estimator's own default), ``std_normalize``, ``adv_eps``), the config's values.
* an estimator that registered a ``config_model`` also gets its validated
  ``algorithm.<name>`` settings as keywords: every field, defaults
  included (declare them without defaults: the model holds the only ones).
  Accept ``**kwargs`` and ignore what you do not use.

Return one value per trajectory (broadcast to its loss tokens), one row per
trajectory (per-token advantages), or an ``AdvantageResult`` that also carries
critic ``returns``. Everything here is pure Python (no torch).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Sequence

from areal_kernel.algo.advantages import (
    RewardNorm,
    discounted_returns,
    gae_advantages,
    normalize_rewards,
    rloo_advantages,
    token_reward_rows,
    whiten_tokens,
)
from areal_kernel.config.knobs import LEGACY_ESTIMATOR_KEYWORDS, AdvantageKnobs, knobs_with
from areal_kernel.errors import ArealDeprecationWarning, DataError

# The built-in estimators take ``knobs`` (None: the config's defaults) and, for
# a direct caller, the knobs' old keywords (gamma=, lam=, norm=, std_normalize=,
# eps=), which replace those of ``knobs``; no signature here restates a default.


@dataclass
class AdvantageResult:
    """Per-token advantages and, for critic-based estimators, regression targets."""

    advantages: list[list[float]]
    returns: list[list[float]] | None = None


def _seq_rewards(rewards: Sequence[float], loss_masks: Sequence[Sequence[int]], token_rewards: Any) -> list[float]:
    """Sequence-level estimators see per-token rewards as their sum over loss tokens."""
    if token_rewards is None:
        return [float(r) for r in rewards]
    return [
        float(r) + sum(float(x) for x, m in zip(row, mask) if m)
        for r, row, mask in zip(rewards, token_rewards, loss_masks)
    ]


def grpo(
    rewards: Sequence[float],
    group_ids: Sequence[str],
    *,
    loss_masks: Sequence[Sequence[int]],
    token_rewards: Any = None,
    knobs: AdvantageKnobs | None = None,
    **options: Any,
) -> list[float]:
    """GRPO: ``(r - mean) / (std + eps)`` over the group (default) or the
    batch (``norm="batch"``); ``norm="none"`` gives raw rewards."""
    k = knobs_with(AdvantageKnobs, knobs, options)
    seq = _seq_rewards(rewards, loss_masks, token_rewards)
    return normalize_rewards(seq, group_ids, k.adv_norm or "group", std_normalize=k.std_normalize, eps=k.adv_eps)


def dr_grpo(
    rewards: Sequence[float],
    group_ids: Sequence[str],
    *,
    loss_masks: Sequence[Sequence[int]],
    token_rewards: Any = None,
    knobs: AdvantageKnobs | None = None,
    **options: Any,
) -> list[float]:
    """Dr.GRPO: ``r - mean`` (group by default), never divided by the std.
    The other half of Dr.GRPO, no length normalisation, is the loss
    aggregation ``seq-mean-token-sum``."""
    k = knobs_with(AdvantageKnobs, knobs, options)
    seq = _seq_rewards(rewards, loss_masks, token_rewards)
    return normalize_rewards(seq, group_ids, k.adv_norm or "group", std_normalize=False, eps=k.adv_eps)


def rloo(
    rewards: Sequence[float],
    group_ids: Sequence[str],
    *,
    loss_masks: Sequence[Sequence[int]],
    token_rewards: Any = None,
    knobs: AdvantageKnobs | None = None,
    **options: Any,
) -> list[float]:
    """RLOO: reward minus the mean of the *other* group members; optionally
    normalised afterwards at ``norm`` level (default: not normalised)."""
    k = knobs_with(AdvantageKnobs, knobs, options)
    adv = rloo_advantages(_seq_rewards(rewards, loss_masks, token_rewards), group_ids)
    if k.adv_norm in (None, "none"):
        return adv
    return normalize_rewards(adv, group_ids, k.adv_norm, std_normalize=k.std_normalize, eps=k.adv_eps)


def _reinforce_pp(
    rewards: Sequence[float],
    group_ids: Sequence[str],
    loss_masks: Sequence[Sequence[int]],
    token_rewards: Any,
    k: AdvantageKnobs,
) -> list[list[float]]:
    rows = token_reward_rows(rewards, loss_masks, token_rewards)
    returns = discounted_returns(rows, loss_masks, k.gamma)
    norm: RewardNorm = k.adv_norm or "batch"
    return whiten_tokens(returns, loss_masks, norm, group_ids, std_normalize=k.std_normalize, eps=k.adv_eps)


def reinforce_pp(
    rewards: Sequence[float],
    group_ids: Sequence[str],
    *,
    loss_masks: Sequence[Sequence[int]],
    token_rewards: Any = None,
    knobs: AdvantageKnobs | None = None,
    **options: Any,
) -> list[list[float]]:
    """REINFORCE++: per-token discounted returns of (token rewards + the
    sequence reward at the last loss token), normalised over all loss tokens
    of the batch (``norm`` default ``batch``)."""
    if len(rewards) != len(group_ids):
        raise DataError(f"{len(rewards)} rewards but {len(group_ids)} group_ids: they must align")
    return _reinforce_pp(rewards, group_ids, loss_masks, token_rewards, knobs_with(AdvantageKnobs, knobs, options))


def reinforce_pp_baseline(
    rewards: Sequence[float],
    group_ids: Sequence[str],
    *,
    loss_masks: Sequence[Sequence[int]],
    token_rewards: Any = None,
    knobs: AdvantageKnobs | None = None,
    **options: Any,
) -> list[list[float]]:
    """REINFORCE++ with baseline: subtract the group mean reward first, then
    as ``reinforce_pp`` (batch-normalised returns)."""
    centred = normalize_rewards(rewards, group_ids, "group", std_normalize=False)
    return _reinforce_pp(centred, group_ids, loss_masks, token_rewards, knobs_with(AdvantageKnobs, knobs, options))


def gae(
    rewards: Sequence[float],
    group_ids: Sequence[str],
    *,
    loss_masks: Sequence[Sequence[int]],
    values: Any = None,
    token_rewards: Any = None,
    knobs: AdvantageKnobs | None = None,
    **options: Any,
) -> AdvantageResult:
    """GAE(gamma, lambda) with critic values (PPO). Advantages are whitened
    over the batch's loss tokens (``norm`` default ``batch``); the returns
    (critic targets) are computed before whitening."""
    if values is None:
        raise DataError("advantage estimator 'gae' needs critic values (values=...); the trainer adds a critic for it")
    k = knobs_with(AdvantageKnobs, knobs, options)
    rows = token_reward_rows(rewards, loss_masks, token_rewards)
    adv, ret = gae_advantages(rows, values, loss_masks, k.gamma, k.lam)
    adv = whiten_tokens(adv, loss_masks, k.adv_norm or "batch", group_ids, std_normalize=k.std_normalize, eps=k.adv_eps)
    return AdvantageResult(adv, ret)


def to_token_rows(
    result: Any, loss_masks: Sequence[Sequence[int]], name: str = "estimator"
) -> tuple[list[list[float]], list[list[float]] | None]:
    """Turn any allowed estimator output into ``(per-token advantages, returns)``;
    values off the loss tokens are zeroed. Raises ``DataError`` naming the
    estimator on a wrong shape or a non-finite value."""
    import math

    returns = None
    if isinstance(result, AdvantageResult):
        rows, returns = result.advantages, result.returns
    else:
        rows = list(result)
    if len(rows) != len(loss_masks):
        raise DataError(f"advantage estimator '{name}' returned {len(rows)} values for {len(loss_masks)} trajectories")
    out = []
    for k, (row, mask) in enumerate(zip(rows, loss_masks)):
        if isinstance(row, (int, float)):
            row = [float(row)] * len(mask)
        row = list(row)
        if len(row) != len(mask):
            raise DataError(
                f"advantage estimator '{name}': row {k} has {len(row)} values, expected {len(mask)} (one per token)"
            )
        vals = [float(x) if m else 0.0 for x, m in zip(row, mask)]
        if not all(math.isfinite(v) for v in vals):
            raise DataError(f"advantage estimator '{name}' produced a non-finite advantage in row {k}")
        out.append(vals)
    return out, returns


def __getattr__(name: str) -> Any:
    # Deprecated: the knobs travel as one AdvantageKnobs object now.
    if name == "ESTIMATOR_KEYWORDS":
        warnings.warn(
            "areal_kernel.algo.estimators.ESTIMATOR_KEYWORDS is deprecated: an estimator takes knobs= "
            "(areal_kernel.api.advantage_estimator.AdvantageKnobs); the names are AdvantageKnobs.model_fields",
            ArealDeprecationWarning,
            stacklevel=2,
        )
        return ("loss_masks", "token_rewards", "values") + LEGACY_ESTIMATOR_KEYWORDS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
