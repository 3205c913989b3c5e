"""Learning-rate schedule as a pure function of the step (no torch).

Keeping it a function (instead of a torch ``LRScheduler`` object holding a
lambda) makes checkpoints trivial: the step counter is the whole state.
"""

from __future__ import annotations

import math
from typing import Any

from areal_kernel.errors import ConfigError


def warmup_steps(total_train_steps: int, warmup_steps_proportion: float) -> int:
    return int(warmup_steps_proportion * total_train_steps)


def lr_factor(
    step: int,
    total_train_steps: int,
    *,
    scheduler: str = "constant",
    warmup_steps_proportion: float = 0.0,
    min_lr_ratio: float = 0.0,
) -> float:
    """Multiplier of the peak lr for optimizer step ``step`` (0-based).

    Warm-up: steps ``0..W-1`` use ``(step + 1) / W`` so the first step already
    learns and step ``W-1`` reaches the peak. Decay: the progress
    ``p = (step - W) / (T - W)`` goes from 0 at step ``W`` towards 1 and the
    factor goes 1 -> ``min_lr_ratio`` (linear, or half-cosine); ``min_lr_ratio``
    is reached at step ``T`` (one past the last), so the last step never has a
    wasted zero lr. Steps past the end keep the final value.
    """
    if scheduler not in ("constant", "linear", "cosine"):
        raise ConfigError(f"lr_scheduler={scheduler!r} is not valid; use constant, linear or cosine")
    w = warmup_steps(total_train_steps, warmup_steps_proportion)
    if step < w:
        return (step + 1) / w
    if scheduler == "constant":
        return 1.0
    progress = min(1.0, (step - w) / max(1, total_train_steps - w))
    if scheduler == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def scheduled_lr(config: Any, step: int, total_train_steps: int) -> float:
    """The lr of optimizer step ``step`` for an engine settings section with
    the ``TorchEngineConfig`` schedule fields (``lr``, ``lr_scheduler``,
    ``warmup_steps_proportion``, ``min_lr_ratio``). Shared by every engine
    that follows that schedule, so their lr agree step by step."""
    return config.lr * lr_factor(
        step,
        total_train_steps,
        scheduler=config.lr_scheduler,
        warmup_steps_proportion=config.warmup_steps_proportion,
        min_lr_ratio=config.min_lr_ratio,
    )
