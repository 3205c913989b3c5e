"""What the fsdp parallel-layout parity files share (``test_fsdp_tp``,
``test_fsdp_pp``, ``test_fsdp_ep``): the settings of the 4 steps, their
batches, the loss, the stats compared, the multiple of the noise floor, and
the negative control (a reference trained at 1.05x the learning rate must
fail the weight check). The noise floors themselves are measured by the
kernel's ``areal_kernel.testing.rank_engines.train_beside_references``."""

from __future__ import annotations

from typing import Any

import pytest

from areal_kernel.algo.losses import make_ppo_loss_fn
from areal_kernel.api.io import TrajectoryBatch
from areal_kernel.testing.noise import NoiseFloor, assert_within_noise
from areal_kernel.testing.rank_engines import ppo_step_inputs, random_batch

# Several micro-batches per replica, clipping active (grad norms > 1), a
# decaying schedule; the floor's reference splits its micro-batches otherwise.
CFG = {"lr": 1e-3, "max_tokens_per_mb": 20, "max_grad_norm": 1.0, "lr_scheduler": "linear",
       "warmup_steps_proportion": 0.2, "weight_decay": 0.01}  # fmt: skip
NOISE_CFG = {**CFG, "max_tokens_per_mb": 13}
STEP_BATCHES = [
    [7, 9, 5, 12, 6, 8],
    [11, 14, 9, 9, 15, 6, 7, 8],  # groups share prompts
    [9],  # fewer sequences than replicas / one row: filler micro-batches beside it
    [13, 6, 8, 10],
]
LOSS = make_ppo_loss_fn(eps_clip=0.2, behav_imp_weight_cap=5.0)
STAT_KEYS = ("loss", "grad_norm", "lr", "entropy", "pg_loss", "clip_frac", "behav_imp_weight_max", "n_loss_tokens")
# A parallel layout sums the same numbers in another order than one process:
# rounding like a micro-batch split. test_fsdp_parity's multiple; a wrong
# split or a norm that counts a weight twice lands far beyond it.
MULTIPLE = 4.0


def step_batch(seed: int, lengths: list[int]) -> TrajectoryBatch:
    """Step ``seed``'s batch (step 1 shares prompts within its groups)."""
    return random_batch(lengths, seed=seed, prompt_len=5 if seed == 1 else 3, shared_prompts=seed == 1)


def step_batches() -> list[TrajectoryBatch]:
    return [step_batch(seed, lengths) for seed, lengths in enumerate(STEP_BATCHES)]


def assert_weight_check_fails_at_other_lr(
    engine: Any, model_dir: str, floor: NoiseFloor, lr_factor: float = 1.05
) -> None:
    """Negative control: the torch engine trained on the same batches at
    ``lr_factor`` x the learning rate lands farther than ``MULTIPLE`` x the
    weights' floor from ``engine`` (so the weight check can fail)."""
    from areal_kernel.engine.torch_engine import TorchTrainEngine

    other = TorchTrainEngine({**CFG, "lr": CFG["lr"] * lr_factor})
    other.initialize(model_dir, 10)
    for batch in step_batches():
        other.train_batch(batch, LOSS, ppo_step_inputs(batch, other))
    with pytest.raises(AssertionError, match="weights"):
        assert_within_noise(engine.full_weights(), dict(other.named_weights_for_transfer()), floor, MULTIPLE)
