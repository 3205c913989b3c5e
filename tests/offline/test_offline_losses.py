"""SFT, DPO/IPO and Bradley-Terry losses against hand-computed values, and the
two-pass surrogate's gradient against the pair loss's own."""
import math

import pytest
import torch

from areal_kernel.algo.dpo_losses import (
    dpo_pair_losses,
    pair_loss_and_grads,
    pair_stats,
    sequence_linear_loss,
)
from areal_kernel.algo.rm_losses import bradley_terry_losses, rm_stats
from areal_kernel.algo.sft_losses import make_sft_loss_fn, sft_loss
from areal_kernel.errors import ConfigError, DataError


def softplus(x):
    return math.log1p(math.exp(x))


# Two sequences packed in one row: seq 0 has 4 tokens (2 loss tokens), seq 1
# has 3 tokens (1 loss token).
LP = [0.0, -9.0, -1.0, -2.0, 0.0, -5.0, -0.5]
MASK = [0, 0, 1, 1, 0, 0, 1]
SEQ = [0, 0, 0, 0, 1, 1, 1]


def _data(idx, batch_tokens=3.0, n_seqs=2.0):
    seq_tokens = {0: 2.0, 1: 1.0}
    return {
        "loss_mask": torch.tensor([float(MASK[i]) for i in idx]),
        "seq_ids": torch.tensor([SEQ[i] for i in idx]),
        "seq_loss_tokens": torch.tensor([seq_tokens[SEQ[i]] for i in idx]),
        "batch_loss_tokens": torch.tensor(batch_tokens),
        "batch_n_seqs": torch.tensor(n_seqs),
    }


def test_sft_token_mean_and_seq_mean_by_hand():
    lp = torch.tensor(LP)
    loss, stats = sft_loss(lp, _data(range(7)), "token_mean")
    assert float(loss) == pytest.approx((1.0 + 2.0 + 0.5) / 3)  # prompt tokens (-9, -5) ignored
    assert float(stats["nll_sum"]) == pytest.approx(3.5) and float(stats["nll_tokens"]) == 3
    loss, _ = sft_loss(lp, _data(range(7)), "seq_mean")
    assert float(loss) == pytest.approx(((1.0 + 2.0) / 2 + 0.5 / 1) / 2)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
def test_sft_micro_batch_shares_sum_to_the_batch_loss(agg):
    """Split as the engine would (seq 0 in one micro-batch, seq 1 in another):
    the shares and their gradients add up to the one-piece loss's."""
    fn = make_sft_loss_fn(agg)
    lp_full = torch.tensor(LP, requires_grad=True)
    full, _ = fn(lp_full, None, _data(range(7)))
    full.backward()
    lp_a = torch.tensor(LP[:4], requires_grad=True)
    lp_b = torch.tensor(LP[4:], requires_grad=True)
    a, _ = fn(lp_a, None, _data(range(4)))
    b, _ = fn(lp_b, None, _data(range(4, 7)))
    (a + b).backward()
    assert float((a + b).detach()) == pytest.approx(float(full.detach()))
    assert torch.allclose(torch.cat([lp_a.grad, lp_b.grad]), lp_full.grad)
    # Token mean: each loss token's gradient is -1/3; seq mean: -1/(2*len).
    want = [-1 / 3] * 3 if agg == "token_mean" else [-1 / 4, -1 / 4, -1 / 2]
    got = [float(g) for g, m in zip(lp_full.grad, MASK) if m]
    assert got == pytest.approx(want)


def test_sft_without_engine_scalars_uses_local_counts():
    lp = torch.tensor(LP)
    data = {"loss_mask": torch.tensor([float(m) for m in MASK]), "seq_ids": torch.tensor(SEQ)}
    assert float(sft_loss(lp, data, "token_mean")[0]) == pytest.approx(3.5 / 3)
    assert float(sft_loss(lp, data, "seq_mean")[0]) == pytest.approx(1.0)


def test_sft_rejects_unknown_aggregation():
    with pytest.raises(ConfigError, match="token_mean, seq_mean"):
        make_sft_loss_fn("sum")


def T(*x):
    return torch.tensor(x, dtype=torch.float64)


