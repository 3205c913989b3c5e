"""Registered advantage estimators and reward shaping vs hand-computed values
(masks with gaps, ragged lengths, all-equal rewards, singleton groups)."""
from __future__ import annotations

import math

import pytest

from areal_kernel.algo import estimators as E
from areal_kernel.algo.advantages import (
    discounted_returns,
    gae_advantages,
    overlong_penalty,
    shape_rewards,
    whiten_tokens,
)
from areal_kernel.errors import ConfigError, DataError


def flat(rows):
    return [x for r in rows for x in r]


def test_dr_grpo_is_group_mean_only():
    masks = [[0, 1], [0, 1, 1], [0, 1], [0, 1]]
    adv = E.dr_grpo([1.0, 0.0, 0.0, 0.0], ["a"] * 4, loss_masks=masks)
    assert adv == pytest.approx([0.75, -0.25, -0.25, -0.25])
    # Ignores std_normalize: never divides by the std.
    assert E.dr_grpo([1.0, 0.0], ["a", "a"], loss_masks=masks[:2], std_normalize=True) == pytest.approx([0.5, -0.5])
    # batch level: mean over the whole batch
    assert E.dr_grpo([1.0, 0.0, 3.0], ["a", "a", "b"], loss_masks=masks[:3], norm="batch") == pytest.approx(
        [-1 / 3, -4 / 3, 5 / 3]
    )


def test_grpo_estimator_matches_group_and_batch_normalisation():
    masks = [[0, 1]] * 4
    adv = E.grpo([1.0, 0.0, 3.0, 3.0], ["a", "a", "b", "b"], loss_masks=masks, eps=0.0)
    assert adv == pytest.approx([1.0, -1.0, 0.0, 0.0])  # all-equal group b: 0, not NaN
    # batch: mean 1.75, std sqrt(((.75)^2 + (1.75)^2 + 2 * 1.25^2) / 4) = sqrt(1.6875)
    std = math.sqrt(1.6875)
    adv = E.grpo([1.0, 0.0, 3.0, 3.0], ["a", "a", "b", "b"], loss_masks=masks, norm="batch", eps=0.0)
    assert adv == pytest.approx([-0.75 / std, -1.75 / std, 1.25 / std, 1.25 / std])


def test_rloo_leave_one_out_and_singletons():
    masks = [[0, 1]] * 7
    adv = E.rloo([1.0, 0.0, 0.0, 0.0, 2.0, 4.0, 9.0], ["a"] * 4 + ["b", "b", "solo"], loss_masks=masks)
    assert adv == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3, -2.0, 2.0, 0.0])
    assert E.rloo([0.5, 0.5], ["g", "g"], loss_masks=masks[:2]) == [0.0, 0.0]
    # optional normalisation afterwards (batch): group b's [-2, 2] -> [-1, 1]
    assert E.rloo([2.0, 4.0], ["b", "b"], loss_masks=masks[:2], norm="batch", eps=0.0) == pytest.approx([-1.0, 1.0])


def test_reinforce_pp_returns_then_batch_token_whitening():
    masks = [[0, 1, 1], [0, 0, 1, 1, 1]]
    # seq 0: reward 1 on its last loss token; gamma 0.5 -> returns [.5, 1]; seq 1: all 0.
    raw = E.reinforce_pp([1.0, 0.0], ["a", "b"], loss_masks=masks, gamma=0.5, norm="none")
    assert raw == [[0.0, 0.5, 1.0], [0.0, 0.0, 0.0, 0.0, 0.0]]
    # token values [.5, 1, 0, 0, 0]: mean .3, population std .4
    adv = E.reinforce_pp([1.0, 0.0], ["a", "b"], loss_masks=masks, gamma=0.5, eps=0.0)
    assert adv[0] == pytest.approx([0.0, 0.5, 1.75])
    assert adv[1] == pytest.approx([0.0, 0.0, -0.75, -0.75, -0.75])
    # per-token rewards (KL penalty) are discounted with the final reward
    tr = [[0.0, -0.1, -0.2], [0.0] * 5]
    raw = E.reinforce_pp([1.0, 0.0], ["a", "b"], loss_masks=masks, token_rewards=tr, gamma=0.5, norm="none")
    assert raw[0] == pytest.approx([0.0, 0.3, 0.8])


def test_reinforce_pp_baseline_group_mean_then_batch_norm():
    masks = [[0, 1], [0, 1, 1]]
    # centred [.5, -.5]; gamma 1 -> tokens [.5 | -.5, -.5]; mean -1/6, std sqrt(2/9)
    adv = E.reinforce_pp_baseline([1.0, 0.0], ["g", "g"], loss_masks=masks, eps=0.0)
    s = math.sqrt(2 / 9)
    assert adv[0] == pytest.approx([0.0, (2 / 3) / s])
    assert adv[1] == pytest.approx([0.0, (-1 / 3) / s, (-1 / 3) / s])
    # all-equal rewards: zero advantages, no NaN
    adv = E.reinforce_pp_baseline([1.0, 1.0], ["g", "g"], loss_masks=masks)
    assert flat(adv) == [0.0] * 5


