"""The learning-trend statistic shared by the end-to-end tests."""
import math

import pytest

from areal_kernel.testing.trends import sampling_reward_trend


def test_first_step_against_the_mean_of_steps_three_on_skipping_empty_steps():
    rows = [{"rollout/reward_mean": x} for x in (0.4, None, 0.7, float("nan"), 0.9)]
    first, later, rewards = sampling_reward_trend(rows)
    assert first == 0.4 and later == pytest.approx(0.8)
    assert math.isnan(rewards[1]) and math.isnan(rewards[3])


def test_too_little_data_is_an_error_not_a_pass():
    with pytest.raises(ValueError):
        sampling_reward_trend([{"rollout/reward_mean": 0.1}, {"rollout/reward_mean": 0.9}])
    with pytest.raises(ValueError):
        sampling_reward_trend([{"rollout/reward_mean": x} for x in (0.1, 0.5, None, 0.9)])
