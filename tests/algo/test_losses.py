"""Decoupled PPO loss vs hand-computed values on small tensors."""
from __future__ import annotations

import math

import pytest
import torch

from areal_kernel.algo.losses import kl_penalty, make_ppo_loss_fn, ppo_actor_loss
from areal_kernel.errors import ConfigError, DataError

# Token 0 is a prompt token with garbage values that must not leak (no NaN/inf).
MASK = [0.0, 1.0, 1.0, 1.0, 1.0]
ADV = [0.0, 1.0, -1.0, 1.0, 1.0]
PROX = [0.0, -1.0, -2.0, -0.5, -3.0]
RATIO = [1.0, 1.5, 0.5, 1.1, 0.5]  # current / proximal


def case(prox=True, behav_w=None, **extra):
    lp = torch.tensor([-50.0] + [math.log(r) + p for r, p in zip(RATIO[1:], PROX[1:])], requires_grad=True)
    w = behav_w or [1.0] * 5
    old = [100.0] + [p - math.log(x) for p, x in zip(PROX[1:], w[1:])]
    data = {
        "loss_mask": torch.tensor(MASK),
        "advantages": torch.tensor(ADV),
        "old_logprobs": torch.tensor(old),
    }
    if prox:
        data["prox_logprobs"] = torch.tensor(PROX)
    data.update(extra)
    return lp, data


def test_clipping_on_both_sides():
    lp, data = case()
    loss, stats = ppo_actor_loss(lp, data, eps_clip=0.2, eps_clip_high=0.28)
    # tok1 A=+1 r=1.5 -> clipped to 1.28: -1.28; tok2 A=-1 r=0.5 -> clipped to 0.8: +0.8;
    # tok3 A=+1 r=1.1 (inside): -1.1; tok4 A=+1 r=0.5 (pessimistic side, unclipped): -0.5.
    assert loss.item() == pytest.approx((-1.28 + 0.8 - 1.1 - 0.5) / 4, abs=1e-6)
    assert stats["clip_frac"].item() == pytest.approx(0.5)
    assert stats["clip_high_frac"].item() == pytest.approx(0.25)
    assert stats["clip_low_frac"].item() == pytest.approx(0.25)
    assert stats["importance_weight"].item() == pytest.approx(0.9, abs=1e-6)
    assert stats["approx_kl"].item() == pytest.approx(0.1213797683, abs=1e-6)
    assert stats["behav_imp_weight"].item() == pytest.approx(1.0, abs=1e-6)
    loss.backward()
    # d/dlp of -A*r is -A*r where unclipped, 0 where clipped or masked.
    assert lp.grad.tolist() == pytest.approx([0.0, 0.0, 0.0, -1.1 / 4, -0.5 / 4], abs=1e-6)


def test_symmetric_clip_by_default():
    lp, data = case()
    loss, _ = ppo_actor_loss(lp, data, eps_clip=0.2)
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 1.1 - 0.5) / 4, abs=1e-6)


def test_missing_prox_means_standard_ppo_against_behaviour():
    lp, data = case(prox=False)  # old == PROX here (behaviour weight 1)
    loss, stats = ppo_actor_loss(lp, data, eps_clip=0.2, eps_clip_high=0.28)
    assert loss.item() == pytest.approx(-2.08 / 4, abs=1e-6)
    assert stats["behav_imp_weight"].item() == pytest.approx(1.0)


def test_behaviour_weights_and_cap():
    w = [1.0, 2.0, 0.5, 4.0, 1.0]
    lp, data = case(behav_w=w)
    loss, stats = ppo_actor_loss(lp, data, eps_clip=0.2, eps_clip_high=0.28)
    assert loss.item() == pytest.approx((-1.28 * 2 + 0.8 * 0.5 - 1.1 * 4 - 0.5) / 4, abs=1e-5)
    lp, data = case(behav_w=w)
    loss, stats = ppo_actor_loss(lp, data, eps_clip=0.2, eps_clip_high=0.28, behav_imp_weight_cap=3.0)
    # tok3 (weight 4 > 3) is dropped but still counts in the normaliser.
    assert loss.item() == pytest.approx((-1.28 * 2 + 0.8 * 0.5 - 0.5) / 4, abs=1e-5)
    assert stats["behav_masked_frac"].item() == pytest.approx(0.25)
    assert stats["behav_imp_weight"].item() == pytest.approx((2 + 0.5 + 4 + 1) / 4, abs=1e-5)
    assert stats["behav_imp_weight_max"].item() == pytest.approx(4.0, abs=1e-5)
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([0.0, 0.0, 0.0, 0.0, -0.5 / 4], abs=1e-6)


