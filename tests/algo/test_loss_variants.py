"""Policy-loss options vs hand-computed values: dual clip, GSPO sequence
ratios, behaviour-weight clamp, version-interpolated proximal logprobs,
aggregation modes, KL in reward, and the clipped value loss."""
from __future__ import annotations

import math

import pytest
import torch

from areal_kernel.algo.losses import ppo_actor_loss, value_loss
from areal_kernel.errors import ConfigError


def _data(old, adv, mask, **extra):
    d = {"loss_mask": torch.tensor(mask), "advantages": torch.tensor(adv), "old_logprobs": torch.tensor(old)}
    d.update({k: torch.tensor(v) for k, v in extra.items()})
    return d


def test_dual_clip_bounds_negative_advantages():
    old = [-1.0, -1.0, -1.0]
    ratios = [3.0, 0.5, 3.0]
    lp = torch.tensor([o + math.log(r) for o, r in zip(old, ratios)], requires_grad=True)
    data = _data(old, [-1.0, -1.0, 1.0], [1.0, 1.0, 1.0])
    plain, _ = ppo_actor_loss(lp, data, eps_clip=0.2)
    # tok0 A=-1 r=3: max(3, 1.2) = 3; tok1: max(.5, .8) = .8; tok2 A=+1 r=3: max(-3, -1.2) = -1.2
    assert plain.item() == pytest.approx((3 + 0.8 - 1.2) / 3, abs=1e-6)
    loss, stats = ppo_actor_loss(lp, data, eps_clip=0.2, dual_clip=2.0)
    # dual clip caps tok0 at -A * 2 = 2 (its gradient vanishes); A > 0 tokens are untouched
    assert loss.item() == pytest.approx((2 + 0.8 - 1.2) / 3, abs=1e-6)
    assert stats["dual_clip_frac"].item() == pytest.approx(1 / 3)
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([0.0, 0.0, 0.0], abs=1e-7)
    with pytest.raises(ConfigError, match="dual_clip"):
        ppo_actor_loss(lp, data, dual_clip=1.0)


def test_gspo_sequence_level_ratio():
    # seq 0: loss tokens with log-ratios .3 and -.1 (mean .1); seq 1: one token with .5
    old = [0.0, -1.0, -1.0, 0.0, -2.0]
    lr = [0.0, 0.3, -0.1, 0.0, 0.5]
    lp = torch.tensor([o + x for o, x in zip(old, lr)], requires_grad=True)
    data = _data(old, [0.0, 1.0, 1.0, 0.0, -1.0], [0.0, 1.0, 1.0, 0.0, 1.0], seq_ids=[0, 0, 0, 1, 1])
    data["seq_ids"] = data["seq_ids"].long()
    loss, stats = ppo_actor_loss(lp, data, eps_clip=0.2, ratio_level="sequence")
    s0, s1 = math.exp(0.1), math.exp(0.5)
    # seq 0 ratio 1.105 (inside the clip); seq 1 A<0 with 1.65: pessimistic side, unclipped
    assert loss.item() == pytest.approx((-s0 * 2 + s1) / 3, abs=1e-6)
    assert stats["importance_weight"].item() == pytest.approx((2 * s0 + s1) / 3, abs=1e-6)
    loss.backward()
    # d ratio_t / d logprob_t = s_i for every token of sequence i
    assert lp.grad.tolist() == pytest.approx([0.0, -s0 / 3, -s0 / 3, 0.0, s1 / 3], abs=1e-6)
    # token level differs: tok1 (r = e^.3 > 1.2) would be clipped
    tok, _ = ppo_actor_loss(lp.detach(), data, eps_clip=0.2)
    assert tok.item() == pytest.approx((-1.2 - math.exp(-0.1) + s1) / 3, abs=1e-6)


def test_behaviour_weight_clamp_mode():
    # prox (given) vs old: weights [2, .5, 4, 1]; ratio current/prox [1.5, .5, 1.1, .5], A [1, -1, 1, 1]
    prox = [0.0, -1.0, -2.0, -0.5, -3.0]
    w = [1.0, 2.0, 0.5, 4.0, 1.0]
    ratio = [1.0, 1.5, 0.5, 1.1, 0.5]
    lp = torch.tensor([p + math.log(r) for p, r in zip(prox, ratio)])
    old = [p - math.log(x) for p, x in zip(prox, w)]
    data = _data(old, [0.0, 1.0, -1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0, 1.0], prox_logprobs=prox)
    loss, stats = ppo_actor_loss(lp, data, eps_clip=0.2, eps_clip_high=0.28, behav_imp_weight_cap=3.0,
                                 behav_imp_weight_mode="clamp")  # fmt: skip
    # tok3's weight 4 is clamped to 3 (kept), not dropped
    assert loss.item() == pytest.approx((-1.28 * 2 + 0.8 * 0.5 - 1.1 * 3 - 0.5) / 4, abs=1e-5)
    assert stats["behav_clamped_frac"].item() == pytest.approx(0.25)
    assert stats["behav_masked_frac"].item() == 0.0


def test_version_interpolated_proximal_logprobs():
    lp = torch.tensor([0.0, -1.0, -2.0], requires_grad=True)
    old = [0.0, -2.0, -2.5]
    # alpha .5: prox = -2 + .5 * (-1 - -2) = -1.5 -> ratio e^.5 (clipped to 1.2 for A>0);
    # alpha 1: prox = current -> ratio 1. Behaviour weights exp(prox - old) = e^.5 both.
    data = _data(old, [0.0, 1.0, 1.0], [0.0, 1.0, 1.0], prox_alpha=[0.0, 0.5, 1.0])
    loss, stats = ppo_actor_loss(lp, data, eps_clip=0.2)
    w = math.exp(0.5)
    assert loss.item() == pytest.approx((-1.2 * w - 1.0 * w) / 2, abs=1e-6)
    assert stats["behav_imp_weight"].item() == pytest.approx(w, abs=1e-6)
    loss.backward()
    # the interpolated prox is a constant: tok2's ratio exp(lp - sg(lp)) still has gradient 1 * w
    assert lp.grad.tolist() == pytest.approx([0.0, 0.0, -w / 2], abs=1e-6)


