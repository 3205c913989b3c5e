"""SFT loss under the train-engine loss contract (``areal_kernel.api.loss``).

Negative log-likelihood of the loss tokens (the answer / assistant tokens).
Each micro-batch returns its share of the *batch* loss, normalised by
batch-level counts, so the result does not depend on how the engine split the
batch into micro-batches.
"""

from __future__ import annotations

from typing import Any, Callable

from areal_kernel.errors import ConfigError, DataError

AGGREGATIONS = ("token_mean", "seq_mean")


def sft_loss(logprobs: Any, data: dict[str, Any], aggregation: str = "token_mean") -> tuple[Any, dict[str, Any]]:
    """``token_mean``: sum of ``-logprob`` over loss tokens / loss tokens of the
    batch (every answer token weighs the same). ``seq_mean``: per sequence the
    mean ``-logprob`` of its loss tokens, averaged over the batch's sequences
    (a short answer weighs as much as a long one).

    Stats: ``nll_sum`` (summed ``-logprob`` of this micro-batch's loss tokens)
    and ``nll_tokens``; the engine sums them over micro-batches, so
    ``nll_sum / nll_tokens`` is the batch's token-mean NLL whatever the aggregation.
    """
    import torch

    if aggregation not in AGGREGATIONS:
        raise ConfigError(f"loss_aggregation={aggregation!r} is not valid; use one of {', '.join(AGGREGATIONS)}")
    if "loss_mask" not in data:
        raise DataError("loss data lacks 'loss_mask' (which tokens are trained)")
    mask = data["loss_mask"].to(logprobs.dtype)
    nll = -logprobs * mask  # 0 off the mask (logprobs there may be 0 or garbage; mask wins)
    nll = torch.where(mask > 0, nll, torch.zeros_like(nll))
    if aggregation == "token_mean":
        norm = data.get("batch_loss_tokens")
        if norm is None:
            norm = mask.sum().clamp(min=1.0)
        loss = nll.sum() / norm
    else:
        seq_tokens = data.get("seq_loss_tokens")
        n_seqs = data.get("batch_n_seqs")
        if seq_tokens is None or n_seqs is None:
            # Outside an engine: compute both from seq_ids of this micro-batch.
            seq_ids = data["seq_ids"]
            _, inv = torch.unique(seq_ids, return_inverse=True)
            counts = torch.zeros(int(inv.max()) + 1, dtype=mask.dtype, device=mask.device).index_add(0, inv, mask)
            seq_tokens = counts.clamp(min=1.0)[inv]
            n_seqs = torch.tensor(float(counts.shape[0]), device=mask.device)
        loss = (nll / seq_tokens.to(nll.dtype)).sum() / n_seqs
    stats = {"nll_sum": nll.detach().sum(), "nll_tokens": mask.sum().detach()}
    return loss, stats


def make_sft_loss_fn(
    aggregation: str = "token_mean",
) -> Callable[[Any, Any, dict[str, Any]], tuple[Any, dict[str, Any]]]:
    """``loss_fn(logprobs, entropy, data)`` for ``TrainEngine.train_batch``."""
    if aggregation not in AGGREGATIONS:
        raise ConfigError(f"loss_aggregation={aggregation!r} is not valid; use one of {', '.join(AGGREGATIONS)}")

    def loss_fn(logprobs: Any, entropy: Any, data: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        return sft_loss(logprobs, data, aggregation)

    return loss_fn
