"""The train/inference mismatch numbers (areal_kernel.monitor.mismatch) on
hand-built micro-batches whose answers are known, and the alarm's streak
rules. Runs through ``areal train`` (a clean run and one whose servers sample
at another temperature) are in tests/faults/test_run_faults.py."""

from __future__ import annotations

import math

import pytest
import torch

from areal_kernel.engine.microbatch import merge_stats
from areal_kernel.monitor.mismatch import MismatchAlarm, MismatchMonitor, finish, measure, measured_loss


def _data(old: list[float], mask: list[int], versions: list[int]) -> dict:
    return {
        "old_logprobs": torch.tensor(old, dtype=torch.float32),
        "loss_mask": torch.tensor(mask, dtype=torch.float32),
        "versions": torch.tensor(versions, dtype=torch.long),
    }


def test_known_differences_give_known_metrics():
    # Four loss tokens: two fresh (version 3), one stale (2), one prompt token (0 mask).
    trainer = torch.tensor([-1.0, -2.0, -0.5, -3.0, -9.0])
    data = _data([-1.0, -1.0, -0.5, -2.0, 0.0], [0, 1, 1, 1, 1], [-1, 3, 3, 2, 3])
    out = finish(measure(trainer, data, version=3, token_threshold=0.5))
    d = [-1.0, 0.0, -1.0, -9.0]  # trainer - server on the loss tokens
    assert out["tokens"] == 4 and out["fresh_tokens"] == 3
    assert out["abs_mean"] == pytest.approx(sum(abs(x) for x in d) / 4)
    assert out["abs_max"] == pytest.approx(9.0)
    assert out["k3"] == pytest.approx(sum(math.expm1(x) - x for x in d) / 4)
    assert out["frac_over"] == pytest.approx(3 / 4)
    fresh = [-1.0, 0.0, -9.0]
    assert out["fresh_k3"] == pytest.approx(sum(math.expm1(x) - x for x in fresh) / 3)
    assert out["fresh_abs_max"] == pytest.approx(9.0)


def test_equal_logprobs_give_zero_and_the_prompt_is_left_out():
    lp = torch.tensor([-5.0, -0.25, -1.5])
    out = finish(measure(lp, _data([0.0, -0.25, -1.5], [0, 1, 1], [-1, 0, 0]), 0, 0.5))
    assert out["tokens"] == 2 and out["k3"] == 0.0 and out["abs_max"] == 0.0 and out["frac_over"] == 0.0


def test_tiny_differences_keep_a_positive_k3():
    # k3 = exp(d) - 1 - d ~ d^2/2: computed in float32 it cancels to 0 (or below).
    lp = torch.tensor([-1.0 + 1e-4] * 8)
    out = finish(measure(lp, _data([-1.0] * 8, [1] * 8, [0] * 8), 0, 0.5))
    assert out["k3"] > 0 and out["k3"] == pytest.approx(0.5 * (1e-4) ** 2, rel=0.05)


def test_sums_over_micro_batches_equal_one_pass():
    lp = torch.tensor([-1.0, -2.0, -0.1, -0.7, -3.0, -0.2])
    data = _data([-1.2, -1.0, -0.1, -0.2, -2.0, -0.9], [1, 1, 0, 1, 1, 1], [0, 0, -1, 1, 1, 0])
    whole = finish(measure(lp, data, 1, 0.6))
    acc: dict = {}
    for part in (slice(0, 3), slice(3, 6)):
        merge_stats(acc, measure(lp[part], {k: v[part] for k, v in data.items()}, 1, 0.6))
    assert finish(acc) == pytest.approx(whole)


def test_no_fresh_token_reports_a_count_not_a_mean():
    lp = torch.tensor([-1.0, -2.0])
    out = finish(measure(lp, _data([-1.5, -2.0], [1, 1], [4, 4]), 5, 0.5))
    assert out["fresh_tokens"] == 0 and "fresh_k3" not in out and out["tokens"] == 2
    assert finish({"loss": 1.0}) == {}  # not measured: nothing to report


def test_the_wrapped_loss_keeps_its_own_stats_and_gradient():
    def loss_fn(logprobs, entropy, data):
        return -(logprobs * data["loss_mask"]).sum(), {"loss_part": 1.0}

    loss_fn.needs_entropy_grad = True
    fn = measured_loss(loss_fn, 0, 0.5)
    assert fn.needs_entropy_grad is True
    lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    loss, stats = fn(lp, None, _data([-1.0, -1.0], [1, 1], [0, 0]))
    loss.backward()
    assert stats["loss_part"] == 1.0 and "mm_k3_sum" in stats
    assert lp.grad.tolist() == [-1.0, -1.0]


def _step(k3: float, tokens: float = 32.0) -> dict:
    # Only the fresh numbers count; the all-token ones (policy change included) must not.
    return {"tokens": 64.0, "k3": 9.0, "fresh_tokens": tokens, "fresh_k3": k3, "fresh_abs_mean": 0.1,
            "fresh_abs_max": 0.5}  # fmt: skip


def test_warn_fires_once_per_streak_at_patience():
    said: list[str] = []
    mon = MismatchMonitor(bound=0.01, patience=2, action="warn", warn=said.append)
    seen = [mon.observe(i, _step(k3)) for i, k3 in enumerate([0.5, 0.5, 0.5, 0.001, 0.5, 0.5], start=1)]
    assert [s["mismatch_alarm"] for s in seen] == [0, 1, 0, 0, 0, 1]
    assert [s["mismatch_streak"] for s in seen] == [1, 2, 3, 0, 1, 2]
    assert len(said) == 2 and "at step 2" in said[0] and "at step 6" in said[1]
    assert "monitor.mismatch.bound=0.01" in said[0]
    mon.raise_if_alarmed()  # warn never raises


def test_error_raises_after_the_step_is_observed_and_nan_counts():
    mon = MismatchMonitor(bound=0.01, patience=2, action="error", warn=lambda m: pytest.fail(m))
    mon.observe(1, _step(float("nan")))
    mon.raise_if_alarmed()
    assert mon.observe(2, _step(0.2))["mismatch_alarm"] == 1.0
    with pytest.raises(MismatchAlarm, match=r"mismatch/fresh_k3=0.2 above monitor.mismatch.bound=0.01 for 2"):
        mon.raise_if_alarmed()


def test_steps_without_tokens_and_off_leave_no_trace():
    mon = MismatchMonitor(bound=0.01, patience=2, action="warn", warn=lambda m: None)
    mon.observe(1, _step(0.5))
    assert mon.observe(2, {"tokens": 32.0, "k3": 5.0, "fresh_tokens": 0.0}) == {}
    assert mon.observe(3, _step(0.5))["mismatch_alarm"] == 1.0  # the streak went on across step 2
    off = MismatchMonitor(bound=0.01, patience=1, action="off")
    assert off.observe(1, _step(9.0)) == {} and off.alarms == 0


def test_config_section_names_bad_values():
    from areal_kernel.config.models import ExperimentConfig

    assert (
        ExperimentConfig.model_validate({"monitor": {"mismatch": {"action": False}}}).monitor.mismatch.action == "off"
    )
    with pytest.raises(Exception, match="bound"):
        ExperimentConfig.model_validate({"monitor": {"mismatch": {"bound": 0}}})
    with pytest.raises(Exception, match="action"):
        ExperimentConfig.model_validate({"monitor": {"mismatch": {"action": "stop"}}})