def test_dpo_loss_rewards_and_accuracy_by_hand():
    # pair 0: h = (-1 - -1.5) - (-2 - -1.5) = 1.0; pair 1: h = (-3 - -2) - (-1 - -1) = -1.0
    chosen, rejected, ref_c, ref_r = T(-1.0, -3.0), T(-2.0, -1.0), T(-1.5, -2.0), T(-1.5, -1.0)
    losses, cr, rr = dpo_pair_losses(chosen, rejected, ref_c, ref_r, beta=0.5)
    assert losses.tolist() == pytest.approx([softplus(-0.5), softplus(0.5)])
    assert cr.tolist() == pytest.approx([0.25, -0.5]) and rr.tolist() == pytest.approx([-0.25, 0.0])
    s = pair_stats(losses, cr, rr)
    assert s["rewards/accuracy"] == 0.5
    assert s["rewards/margin"] == pytest.approx((0.5 + -0.5) / 2)
    assert s["loss"] == pytest.approx((softplus(-0.5) + softplus(0.5)) / 2)
    # Conservative DPO: a mix of both directions.
    ls, _, _ = dpo_pair_losses(chosen, rejected, ref_c, ref_r, beta=0.5, label_smoothing=0.1)
    assert ls[0].item() == pytest.approx(0.9 * softplus(-0.5) + 0.1 * softplus(0.5))


def test_ipo_loss_by_hand():
    chosen, rejected, ref_c, ref_r = T(-1.0, -3.0), T(-2.0, -1.0), T(-1.5, -2.0), T(-1.5, -1.0)
    losses, _, _ = dpo_pair_losses(chosen, rejected, ref_c, ref_r, beta=0.5, loss_type="ipo")
    # target margin 1 / (2 * 0.5) = 1
    assert losses.tolist() == pytest.approx([0.0, 4.0])
    losses, _, _ = dpo_pair_losses(chosen, rejected, ref_c, ref_r, beta=0.25, loss_type="ipo")
    assert losses.tolist() == pytest.approx([1.0, 9.0])


def test_pair_losses_reject_bad_options():
    x = T(0.0)
    with pytest.raises(ConfigError, match="dpo, ipo"):
        dpo_pair_losses(x, x, x, x, beta=0.1, loss_type="kto")
    with pytest.raises(ConfigError, match="beta"):
        dpo_pair_losses(x, x, x, x, beta=0.0)
    with pytest.raises(ConfigError, match="label_smoothing"):
        dpo_pair_losses(x, x, x, x, beta=0.1, label_smoothing=0.5)


def test_bradley_terry_by_hand():
    c, r = T(2.0, 0.0), T(1.0, 1.0)
    assert bradley_terry_losses(c, r).tolist() == pytest.approx([softplus(-1.0), softplus(1.0)])
    centred = bradley_terry_losses(c, r, center_coef=0.1)
    assert centred.tolist() == pytest.approx([softplus(-1.0) + 0.1 * 9.0, softplus(1.0) + 0.1 * 1.0])
    s = rm_stats(c, r)
    assert s["rewards/accuracy"] == 0.5 and s["rewards/margin"] == pytest.approx(0.0)


def test_pair_gradients_match_the_closed_form():
    """dL/dc = -beta * sigmoid(-beta h) / P for DPO; dL/dr is its negative."""
    beta, ref_c, ref_r = 0.5, T(-1.5, -2.0), T(-1.5, -1.0)
    loss, gc, gr = pair_loss_and_grads(
        lambda c, r: dpo_pair_losses(c, r, ref_c, ref_r, beta=beta)[0], [-1.0, -3.0], [-2.0, -1.0]
    )
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert gc == pytest.approx([-beta * sig(-beta * 1.0) / 2, -beta * sig(beta * 1.0) / 2])
    assert gr == pytest.approx([-g for g in gc])
    assert loss == pytest.approx((softplus(-0.5) + softplus(0.5)) / 2)
    # Bradley-Terry with centring: d/dc = -sigmoid(-(c-r))/P + 2 k (c+r)/P
    _, gc, gr = pair_loss_and_grads(lambda c, r: bradley_terry_losses(c, r, center_coef=0.1), [2.0], [1.0])
    assert gc[0] == pytest.approx(-sig(-1.0) + 0.2 * 3.0)
    assert gr[0] == pytest.approx(sig(-1.0) + 0.2 * 3.0)
    with pytest.raises(DataError, match="as many chosen as rejected"):
        pair_loss_and_grads(lambda c, r: c - r, [1.0], [])


def test_sequence_linear_loss_is_coef_times_value_on_loss_tokens():
    values = torch.tensor([5.0, 1.0, 2.0, 7.0], requires_grad=True)
    data = {"loss_mask": torch.tensor([0.0, 1.0, 1.0, 0.0]), "seq_coef": torch.tensor([9.0, 0.5, 0.5, -3.0])}
    loss, _ = sequence_linear_loss(values, data)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(0.5 * 1.0 + 0.5 * 2.0)
    assert values.grad.tolist() == [0.0, 0.5, 0.5, 0.0]
    with pytest.raises(DataError, match="seq_coef"):
        sequence_linear_loss(values, {"loss_mask": data["loss_mask"]})
