"""Policy losses following the train-engine loss contract.

Contract (see ``areal_kernel.api.loss``): a loss gets per-token
1-D tensors of one micro-batch and returns its *share* of the batch loss,
normalised by ``data["batch_loss_tokens"]`` (loss tokens of the whole batch),
so that summing shares over micro-batches gives the same result however the
batch was split. Stats use the same normalisation (summed by the engine),
except keys ending in ``_max``. Called outside an engine (no
``batch_loss_tokens``), the local loss-token count is used.
"""

from __future__ import annotations

from typing import Any, Callable

from areal_kernel.config.knobs import LEGACY_LOSS_KEYWORDS, LossKnobs, knobs_with, old_keywords_attribute
from areal_kernel.errors import ConfigError, DataError

KL_ESTIMATORS = ("k1", "k2", "k3")
RATIO_LEVELS = ("token", "sequence")
BEHAV_MODES = ("mask", "clamp")
LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def make_aggregator(data: dict[str, Any], mask: Any, mode: str, norm: Any = None) -> Callable[[Any], Any]:
    """``agg(x)`` reducing per-token values ``x`` (already 0 off the loss
    tokens) to this micro-batch's share of the batch loss, per ``mode``
    (see ``ppo_actor_loss``). Outside an engine (no batch scalars) the local
    counts stand in: loss tokens, sequences in ``seq_ids`` (or one)."""
    import torch

    if mode not in LOSS_AGGS:
        raise ConfigError(f"loss_agg={mode!r} is not valid; use one of {', '.join(LOSS_AGGS)}")
    maskf = mask.to(torch.float32)
    if mode == "token-mean":
        n_tok = norm if norm is not None else data.get("batch_loss_tokens")
        if n_tok is None:
            n_tok = maskf.sum().clamp(min=1.0)
        return lambda x: x.sum() / n_tok
    n_seqs = data.get("batch_n_seqs")
    if n_seqs is None:
        seq_ids = data.get("seq_ids")
        n_seqs = float(torch.unique(seq_ids).numel()) if seq_ids is not None else 1.0
    if mode == "seq-mean-token-sum":
        return lambda x: x.sum() / n_seqs
    seq_tok = data.get("seq_loss_tokens")
    if seq_tok is None:
        seq_tok = _per_seq_broadcast(maskf, data, maskf).clamp(min=1.0)
    return lambda x: (x / seq_tok.to(x.dtype)).sum() / n_seqs


def _per_seq_broadcast(values: Any, data: dict[str, Any], maskf: Any) -> Any:
    """Per-token sum of ``values * mask`` over the token's own sequence."""
    import torch

    seq_ids = data.get("seq_ids")
    if seq_ids is None:
        return (values * maskf).sum().expand_as(values)
    size = int(seq_ids.max()) + 1 if seq_ids.numel() else 1
    sums = torch.zeros(size, dtype=values.dtype, device=values.device).index_add(0, seq_ids, values * maskf)
    return sums.index_select(0, seq_ids)


