"""Deterministic train/eval split of records."""

from __future__ import annotations

import random
from typing import Sequence, TypeVar

from areal_kernel.errors import ConfigError

T = TypeVar("T")


def train_eval_split(records: Sequence[T], eval_fraction: float, seed: int = 0) -> tuple[list[T], list[T]]:
    """Split ``records`` into ``(train, eval)``; the same seed gives the same split.

    ``round(len * eval_fraction)`` records (at least one when the fraction is
    positive) go to eval; both parts keep the input order so that ids and
    epochs stay readable.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ConfigError(f"eval_fraction must be in [0, 1), got {eval_fraction!r}")
    n = len(records)
    n_eval = 0 if eval_fraction == 0 else max(1, round(n * eval_fraction))
    if n_eval >= n and n_eval > 0:
        raise ConfigError(
            f"eval_fraction={eval_fraction} of {n} records leaves no training records; use a smaller fraction"
        )
    order = list(range(n))
    random.Random(seed).shuffle(order)
    eval_idx = set(order[:n_eval])
    train = [r for i, r in enumerate(records) if i not in eval_idx]
    evals = [r for i, r in enumerate(records) if i in eval_idx]
    return train, evals
