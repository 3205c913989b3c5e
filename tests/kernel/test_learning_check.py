"""``areal_kernel.testing.learning``: the statistic, the bar, both arms and
their messages, on hand-made per-step rows."""

import math

import pytest

from areal_kernel.testing.learning import LearningCheck, frozen_overrides


def rows(*values):
    return [{"rollout/reward_mean": v} for v in values]


LEVEL = LearningCheck("steps 3-6", late=(3, 6), bar=0.55)
GAIN = LearningCheck("steps 4-5 minus 1-2", late=(4, 5), early=(1, 2), bar=0.1)


def test_window_mean_and_gain_skip_steps_without_a_reward():
    assert LEVEL.statistic(rows(0.0, 0.0, 0.5, None, 0.7, math.nan)) == pytest.approx(0.6)
    assert GAIN.statistic(rows(0.2, 0.4, 9.0, 0.5, 0.7)) == pytest.approx(0.3)
    assert LEVEL.statistic(rows(0.0, 0.0, 0.6, 0.6, 0.6, 0.6, 0.0)) == pytest.approx(0.6)  # steps past the window


def test_learning_arm_passes_above_the_bar_and_fails_at_it_with_the_series():
    assert LEVEL.assert_arm("learning", rows(0.3, 0.3, 0.6, 0.6, 0.6, 0.6)) == pytest.approx(0.6)
    with pytest.raises(AssertionError) as e:
        LEVEL.assert_arm("learning", rows(0.3, 0.3, 0.55, 0.55, 0.55, 0.55))
    msg = str(e.value)
    assert "did not learn" in msg and "= 0.550" in msg and "bar 0.550" in msg and "0.300, 0.300, 0.550" in msg


def test_frozen_arm_must_fail_the_bar():
    assert LEVEL.assert_arm("frozen", rows(0.3, 0.3, 0.4, 0.4, 0.4, 0.4)) == pytest.approx(0.4)
    with pytest.raises(AssertionError, match=r"frozen policy \(lr=0\) passed.*= 0.700 \(bar 0.550"):
        LEVEL.assert_arm("frozen", rows(0.3, 0.3, 0.7, 0.7, 0.7, 0.7))
    with pytest.raises(ValueError, match="arm must be"):
        LEVEL.assert_arm("control", rows(0.3, 0.3, 0.7, 0.7, 0.7, 0.7))


def test_short_runs_empty_windows_and_bad_windows_are_errors():
    with pytest.raises(ValueError, match="needs 6 steps, the run has 5"):
        LEVEL.statistic(rows(0.1, 0.2, 0.3, 0.4, 0.5))
    with pytest.raises(ValueError, match="no rollout/reward_mean in steps 3-6"):
        LEVEL.statistic(rows(0.1, 0.2, None, None, math.nan, None))
    with pytest.raises(ValueError, match="late window"):
        LearningCheck("bad", late=(4, 3), bar=0.1)


def test_frozen_overrides_set_every_lr_to_zero():
    assert frozen_overrides("actor.torch.lr", "critic.torch.lr") == ["actor.torch.lr=0", "critic.torch.lr=0"]
    with pytest.raises(ValueError):
        frozen_overrides()