def test_aggregation_modes():
    # seq 0: 2 loss tokens with A 1, 3; seq 1: 3 loss tokens with A 1; ratio 1 -> token loss -A
    mask = [0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    adv = [0.0, 1.0, 3.0, 0.0, 1.0, 1.0, 1.0]
    old = [-1.0] * 7
    lp = torch.tensor(old, requires_grad=True)

    def run(agg, **scalars):
        d = _data(old, adv, mask, seq_ids=[0, 0, 0, 1, 1, 1, 1], **scalars)
        d["seq_ids"] = d["seq_ids"].long()
        return ppo_actor_loss(lp, d, loss_agg=agg)[0].item()

    assert run("token-mean") == pytest.approx(-7 / 5)
    assert run("seq-mean-token-mean") == pytest.approx(-(4 / 2 + 3 / 3) / 2)
    assert run("seq-mean-token-sum") == pytest.approx(-7 / 2)
    # engine-provided batch scalars take precedence (this micro-batch is half of a 4-sequence batch)
    st = [2.0, 2.0, 2.0, 3.0, 3.0, 3.0, 3.0]
    assert run("seq-mean-token-mean", batch_n_seqs=4.0, seq_loss_tokens=st) == pytest.approx(-3 / 4)
    assert run("seq-mean-token-sum", batch_n_seqs=4.0) == pytest.approx(-7 / 4)
    with pytest.raises(ConfigError, match="loss_agg"):
        run("sum")


def test_seq_aggregation_is_additive_over_micro_batches():
    mask = [0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    adv = [0.0, 1.0, -2.0, 0.0, 0.5, 1.0, 1.5]
    old = [-1.0, -1.2, -0.7, -1.0, -2.0, -0.3, -0.9]
    cur = [o + d for o, d in zip(old, [0.0, 0.1, -0.3, 0.0, 0.05, 0.2, -0.1])]
    seq_ids = [0, 0, 0, 1, 1, 1, 1]
    st = [2.0] * 3 + [3.0] * 4
    whole = _data(old, adv, mask, seq_ids=seq_ids, seq_loss_tokens=st, batch_n_seqs=2.0)
    whole["seq_ids"] = whole["seq_ids"].long()
    for agg in ("seq-mean-token-mean", "seq-mean-token-sum"):
        for level in ("token", "sequence"):
            full = ppo_actor_loss(torch.tensor(cur), whole, loss_agg=agg, ratio_level=level)[0].item()
            parts = 0.0
            for sl in (slice(0, 3), slice(3, 7)):
                d = {k: v[sl] if v.dim() else v for k, v in whole.items()}
                parts += ppo_actor_loss(torch.tensor(cur)[sl], d, loss_agg=agg, ratio_level=level)[0].item()
            assert parts == pytest.approx(full, abs=1e-6), (agg, level)


def test_kl_and_entropy_follow_aggregation():
    lp = torch.tensor([0.0, -1.0, -1.0, 0.0, -1.0])
    data = _data([0.0, -1.0, -1.0, 0.0, -1.0], [0.0] * 5, [0.0, 1.0, 1.0, 0.0, 1.0],
                 seq_ids=[0, 0, 0, 1, 1], ref_logprobs=[0.0, -1.5, -1.0, 0.0, -0.5])  # fmt: skip
    data["seq_ids"] = data["seq_ids"].long()
    # k2 per token (log-ratio .5, 0 | -.5): .125, 0 | .125; seq-mean-token-sum: sum / 2 sequences
    loss, stats = ppo_actor_loss(lp, data, kl_coef=1.0, kl_estimator="k2", loss_agg="seq-mean-token-sum")
    assert loss.item() == pytest.approx((0.125 + 0.125) / 2)
    assert stats["kl"].item() == pytest.approx(0.25 / 3)  # stats stay token means
    ent = torch.tensor([0.0, 1.0, 3.0, 0.0, 2.0])
    loss, _ = ppo_actor_loss(lp, data, entropy=ent, entropy_coef=0.1, loss_agg="seq-mean-token-mean")
    assert loss.item() == pytest.approx(-0.1 * (2.0 + 2.0) / 2)


def test_clipped_value_loss():
    values = torch.tensor([0.0, 1.5, 0.5], requires_grad=True)
    data = {
        "loss_mask": torch.tensor([0.0, 1.0, 1.0]),
        "returns": torch.tensor([0.0, 2.0, 0.0]),
        "old_values": torch.tensor([7.0, 1.0, 0.4]),
    }
    loss, stats = value_loss(values, data, value_eps_clip=0.2)
    # tok1: v - old = .5 -> clipped value 1.2: max(.25, .64) -> .32 (constant in v);
    # tok2: inside the clip: .5 * .25 = .125
    assert loss.item() == pytest.approx((0.32 + 0.125) / 2)
    assert stats["value_clip_frac"].item() == pytest.approx(0.5)
    loss.backward()
    assert values.grad.tolist() == pytest.approx([0.0, 0.0, 0.25])
    plain, _ = value_loss(values.detach(), data, value_eps_clip=None)
    assert plain.item() == pytest.approx((0.125 + 0.125) / 2)
    with pytest.raises(ConfigError, match="value_eps_clip"):
        value_loss(values, data, value_eps_clip=0.0)