def per_sequence_mean(values: Any, data: dict[str, Any], mask: Any) -> Any:
    """Per-token mean of ``values`` over the loss tokens of the token's own
    sequence (sequences are never split across micro-batches)."""
    maskf = mask.to(values.dtype)
    return _per_seq_broadcast(values, data, maskf) / _per_seq_broadcast(maskf, data, maskf).clamp(min=1.0)


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
    entropy: Any = None,
    knobs: LossKnobs | None = None,
    **options: Any,
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

    The options are the fields of ``knobs`` (``LossKnobs``; ``None``: the
    config's defaults, ``LossKnobs()``). A direct caller may also pass them
    as keywords (``eps_clip=0.1``), which replace those of ``knobs``; other
    keywords are ignored, so one set of options can be passed to any loss.
    Besides the ones above:

    * ``dual_clip`` (> 1): for ``A < 0`` the token loss is also capped at
      ``-A * dual_clip`` (Dual-clip PPO), bounding the push on tokens whose
      ratio exploded.
    * ``ratio_level="sequence"`` (GSPO): every token of a sequence uses the
      sequence ratio ``s = exp(mean_t(logprobs_t - prox_t))`` over its loss
      tokens, written per token as ``exp(sg(log s) + logprobs_t - sg(logprobs_t))``
      so its value is ``s`` and its gradient flows through each token; it is
      clipped like a token ratio.
    * ``behav_imp_weight_mode``: ``"mask"`` drops tokens whose behaviour
      weight exceeds ``behav_imp_weight_cap``; ``"clamp"`` keeps them with the
      weight clamped to the cap.
    * ``data["prox_alpha"]`` (when ``prox_logprobs`` is absent): the proximal
      logprob is interpolated, ``prox = old + alpha * (sg(logprobs) - old)``
      (see ``areal_kernel.algo.rl.prox_interpolation_alpha``).
    * ``loss_agg``: ``"token-mean"`` (every loss token of the batch weighs the
      same), ``"seq-mean-token-mean"`` (mean over sequences of each
      sequence's token mean) or ``"seq-mean-token-sum"`` (mean over sequences
      of token sums; no length normalisation, as in Dr.GRPO). KL and entropy
      terms use the same aggregation; stats are always token means.

    Returns ``(loss, stats)``; see the module docstring for normalisation.
    """
    import torch

    k = knobs_with(LossKnobs, knobs, options)
    eps_clip, eps_clip_high, dual_clip = k.eps_clip, k.eps_clip_high, k.dual_clip
    behav_imp_weight_cap, behav_imp_weight_mode = k.behav_imp_weight_cap, k.behav_imp_weight_mode
    kl_coef, kl_estimator, entropy_coef = k.kl_coef, k.kl_estimator, k.entropy_coef
    ratio_level, loss_agg = k.ratio_level, k.loss_agg
    if eps_clip < 0 or (eps_clip_high is not None and eps_clip_high < 0):
        raise ConfigError(f"eps_clip ({eps_clip}) and eps_clip_high ({eps_clip_high}) must be >= 0")
    if behav_imp_weight_cap is not None and behav_imp_weight_cap <= 0.0:
        raise ConfigError(f"behav_imp_weight_cap must be > 0 (or None to disable), got {behav_imp_weight_cap}")
    if kl_estimator not in KL_ESTIMATORS:
        raise ConfigError(f"kl_estimator={kl_estimator!r} is not valid; use one of {', '.join(KL_ESTIMATORS)}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ConfigError(f"dual_clip must be > 1 (or None to disable), got {dual_clip}")
    if ratio_level not in RATIO_LEVELS:
        raise ConfigError(f"ratio_level={ratio_level!r} is not valid; use one of {', '.join(RATIO_LEVELS)}")
    if behav_imp_weight_mode not in BEHAV_MODES:
        raise ConfigError(
            f"behav_imp_weight_mode={behav_imp_weight_mode!r} is not valid; use one of {', '.join(BEHAV_MODES)}"
        )
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high

    mask = _require(data, "loss_mask", "which tokens are trained") > 0
    maskf = mask.to(logprobs.dtype)
    norm = data.get("batch_loss_tokens")
    if norm is None:
        norm = maskf.sum().clamp(min=1.0)
    adv = _require(data, "advantages", "per-token advantages").to(logprobs.dtype)
    old = _require(data, "old_logprobs", "behaviour-policy logprobs").to(logprobs.dtype)
    prox = data.get("prox_logprobs")
    if prox is not None:
        prox = prox.to(logprobs.dtype)
    elif data.get("prox_alpha") is not None:
        # Version-interpolated proximal policy: no recompute pass.
        alpha = data["prox_alpha"].to(logprobs.dtype)
        prox = old + alpha * (logprobs.detach() - old)
    else:
        prox = old
    aggregate = make_aggregator(data, mask, loss_agg, norm)

    def masked_mean(x: Any) -> Any:
        return torch.where(mask, x, torch.zeros_like(x)).sum() / norm

    # Non-loss tokens get log-ratio 0 so no exp() overflows and no inf*0 NaNs.
    log_ratio = torch.where(mask, logprobs - prox, torch.zeros_like(logprobs))
    if ratio_level == "sequence":
        seq_lr = per_sequence_mean(log_ratio.detach(), data, mask)
        log_ratio = seq_lr + log_ratio - log_ratio.detach()
        log_ratio = torch.where(mask, log_ratio, torch.zeros_like(log_ratio))
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - eps_clip, 1.0 + eps_high)
    pg1 = -adv * ratio
    pg2 = -adv * clipped_ratio
    pg = torch.maximum(pg1, pg2)
    clipped = mask & (pg2 > pg1)
    if dual_clip is not None:
        pg3 = -adv * dual_clip
        dual = mask & (adv < 0) & (pg3 < pg)
        pg = torch.where(adv < 0, torch.minimum(pg, pg3), pg)

    with torch.no_grad():
        behav_w = torch.exp(torch.where(mask, prox - old, torch.zeros_like(old)))
        keep = mask
        weight = behav_w
        if behav_imp_weight_cap is not None:
            if behav_imp_weight_mode == "mask":
                keep = mask & (behav_w <= behav_imp_weight_cap)
            else:
                weight = behav_w.clamp(max=behav_imp_weight_cap)
    pg_tok = torch.where(keep, pg * weight, torch.zeros_like(pg))
    pg_loss = aggregate(pg_tok)
    loss = pg_loss

    stats: dict[str, Any] = {}
    ref = data.get("ref_logprobs")
    if kl_coef != 0.0 and ref is None:
        _require(data, "ref_logprobs", f"kl_coef={kl_coef} needs reference logprobs")
    if ref is not None:
        kl = kl_penalty(torch.where(mask, logprobs - ref.to(logprobs.dtype), torch.zeros_like(logprobs)), kl_estimator)
        kl_mean = masked_mean(kl)
        if kl_coef != 0.0:
            loss = loss + kl_coef * (kl_mean if loss_agg == "token-mean" else aggregate(kl))
        stats["kl"] = kl_mean.detach()
    if entropy_coef != 0.0:
        if entropy is None:
            raise ConfigError("entropy_coef != 0 needs the per-token entropy (entropy=...)")
        ent_term = (
            masked_mean(entropy)
            if loss_agg == "token-mean"
            else aggregate(torch.where(mask, entropy, torch.zeros_like(entropy)))
        )
        loss = loss - entropy_coef * ent_term
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
            behav_clamped_frac=masked_mean((keep & (weight < behav_w)).to(ratio.dtype)),
            advantages=masked_mean(adv),
        )
        if dual_clip is not None:
            stats["dual_clip_frac"] = masked_mean(dual.to(ratio.dtype))
    return loss, stats


def make_ppo_loss_fn(
    knobs: LossKnobs | None = None, **options: Any
) -> Callable[[Any, Any, dict[str, Any]], tuple[Any, dict[str, Any]]]:
    """Bind ``ppo_actor_loss`` options (``knobs``, keywords replacing its
    fields) into a ``loss_fn(logprobs, entropy, data)`` for
    ``TrainEngine.train_batch``. Asks the engine for entropy gradients only
    when ``entropy_coef`` is non-zero."""
    k = knobs_with(LossKnobs, knobs, options)

    def loss_fn(logprobs: Any, entropy: Any, data: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        return ppo_actor_loss(logprobs, data, entropy=entropy, knobs=k)

    loss_fn.needs_entropy_grad = k.entropy_coef != 0.0  # type: ignore[attr-defined]
    return loss_fn


# Deprecated: the knobs travel as one LossKnobs object now.
__getattr__ = old_keywords_attribute(
    __name__, "LOSS_KEYWORDS", "a loss", LossKnobs, "areal_kernel.api.loss", ("entropy",) + LEGACY_LOSS_KEYWORDS
)


def value_loss(
    values: Any,
    data: dict[str, Any],
    *,
    value_eps_clip: float | None = 0.2,
    loss_agg: str = "token-mean",
) -> tuple[Any, dict[str, Any]]:
    """Clipped value regression for a critic, same contract as the policy
    losses (``values`` in place of ``logprobs``).

    ``data["returns"]`` are the targets, ``data["old_values"]`` the values the
    advantages were computed with. ``v_clip = old + clamp(v - old, -eps, eps)``
    and the token loss is ``0.5 * max((v - R)^2, (v_clip - R)^2)``; with
    ``value_eps_clip=None`` just ``0.5 * (v - R)^2``.
    """
    import torch

    if value_eps_clip is not None and value_eps_clip <= 0:
        raise ConfigError(f"value_eps_clip must be > 0 (or None to disable), got {value_eps_clip}")
    mask = _require(data, "loss_mask", "which tokens are trained") > 0
    norm = data.get("batch_loss_tokens")
    if norm is None:
        norm = mask.to(values.dtype).sum().clamp(min=1.0)
    ret = _require(data, "returns", "critic targets").to(values.dtype)
    old = _require(data, "old_values", "values the advantages were computed with").to(values.dtype)
    aggregate = make_aggregator(data, mask, loss_agg, norm)
    zero = torch.zeros_like(values)
    err = (values - ret) ** 2
    if value_eps_clip is None:
        tok = 0.5 * err
        clipped = torch.zeros_like(mask)
    else:
        v_clip = old + (values - old).clamp(-value_eps_clip, value_eps_clip)
        err_clip = (v_clip - ret) ** 2
        tok = 0.5 * torch.maximum(err, err_clip)
        clipped = mask & (err_clip > err)
    tok = torch.where(mask, tok, zero)
    loss = aggregate(tok)
    with torch.no_grad():
        stats = {
            "value_loss": loss.detach(),
            "value_clip_frac": torch.where(mask, clipped.to(values.dtype), zero).sum() / norm,
            "value_mean": torch.where(mask, values.detach(), zero).sum() / norm,
            "return_mean": torch.where(mask, ret, zero).sum() / norm,
        }
    return loss, stats