def test_batch_normaliser_and_additivity_over_splits():
    lp, data = case()
    data["batch_loss_tokens"] = torch.tensor(8.0)
    loss, _ = ppo_actor_loss(lp, data, eps_clip=0.2, eps_clip_high=0.28)
    assert loss.item() == pytest.approx(-2.08 / 8, abs=1e-6)
    # Two micro-batches with the whole batch's normaliser sum to the whole.
    lp, data = case()
    whole, whole_stats = ppo_actor_loss(lp, data, eps_clip=0.2, eps_clip_high=0.28)
    parts, part_stats = [], []
    for sl in (slice(0, 2), slice(2, 5)):
        d = {k: v[sl] for k, v in data.items()}
        d["batch_loss_tokens"] = torch.tensor(4.0)
        lo, st = ppo_actor_loss(lp[sl], d, eps_clip=0.2, eps_clip_high=0.28)
        parts.append(lo.item())
        part_stats.append(st)
    assert sum(parts) == pytest.approx(whole.item(), abs=1e-6)
    for key in ("clip_frac", "importance_weight", "approx_kl"):
        assert sum(s[key].item() for s in part_stats) == pytest.approx(whole_stats[key].item(), abs=1e-6)


def test_kl_estimators_hand_values():
    lr = torch.tensor([0.5, -0.2, 0.1])
    assert kl_penalty(lr, "k1").mean().item() == pytest.approx(0.4 / 3)
    assert kl_penalty(lr, "k2").mean().item() == pytest.approx(0.05)
    assert kl_penalty(lr, "k3").mean().item() == pytest.approx(0.0442569453, abs=1e-7)
    lp = torch.tensor([-9.0, -1.0, -2.0, -3.0], requires_grad=True)
    data = {
        "loss_mask": torch.tensor([0.0, 1.0, 1.0, 1.0]),
        "advantages": torch.zeros(4),
        "old_logprobs": lp.detach().clone(),
        "ref_logprobs": torch.tensor([50.0, -1.5, -1.8, -3.1]),
    }
    loss, stats = ppo_actor_loss(lp, data, kl_coef=0.5, kl_estimator="k3")
    assert stats["kl"].item() == pytest.approx(0.0442569453, abs=1e-6)
    assert loss.item() == pytest.approx(0.5 * 0.0442569453, abs=1e-6)


def test_entropy_bonus():
    lp = torch.tensor([-9.0, -1.0, -2.0, -3.0], requires_grad=True)
    ent = torch.tensor([9.0, 1.0, 2.0, 3.0], requires_grad=True)
    data = {"loss_mask": torch.tensor([0.0, 1.0, 1.0, 1.0]), "advantages": torch.zeros(4), "old_logprobs": lp.detach()}
    loss, stats = ppo_actor_loss(lp, data, entropy_coef=0.1, entropy=ent)
    assert loss.item() == pytest.approx(-0.2)
    assert stats["entropy"].item() == pytest.approx(2.0)
    loss.backward()
    assert ent.grad.tolist() == pytest.approx([0.0, -0.1 / 3, -0.1 / 3, -0.1 / 3])
    fn = make_ppo_loss_fn(entropy_coef=0.1)
    assert fn.needs_entropy_grad and not make_ppo_loss_fn().needs_entropy_grad
    assert fn(lp, ent, data)[0].item() == pytest.approx(-0.2)


def test_errors_name_the_missing_piece():
    lp, data = case()
    del data["advantages"]
    with pytest.raises(DataError, match="advantages"):
        ppo_actor_loss(lp, data)
    lp, data = case()
    with pytest.raises(DataError, match="ref_logprobs"):
        ppo_actor_loss(lp, data, kl_coef=0.1)
    with pytest.raises(ConfigError, match="kl_estimator"):
        ppo_actor_loss(lp, data, kl_estimator="k4")
    with pytest.raises(ConfigError, match="entropy"):
        ppo_actor_loss(lp, data, entropy_coef=0.1)
