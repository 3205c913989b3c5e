"""Train/inference mismatch: the servers' log-probabilities of the tokens
they sampled against the trainer's own, on the same tokens.

Where the numbers come from: every trajectory carries, per generated token,
the log-probability the server reported and the weight version that
sampled it. The RL step's first minibatch is scored by the trainer before
any optimizer update of that step, so on the tokens sampled with the
trainer's *current* version the two log-probabilities come from the same
weights; any gap there is the servers and the trainer computing different
distributions (a weight update that did not land, another temperature,
numerics). Older tokens differ by the policy's own change and are left out
(``mismatch/tokens`` says how many were compared).

Per step, over the compared tokens, with ``d = trainer - server`` log-prob:
``mismatch/abs_mean`` and ``mismatch/abs_max`` of ``|d|``; ``mismatch/k3``
the mean of ``exp(d) - 1 - d`` (the k3 estimate of KL(server || trainer),
non-negative per token, 0 only when equal); ``mismatch/frac_over`` the
fraction with ``|d|`` above ``monitor.mismatch.token_threshold``.

The micro-batch loop sums a loss function's stats over micro-batches and
ranks (keys ending in ``_max``: max), so the measurement emits sums and a
count and ``finish`` turns them into means once per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from areal_kernel.errors import ArealError

# The raw sums a measured micro-batch adds to the loss function's stats:
# over all loss tokens ("mm_") and over the fresh ones ("mm_fresh_").
_GROUPS = ("mm_", "mm_fresh_")
RAW_KEYS = tuple(g + k for g in _GROUPS for k in ("n", "abs_sum", "k3_sum", "over_n", "abs_max"))

WHAT_TO_CHECK = (
    "check that weight updates reach the servers (weight_update, the servers' logs), that the servers sample "
    "with the configured temperature, and that the servers and the trainer use the same dtype"
)


def measure(logprobs: Any, data: dict[str, Any], version: int, token_threshold: float) -> dict[str, Any]:
    """The raw sums over this micro-batch's loss tokens, and over those sampled at ``version``."""
    import torch

    with torch.no_grad():
        loss_mask = data["loss_mask"] > 0
        versions = data.get("versions")
        fresh = loss_mask & (versions == int(version)) if versions is not None else loss_mask
        d_all = logprobs.detach() - data["old_logprobs"].to(logprobs.dtype)
        out: dict[str, Any] = {}
        for group, mask in zip(_GROUPS, (loss_mask, fresh)):
            d = torch.where(mask, d_all, torch.zeros_like(d_all))
            # float64: exp(d) - 1 - d of tiny differences cancels in float32.
            d64 = d.to(torch.float64)
            a = d.abs()
            out[group + "n"] = mask.sum().to(torch.float64)
            out[group + "abs_sum"] = a.sum().to(torch.float64)
            out[group + "k3_sum"] = (torch.expm1(d64) - d64).sum()
            out[group + "over_n"] = (mask & (a > token_threshold)).sum().to(torch.float64)
            out[group + "abs_max"] = a.max() if a.numel() else torch.zeros((), dtype=logprobs.dtype)
        return out


def measured_loss(
    loss_fn: Callable[[Any, Any, dict[str, Any]], Any], version: int, token_threshold: float
) -> Callable[[Any, Any, dict[str, Any]], Any]:
    """``loss_fn`` that also adds the mismatch sums to its stats."""

    def fn(logprobs: Any, entropy: Any, data: dict[str, Any]) -> Any:
        loss, stats = loss_fn(logprobs, entropy, data)
        out = dict(stats or {})
        out.update(measure(logprobs, data, version, token_threshold))
        return loss, out

    for attr in ("needs_entropy_grad",):
        if hasattr(loss_fn, attr):
            setattr(fn, attr, getattr(loss_fn, attr))
    return fn


def finish(raw: dict[str, Any]) -> dict[str, float]:
    """The step's metrics (keys without the ``mismatch/`` prefix) from the
    summed raw stats; ``raw`` loses the raw keys. A group without a compared
    token gives only its count (0): a mean of nothing is not a measurement."""
    sums = {k: float(raw.pop(k)) for k in RAW_KEYS if k in raw}
    if not sums:
        return {}
    out: dict[str, float] = {}
    for group, name in zip(_GROUPS, ("", "fresh_")):
        n = sums.get(group + "n", 0.0)
        out[name + "tokens"] = n
        if n > 0:
            out[name + "abs_mean"] = sums[group + "abs_sum"] / n
            out[name + "abs_max"] = sums[group + "abs_max"]
            out[name + "k3"] = sums[group + "k3_sum"] / n
            out[name + "frac_over"] = sums[group + "over_n"] / n
    return out


class MismatchAlarm(ArealError):
    """``monitor.mismatch.action: error`` and the bound was exceeded ``patience`` steps in a row."""


@dataclass
class MismatchMonitor:
    """Counts consecutive checked steps whose ``mismatch/fresh_k3`` exceeds
    ``bound`` (only fresh tokens: on older ones the gap also holds the
    policy's own change since they were sampled, 0.04-0.25 in k3 for
    SmolLM2 at the learning tests' learning rate); at
    ``patience`` of them it warns once per streak (``warn``), or (``error``)
    ``raise_if_alarmed`` raises ``MismatchAlarm``, so that the trainer logs
    the step's metrics first. Steps without fresh tokens neither extend nor
    break a streak."""

    bound: float
    patience: int
    action: str = "warn"
    streak: int = 0
    alarms: int = 0
    warn: Callable[[str], None] = field(default=print)
    pending: str | None = None

    def observe(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """Fold in step ``step``'s metrics (keys as ``finish`` returns them);
        returns the monitor's own metrics for the step."""
        k3 = metrics.get("fresh_k3")
        if self.action == "off" or k3 is None or not metrics.get("fresh_tokens"):
            return {}
        if math.isfinite(k3) and k3 <= self.bound:
            self.streak = 0
        else:
            self.streak += 1
        fired = self.streak == self.patience
        if fired:
            self.alarms += 1
            msg = (
                f"train/inference mismatch at step {step}: mismatch/fresh_k3={k3:.3g} above monitor.mismatch.bound="
                f"{self.bound:g} for {self.patience} consecutive checked steps (on tokens sampled with the trainer's "
                f"weights: mean |logprob difference| {metrics.get('fresh_abs_mean', float('nan')):.3g}, max "
                f"{metrics.get('fresh_abs_max', float('nan')):.3g}); "
                f"{WHAT_TO_CHECK}"
            )
            if self.action == "error":
                self.pending = msg
            else:
                self.warn(f"warning: {msg}")
        return {"mismatch_streak": float(self.streak), "mismatch_alarm": 1.0 if fired else 0.0}

    def raise_if_alarmed(self) -> None:
        """Raise ``MismatchAlarm`` when ``action: error`` and the alarm fired."""
        if self.pending is not None:
            raise MismatchAlarm(self.pending)
