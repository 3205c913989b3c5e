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

from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

from areal_kernel.algo.advantages import (
    RewardNorm,
    discounted_returns,
    gae_advantages,
    normalize_rewards,
    rloo_advantages,
    token_reward_rows,
    whiten_tokens,
)
from areal_kernel.config.knobs import LEGACY_ESTIMATOR_KEYWORDS, AdvantageKnobs, knobs_with, old_keywords_attribute
from areal_kernel.errors import DataError

# The built-in estimators take ``knobs`` (None: the config's defaults) and, for
# a direct caller, the knobs' old keywords (gamma=, lam=, norm=, std_normalize=,
# eps=), which replace those of ``knobs``; no signature here restates a default.
# They share the contract's signature through ``_estimator``.


@dataclass
class AdvantageResult:
    """Per-token advantages and, for critic-based estimators, regression targets."""

    advantages: list[list[float]]
    returns: list[list[float]] | None = None


@dataclass(frozen=True)
class _Inputs:
    """What the contract hands an estimator, with the knobs resolved."""

    rewards: Sequence[float]
    group_ids: Sequence[str]
    loss_masks: Sequence[Sequence[int]]
    token_rewards: Any
    values: Any
    knobs: AdvantageKnobs

    def seq_rewards(self) -> list[float]:
        """Sequence-level estimators see per-token rewards as their sum over loss tokens."""
        if self.token_rewards is None:
            return [float(r) for r in self.rewards]
        return [
            float(r) + sum(float(x) for x, m in zip(row, mask) if m)
            for r, row, mask in zip(self.rewards, self.token_rewards, self.loss_masks)
        ]


_R = TypeVar("_R")


def _estimator(core: Callable[[_Inputs], _R]) -> Callable[..., _R]:
    """The built-in estimator ``core`` behind the contract's signature (the
    module docstring): the knobs are ``knobs`` with a direct caller's old
    keywords put in, the other keywords are ignored."""

    def estimator(
        rewards: Sequence[float],
        group_ids: Sequence[str],
        *,
        loss_masks: Sequence[Sequence[int]],
        token_rewards: Any = None,
        values: Any = None,
        knobs: AdvantageKnobs | None = None,
        **options: Any,
    ) -> _R:
        k = knobs_with(AdvantageKnobs, knobs, options)
        return core(_Inputs(rewards, group_ids, loss_masks, token_rewards, values, k))

    # The estimator's name and text (registrations and messages show them),
    # but no __wrapped__: inspect.signature must see this signature, whose
    # `knobs` parameter selects the current calling convention (rl.takes_knobs).
    estimator.__name__ = estimator.__qualname__ = core.__name__
    estimator.__doc__ = core.__doc__
    return estimator


@_estimator
def grpo(x: _Inputs) -> list[float]:
    """GRPO: ``(r - mean) / (std + eps)`` over the group (default) or the
    batch (``norm="batch"``); ``norm="none"`` gives raw rewards."""
    k = x.knobs
    return normalize_rewards(
        x.seq_rewards(), x.group_ids, k.adv_norm or "group", std_normalize=k.std_normalize, eps=k.adv_eps
    )


@_estimator
def dr_grpo(x: _Inputs) -> list[float]:
    """Dr.GRPO: ``r - mean`` (group by default), never divided by the std.
    The other half of Dr.GRPO, no length normalisation, is the loss
    aggregation ``seq-mean-token-sum``."""
    k = x.knobs
    return normalize_rewards(x.seq_rewards(), x.group_ids, k.adv_norm or "group", std_normalize=False, eps=k.adv_eps)


@_estimator
def rloo(x: _Inputs) -> list[float]:
    """RLOO: reward minus the mean of the *other* group members; optionally
    normalised afterwards at ``norm`` level (default: not normalised)."""
    k = x.knobs
    adv = rloo_advantages(x.seq_rewards(), x.group_ids)
    if k.adv_norm in (None, "none"):
        return adv
    return normalize_rewards(adv, x.group_ids, k.adv_norm, std_normalize=k.std_normalize, eps=k.adv_eps)


def _reinforce_pp(x: _Inputs, rewards: Sequence[float]) -> list[list[float]]:
    k = x.knobs
    rows = token_reward_rows(rewards, x.loss_masks, x.token_rewards)
    returns = discounted_returns(rows, x.loss_masks, k.gamma)
    norm: RewardNorm = k.adv_norm or "batch"
    return whiten_tokens(returns, x.loss_masks, norm, x.group_ids, std_normalize=k.std_normalize, eps=k.adv_eps)


@_estimator
def reinforce_pp(x: _Inputs) -> list[list[float]]:
    """REINFORCE++: per-token discounted returns of (token rewards + the
    sequence reward at the last loss token), normalised over all loss tokens
    of the batch (``norm`` default ``batch``)."""
    if len(x.rewards) != len(x.group_ids):
        raise DataError(f"{len(x.rewards)} rewards but {len(x.group_ids)} group_ids: they must align")
    return _reinforce_pp(x, x.rewards)


@_estimator
def reinforce_pp_baseline(x: _Inputs) -> list[list[float]]:
    """REINFORCE++ with baseline: subtract the group mean reward first, then
    as ``reinforce_pp`` (batch-normalised returns)."""
    return _reinforce_pp(x, normalize_rewards(x.rewards, x.group_ids, "group", std_normalize=False))


@_estimator
def gae(x: _Inputs) -> AdvantageResult:
    """GAE(gamma, lambda) with critic values (PPO). Advantages are whitened
    over the batch's loss tokens (``norm`` default ``batch``); the returns
    (critic targets) are computed before whitening."""
    if x.values is None:
        raise DataError("advantage estimator 'gae' needs critic values (values=...); the trainer adds a critic for it")
    k = x.knobs
    rows = token_reward_rows(x.rewards, x.loss_masks, x.token_rewards)
    adv, ret = gae_advantages(rows, x.values, x.loss_masks, k.gamma, k.lam)
    adv = whiten_tokens(
        adv, x.loss_masks, k.adv_norm or "batch", x.group_ids, std_normalize=k.std_normalize, eps=k.adv_eps
    )
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


# Deprecated: the knobs travel as one AdvantageKnobs object now.
__getattr__ = old_keywords_attribute(
    __name__, "ESTIMATOR_KEYWORDS", "an estimator", AdvantageKnobs, "areal_kernel.api.advantage_estimator",
    ("loss_masks", "token_rewards", "values") + LEGACY_ESTIMATOR_KEYWORDS,
)  # fmt: skip
