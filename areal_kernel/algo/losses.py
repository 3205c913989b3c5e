"""Policy losses following the train-engine loss contract.

Contract (see ``areal_kernel.engine.torch_engine``): a loss gets per-token
1-D tensors of one micro-batch and returns its *share* of the batch loss,
normalised by ``data["batch_loss_tokens"]`` (loss tokens of the whole batch),
so that summing shares over micro-batches gives the same result however the
batch was split. Stats use the same normalisation (summed by the engine),
except keys ending in ``_max``. Called outside an engine (no
``batch_loss_tokens``), the local loss-token count is used.
"""
from __future__ import annotations

from typing import Any, Callable

from areal_kernel.errors import ConfigError, DataError

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_penalty(log_ratio: Any, estimator: str = "k3") -> Any:
    """Per-token estimate of KL(pi || ref) from ``log_ratio = logp - ref_logp``
    of tokens sampled from pi: k1 = log_ratio, k2 = log_ratio^2 / 2,
    k3 = exp(-log_ratio) - 1 + log_ratio (unbiased and >= 0)."""
    import torch

    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio * log_ratio
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1.0 + log_ratio
    raise ConfigError(f"kl_estimator={estimator!r} is not valid; use one of {', '.join(KL_ESTIMATORS)}")


def _require(data: dict[str, Any], key: str, why: str) -> Any:
    if key not in data:
        raise DataError(f"loss data lacks {key!r} ({why}); pass it in train_batch(extra={{{key!r}: ...}})")
    return data[key]


def ppo_actor_loss(
    logprobs: Any,
    data: dict[str, Any],
    *,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    behav_imp_weight_cap: float | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    entropy: Any = None,
) -> tuple[Any, dict[str, Any]]:
    """Decoupled PPO clipped objective.

    With ``old`` = behaviour logprobs (the policy that sampled the tokens) and
    ``prox`` = proximal logprobs (``data["prox_logprobs"]``, defaulting to
    ``old``, which is standard PPO):

    * ``ratio = exp(logprobs - prox)``, clipped to ``[1 - eps_clip, 1 + eps_clip_high]``
      (``eps_clip_high`` defaults to ``eps_clip``), per-token loss
      ``max(-A * ratio, -A * clipped_ratio)``;
    * behaviour importance weight ``w = exp(prox - old)`` (constant) multiplies
      it; tokens with ``w > behav_imp_weight_cap`` are dropped (loss 0) but
      still count in the normaliser;
    * ``+ kl_coef * KL(pi || ref)`` with the chosen estimator over
      ``data["ref_logprobs"]``; ``- entropy_coef * entropy``.

    Returns ``(loss, stats)``; see the module docstring for normalisation.
    """
    import torch

    if eps_clip < 0 or (eps_clip_high is not None and eps_clip_high < 0):
        raise ConfigError(f"eps_clip ({eps_clip}) and eps_clip_high ({eps_clip_high}) must be >= 0")
    if behav_imp_weight_cap is not None and behav_imp_weight_cap <= 0.0:
        raise ConfigError(f"behav_imp_weight_cap must be > 0 (or None to disable), got {behav_imp_weight_cap}")
    if kl_estimator not in KL_ESTIMATORS:
        raise ConfigError(f"kl_estimator={kl_estimator!r} is not valid; use one of {', '.join(KL_ESTIMATORS)}")
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high

    mask = _require(data, "loss_mask", "which tokens are trained") > 0
    maskf = mask.to(logprobs.dtype)
    norm = data.get("batch_loss_tokens")
    if norm is None:
        norm = maskf.sum().clamp(min=1.0)
    adv = _require(data, "advantages", "per-token advantages").to(logprobs.dtype)
    old = _require(data, "old_logprobs", "behaviour-policy logprobs").to(logprobs.dtype)
    prox = data.get("prox_logprobs")
    prox = old if prox is None else prox.to(logprobs.dtype)

    def masked_mean(x: Any) -> Any:
        return torch.where(mask, x, torch.zeros_like(x)).sum() / norm

    # Non-loss tokens get log-ratio 0 so no exp() overflows and no inf*0 NaNs.
    log_ratio = torch.where(mask, logprobs - prox, torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - eps_clip, 1.0 + eps_high)
    pg1 = -adv * ratio
    pg2 = -adv * clipped_ratio
    pg = torch.maximum(pg1, pg2)
    clipped = mask & (pg2 > pg1)

    with torch.no_grad():
        behav_w = torch.exp(torch.where(mask, prox - old, torch.zeros_like(old)))
        keep = mask if behav_imp_weight_cap is None else mask & (behav_w <= behav_imp_weight_cap)
    pg_tok = torch.where(keep, pg * behav_w, torch.zeros_like(pg))
    pg_loss = pg_tok.sum() / norm
    loss = pg_loss

    stats: dict[str, Any] = {}
    ref = data.get("ref_logprobs")
    if kl_coef != 0.0 and ref is None:
        _require(data, "ref_logprobs", f"kl_coef={kl_coef} needs reference logprobs")
    if ref is not None:
        kl = kl_penalty(torch.where(mask, logprobs - ref.to(logprobs.dtype), torch.zeros_like(logprobs)), kl_estimator)
        kl_mean = masked_mean(kl)
        if kl_coef != 0.0:
            loss = loss + kl_coef * kl_mean
        stats["kl"] = kl_mean.detach()
    if entropy_coef != 0.0:
        if entropy is None:
            raise ConfigError("entropy_coef != 0 needs the per-token entropy (entropy=...)")
        loss = loss - entropy_coef * masked_mean(entropy)
    if entropy is not None:
        stats["entropy"] = masked_mean(entropy.detach())

    with torch.no_grad():
        zero = torch.zeros_like(ratio)
        stats.update(
            pg_loss=pg_loss.detach(),
            clip_frac=masked_mean(clipped.to(ratio.dtype)),
            clip_high_frac=masked_mean((clipped & (adv > 0)).to(ratio.dtype)),
            clip_low_frac=masked_mean((clipped & (adv < 0)).to(ratio.dtype)),
            importance_weight=masked_mean(ratio.detach()),
            approx_kl=masked_mean(ratio.detach() - 1.0 - log_ratio.detach()),
            behav_imp_weight=masked_mean(behav_w),
            behav_imp_weight_max=torch.where(mask, behav_w, zero).max() if mask.any() else zero.sum(),
            behav_masked_frac=masked_mean((mask & ~keep).to(ratio.dtype)),
            advantages=masked_mean(adv),
        )
    return loss, stats


def make_ppo_loss_fn(**kwargs: Any) -> Callable[[Any, Any, dict[str, Any]], tuple[Any, dict[str, Any]]]:
    """Bind ``ppo_actor_loss`` options into a ``loss_fn(logprobs, entropy, data)``
    for ``TrainEngine.train_batch``. Asks the engine for entropy gradients only
    when ``entropy_coef`` is non-zero."""

    def loss_fn(logprobs: Any, entropy: Any, data: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        return ppo_actor_loss(logprobs, data, entropy=entropy, **kwargs)

    loss_fn.needs_entropy_grad = kwargs.get("entropy_coef", 0.0) != 0.0  # type: ignore[attr-defined]
    return loss_fn
