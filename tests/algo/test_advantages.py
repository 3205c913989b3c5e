"""Reward normalisation / GRPO advantages vs hand-computed values."""
from __future__ import annotations

import math

import pytest

from areal_kernel.algo.advantages import (
    batch_advantages,
    broadcast_to_tokens,
    grpo_advantages,
    normalize_rewards,
)
from areal_kernel.errors import ConfigError, DataError


def test_group_mean_std_with_interleaved_groups():
    # Group a = {1.0, 0.0}: mean 0.5, population std 0.5. Group b = {3.0, 3.0}: all equal.
    adv = grpo_advantages([1.0, 3.0, 0.0, 3.0], ["a", "b", "a", "b"])
    assert adv == pytest.approx([0.5 / 0.500001, 0.0, -0.5 / 0.500001, 0.0], abs=1e-9)


def test_all_equal_and_singleton_groups_give_zero_not_nan():
    adv = grpo_advantages([2.0, 2.0, 2.0, 5.0], ["g", "g", "g", "solo"])
    assert adv == [0.0, 0.0, 0.0, 0.0]
    assert not any(math.isnan(a) for a in adv)


def test_mean_only_and_three_member_group():
    # {0, 1, 5}: mean 2, centred -2, -1, 3; population std sqrt(14/3) = 2.160247.
    assert grpo_advantages([0.0, 1.0, 5.0], ["x"] * 3, std_normalize=False) == pytest.approx([-2.0, -1.0, 3.0])
    adv = grpo_advantages([0.0, 1.0, 5.0], ["x"] * 3, eps=0.0)
    assert adv == pytest.approx([-0.9258201, -0.4629100, 1.3887301], abs=1e-6)


def test_batch_level_normalisation():
    # mean 0.75, population std sqrt(3/16) = 0.4330127
    adv = normalize_rewards([1.0, 0.0, 1.0, 1.0], ["a", "a", "b", "b"], "batch")
    assert adv == pytest.approx([0.5773489, -1.7320468, 0.5773489, 0.5773489], abs=1e-6)
    assert batch_advantages([]) == []
    assert normalize_rewards([1.0, 0.0], ["a", "a"], "none") == [1.0, 0.0]


def test_broadcast_to_loss_tokens():
    assert broadcast_to_tokens([0.5, -1.0], [[0, 1, 1], [0, 0, 1, 0]]) == [[0.0, 0.5, 0.5], [0.0, 0.0, -1.0, 0.0]]


def test_bad_input_errors():
    with pytest.raises(DataError, match="group_ids"):
        grpo_advantages([1.0, 2.0], ["a"])
    with pytest.raises(DataError, match="reward 1"):
        grpo_advantages([1.0, float("nan")], ["a", "a"])
    with pytest.raises(ConfigError, match="reward_norm"):
        normalize_rewards([1.0], ["a"], "rank")
