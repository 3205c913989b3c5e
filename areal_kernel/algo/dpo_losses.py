"""DPO / IPO pair losses, and how a pair loss goes through ``train_batch``.

Pair losses are functions of whole-sequence scores (summed or averaged answer
logprobs of the chosen and rejected answer), and a pair's two sequences may
land in different micro-batches. So the trainers use a two-pass scheme that
gives the exact gradient of the batch loss whatever the micro-batching:

1. score every sequence without gradients (``compute_logprobs``) and evaluate
   the pair loss on those scores, getting ``dL/d score_s`` for each sequence;
2. ``train_batch`` with :func:`sequence_linear_loss`, whose per-token terms are
   ``coef_s * logprob_t`` (``coef_s = dL/d score_s``, divided by the answer
   length when scores are averages). Its gradient is ``sum_s dL/d score_s *
   d score_s/d theta`` = the gradient of ``L``, by the chain rule, because both
   passes see the same weights.

The cost is one extra forward pass without gradients.
"""

from __future__ import annotations

from typing import Any, Callable

from areal_kernel.errors import ConfigError, DataError

PAIR_LOSSES = ("dpo", "ipo")


def dpo_pair_losses(
    chosen: Any,
    rejected: Any,
    ref_chosen: Any,
    ref_rejected: Any,
    *,
    beta: float,
    loss_type: str = "dpo",
    label_smoothing: float = 0.0,
) -> tuple[Any, Any, Any]:
    """Per-pair losses and implicit rewards from 1-D tensors of sequence scores.

    With ``h = (chosen - ref_chosen) - (rejected - ref_rejected)``:

    * ``dpo``: ``-(1 - eps) * log sigmoid(beta * h) - eps * log sigmoid(-beta * h)``
      (``eps = label_smoothing``; 0 is the original DPO loss);
    * ``ipo``: ``(h - 1 / (2 * beta))^2``.

    Returns ``(losses, chosen_rewards, rejected_rewards)`` where the implicit
    rewards are ``beta * (score - ref_score)`` (detached).
    """
    import torch.nn.functional as F

    if beta <= 0:
        raise ConfigError(f"beta must be > 0, got {beta}")
    h = (chosen - ref_chosen) - (rejected - ref_rejected)
    if loss_type == "dpo":
        if not 0.0 <= label_smoothing < 0.5:
            raise ConfigError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
        losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        raise ConfigError(f"pair loss {loss_type!r} is not valid; use one of {', '.join(PAIR_LOSSES)}")
    return losses, (beta * (chosen - ref_chosen)).detach(), (beta * (rejected - ref_rejected)).detach()


def pair_stats(losses: Any, chosen_rewards: Any, rejected_rewards: Any) -> dict[str, float]:
    """Mean loss, rewards, margin and preference accuracy (chosen reward strictly higher)."""
    margin = chosen_rewards - rejected_rewards
    return {
        "loss": float(losses.detach().mean()),
        "rewards/chosen": float(chosen_rewards.mean()),
        "rewards/rejected": float(rejected_rewards.mean()),
        "rewards/margin": float(margin.mean()),
        "rewards/accuracy": float((margin > 0).float().mean()),
    }


def pair_loss_and_grads(
    loss_of: Callable[[Any, Any], Any], chosen: list[float], rejected: list[float]
) -> tuple[float, list[float], list[float]]:
    """``L = mean_p loss_of(chosen, rejected)[p]`` and its gradients with
    respect to every chosen and rejected score (float64 autograd on the
    per-pair scores only: cheap, no model involved)."""
    import torch

    if len(chosen) != len(rejected) or not chosen:
        raise DataError(
            f"need as many chosen as rejected scores (and at least one), got {len(chosen)} and {len(rejected)}"
        )
    c = torch.tensor(chosen, dtype=torch.float64, requires_grad=True)
    r = torch.tensor(rejected, dtype=torch.float64, requires_grad=True)
    loss = loss_of(c, r).mean()
    loss.backward()
    # Both are leaves with requires_grad and part of the loss: backward() set their grads.
    assert c.grad is not None and r.grad is not None
    return float(loss.detach()), c.grad.tolist(), r.grad.tolist()


def sequence_linear_loss(values: Any, data: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``sum_t seq_coef_t * values_t`` over loss tokens: the surrogate whose
    gradient is the pair loss's (see the module docstring). ``seq_coef`` comes
    in ``train_batch(extra=...)`` already divided by pair count (and answer
    length for averaged scores), so summing micro-batch shares is exact."""
    import torch

    for key in ("loss_mask", "seq_coef"):
        if key not in data:
            raise DataError(f"loss data lacks {key!r}; pass seq_coef in train_batch(extra={{'seq_coef': ...}})")
    mask = data["loss_mask"] > 0
    terms = torch.where(mask, data["seq_coef"].to(values.dtype) * values, torch.zeros_like(values))
    return terms.sum(), {}


def make_sequence_linear_loss_fn() -> Callable[[Any, Any, dict[str, Any]], tuple[Any, dict[str, Any]]]:
    def loss_fn(values: Any, entropy: Any, data: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        return sequence_linear_loss(values, data)

    return loss_fn