def test_gae_hand_values_and_gaps():
    # gamma .9, lambda .8, V = [.5, .6, .7] on loss tokens, reward 1 at the end:
    # t3: delta .3, A .3 | t2: delta .9*.7-.6 = .03, A .03+.72*.3 = .246 | t1: delta .04, A .04+.72*.246
    adv, ret = gae_advantages([[0, 0, 0, 1.0]], [[0, 0.5, 0.6, 0.7]], [[0, 1, 1, 1]], 0.9, 0.8)
    assert adv[0] == pytest.approx([0.0, 0.21712, 0.246, 0.3])
    assert ret[0] == pytest.approx([0.0, 0.71712, 0.846, 1.0])
    # A tool token (mask 0) in between is skipped: its value 9.0 never enters.
    adv, _ = gae_advantages([[0, 0, 0, 1.0]], [[0, 0.5, 9.0, 0.7]], [[0, 1, 0, 1]], 0.9, 0.8)
    assert adv[0] == pytest.approx([0.0, 0.13 + 0.72 * 0.3, 0.0, 0.3])
    # lambda = 1, gamma = 1: A_t = G_t - V_t
    adv, ret = gae_advantages([[0, 0, 2.0]], [[0, 0.5, 1.5]], [[0, 1, 1]], 1.0, 1.0)
    assert adv[0] == pytest.approx([0.0, 1.5, 0.5]) and ret[0] == pytest.approx([0.0, 2.0, 2.0])


def test_gae_estimator_whitens_and_needs_values():
    res = E.gae([1.0], ["a"], loss_masks=[[0, 1, 1, 1]], values=[[0, 0.5, 0.6, 0.7]], gamma=0.9, lam=0.8, norm="none")
    assert isinstance(res, E.AdvantageResult)
    assert res.advantages[0] == pytest.approx([0.0, 0.21712, 0.246, 0.3])
    res = E.gae([1.0], ["a"], loss_masks=[[0, 1, 1, 1]], values=[[0, 0.5, 0.6, 0.7]], gamma=0.9, lam=0.8, eps=0.0)
    toks = res.advantages[0][1:]
    assert sum(toks) == pytest.approx(0.0, abs=1e-9)
    assert math.sqrt(sum(t * t for t in toks) / 3) == pytest.approx(1.0)
    assert res.returns[0] == pytest.approx([0.0, 0.71712, 0.846, 1.0])  # before whitening
    # Declared at registration (what a third-party estimator can do), not as an attribute.
    from areal_kernel.plugins import get_registry

    reg = get_registry()
    assert "needs_values" in reg.get("advantage_estimator", "gae").capabilities
    assert "needs_values" not in reg.get("advantage_estimator", "grpo").capabilities
    with pytest.raises(DataError, match="critic"):
        E.gae([1.0], ["a"], loss_masks=[[0, 1]])


def test_discounted_returns_ragged():
    assert discounted_returns([[0, 1.0], [0, 0, 0, 2.0]], [[0, 1], [0, 1, 1, 1]], 0.5) == [
        [0.0, 1.0],
        [0.0, 0.5, 1.0, 2.0],
    ]


def test_whiten_group_level():
    rows = [[0, 1.0, 3.0], [0, 5.0], [0, 2.0]]
    out = whiten_tokens(rows, [[0, 1, 1], [0, 1], [0, 1]], "group", ["a", "a", "b"], std_normalize=False)
    assert out == [[0.0, -2.0, 0.0], [0.0, 2.0], [0.0, 0.0]]
    with pytest.raises(ConfigError, match="adv_norm"):
        whiten_tokens(rows, [[0, 1, 1], [0, 1], [0, 1]], "tokens")


def test_reward_shaping_scale_bias_clip():
    assert shape_rewards([1.0, -3.0, 0.5], scale=2.0, bias=0.5, clip=2.0) == [2.0, -2.0, 2.0]
    assert shape_rewards([1.0, 0.0], scale=0.5, bias=-1.0) == [0.0, -0.5]
    with pytest.raises(ConfigError, match="reward_clip"):
        shape_rewards([1.0], clip=0.0)
    with pytest.raises(DataError, match="reward 0"):
        shape_rewards([float("inf")])


def test_dapo_overlong_penalty():
    # L_max 10, buffer 4: free up to 6 tokens, linear to -1 at 10
    assert overlong_penalty([6, 7, 9, 10, 12], 10, 4) == pytest.approx([0.0, -0.25, -0.75, -1.0, -1.0])
    assert overlong_penalty([8], 10, 4, factor=0.5) == pytest.approx([-0.25])
    with pytest.raises(ConfigError, match="overlong_buffer_len"):
        overlong_penalty([1], 10, 11)


def test_to_token_rows_broadcasts_and_checks():
    rows, ret = E.to_token_rows([0.5, -1.0], [[0, 1, 1], [0, 0, 1, 0]])
    assert rows == [[0.0, 0.5, 0.5], [0.0, 0.0, -1.0, 0.0]] and ret is None
    rows, _ = E.to_token_rows([[9.0, 1.0], [9.0, 2.0]], [[0, 1], [0, 1]])
    assert rows == [[0.0, 1.0], [0.0, 2.0]]  # zeroed off loss tokens
    with pytest.raises(DataError, match="'mine'.*1 values for 2"):
        E.to_token_rows([0.5], [[0, 1], [0, 1]], "mine")
    with pytest.raises(DataError, match="row 0 has 3 values"):
        E.to_token_rows([[0.0, 1.0, 2.0]], [[0, 1]])
    with pytest.raises(DataError, match="non-finite"):
        E.to_token_rows([float("nan")], [[0, 1]])


def test_every_builtin_estimator_and_loss_is_registered(areal_env):
    from areal_kernel.plugins import get_registry

    areal_env()
    reg = get_registry()
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"):
        fn = reg.get("advantage_estimator", name, platform="").load()
        assert fn is getattr(E, name)
    from areal_kernel.algo.losses import ppo_actor_loss

    assert reg.get("loss", "ppo", platform="").load() is ppo_actor_loss
