"""Two policies in one ``areal train`` run (``policies:``, docs/multi-policy.md):
two LoRA adapters on one tiny random Llama with a byte-level tokenizer, served
by one embedded server, trained by one torch engine; one policy is rewarded
for lowercase letters, the other for digits (``char_share`` with other
``chars``). Each policy's sampling reward rises (``TINY_POLICY_RISE``: the
mean over its steps 13-16 minus its steps 1-4), and the same run with
``lr=0`` (the negative control, its own case) does not.

Also checked on the learning run: the policies alternate step for step
(equal weights), each policy's adapter version counts its own steps, every
update reached the server intact (``monitor.weights``), every trained sample
records its policy's adapter, and each policy's adapter is exported. And
on other runs: weights set the order of steps, per-policy batch size and
staleness bound hold, and a run killed with ``kill -9`` resumes every policy
exactly.

Numbers (``areal_kernel.testing.learning``, next to the check): measured
with these settings: seeds 1-4 with lr, seeds 1-6 with lr=0."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from areal_kernel.testing.recovery import EXACT_SERVER
from areal_kernel.testing.learning import (
    TINY_POLICY_CHARS,
    TINY_POLICY_LR,
    TINY_POLICY_MODEL,
    TINY_POLICY_RISE,
    TINY_POLICY_STEPS,
    frozen_overrides,
    policy_rows,
    tiny_policies_override,
)

from e2e_paths import EXAMPLE

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def policy_model(tmp_path_factory) -> str:
    from areal_kernel.testing.models import make_tiny_byte_chat_llama

    return make_tiny_byte_chat_llama(tmp_path_factory.mktemp("policy-model"), **TINY_POLICY_MODEL)


@pytest.mark.parametrize("arm", ["learning", "together", "frozen", "together-frozen"])
def test_two_policies_each_learn_their_own_reward(arm, run_areal, policy_model, tmp_path):
    """``together``: the learning arm with ``trainer.policy_order: together``
    (both policies at every step, their micro-batches sharing the base's
    forwards); it must clear the same bar, and its own ``lr=0`` twin
    (``together-frozen``, through the joint step too) must not."""
    run_dir = str(tmp_path / "run")
    is_frozen, is_together = arm.endswith("frozen"), arm.startswith("together")
    frozen = frozen_overrides("actor.torch.lr") if is_frozen else []
    order_arg = ["trainer.policy_order=together"] if is_together else []
    proc = run_areal(
        "train", EXAMPLE, f"model.path={policy_model}", f"run_dir={run_dir}", f"trainer.max_steps={TINY_POLICY_STEPS}",
        "trainer.eval_size=0", "logging.sinks=[jsonl]", f"actor.torch.lr={TINY_POLICY_LR}",
        "actor.torch.lr_scheduler=constant", tiny_policies_override(), *frozen, *order_arg, timeout=1200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    names = list(TINY_POLICY_CHARS)
    assert f"{len(names)} policies ({', '.join(names)})" in proc.stdout
    rows = {name: policy_rows(run_dir, name) for name in names}
    for name in names:
        print(f"\n{arm} {name}: {TINY_POLICY_RISE.describe(rows[name])}")
    for name in names:
        TINY_POLICY_RISE.assert_arm("frozen" if is_frozen else "learning", rows[name])
    # Each step trained both adapters in shared forwards (together), or one alone.
    assert {r.get("train/joint") for name in names for r in rows[name]} == {1.0 if is_together else None}
    if is_frozen:
        return
    # Equal weights: the policies take turns, each counting its own versions.
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    order = [
        next(n for n in names if f"policy/{n}/perf/step_s" in r) for r in lines if any("perf/step_s" in k for k in r)
    ]
    assert order == names * TINY_POLICY_STEPS, order
    for name in names:
        assert [r["version"] for r in rows[name]] == list(range(1, TINY_POLICY_STEPS + 1))
        assert all(r["monitor/weights_checked"] > 0 and r["monitor/weights_mismatch"] == 0 for r in rows[name])
        assert all(r["rollout/staleness_max"] <= 1 for r in rows[name])
        # Only the adapter travels (kilobytes, not the model).
        assert all(0 < r["weights/mb"] < 1 for r in rows[name])
        assert os.path.isfile(os.path.join(run_dir, "checkpoints", f"final-{name}", "adapter_model.safetensors"))
    # Every trained sample names its policy's adapter.
    with open(os.path.join(run_dir, "samples.jsonl")) as f:
        logged = [json.loads(line) for line in f if line.strip()]
    assert [{s["adapter"] for s in line["samples"]} for line in logged] == [{n} for n in order]


def test_weights_decide_the_order_and_each_policy_keeps_its_own_knobs(run_areal, policy_model, tmp_path):
    """Weights 2 and 1, 3 steps each: the policy with the fewest steps per
    unit of weight goes next, the first written on a tie (L D L L, then D
    alone once L is done); the second policy trains its own batch size under
    its own staleness bound (0). The first has ``kl_coef`` (its reference:
    the base with the adapters off): its KL to the base starts at about 0
    (measured: exactly 0; its adapter is still a no-op) and grows as it trains; the second
    has none and logs none. The second takes its advantages from a critic
    of its own (``gae``), trained at every one of its steps; the first has
    none."""
    run_dir = str(tmp_path / "run")
    policies = (
        "policies={letters: {weight: 2, reward: {type: char_share, char_share: {chars: abc}}, "
        "algorithm: {kl_coef: 0.1}}, digits: {weight: 1, batch_size: 2, max_staleness: 0, "
        "algorithm: {advantage: gae, critic_lr: 1.0e-3}}}"
    )
    proc = run_areal(
        "train", EXAMPLE, f"model.path={policy_model}", f"run_dir={run_dir}", "trainer.max_steps=3",
        "trainer.batch_size=4", "trainer.eval_size=0", "logging.sinks=[jsonl]", policies, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    order = [
        "L" if "policy/letters/step" in r else "D"
        for r in lines
        if "policy/letters/step" in r or "policy/digits/step" in r
    ]
    assert order == ["L", "D", "L", "L", "D", "D"], order
    letters, digits = policy_rows(run_dir, "letters"), policy_rows(run_dir, "digits")
    n = 8  # rollout.gconfig.n_samples of the example
    assert [r["batch/sequences"] for r in letters] == [4 * n] * 3
    assert [r["batch/sequences"] for r in digits] == [2 * n] * 3
    assert all(r["rollout/staleness_max"] == 0 for r in digits)
    kl = [r["train/kl"] for r in letters]
    print(f"\nletters: KL to the base per step {kl}")
    assert kl[-1] > kl[0] >= 0, kl
    assert not any("train/kl" in r for r in digits)
    critic = [r["train/critic_value_loss"] for r in digits]
    print(f"digits: its critic's value loss per step {critic}")
    assert all(r["train/critic_skipped"] == 0 and math.isfinite(r["train/critic_value_loss"]) for r in digits)
    assert any(v > 0 for v in critic), critic  # it fitted returns it did not yet predict
    assert not any("train/critic_value_loss" in r for r in letters)
    assert "digits: held-out" in proc.stdout and "letters: held-out" in proc.stdout


def test_policy_order_ready_lets_a_ready_policy_pass_a_slow_one(run_areal, policy_model, tmp_path):
    """``trainer.policy_order: ready``: policy ``slow``, written first, has a
    reward that waits 0.5 s per call (a test-only plugin: 8 calls, at least
    4 s, per batch) and ``fast`` the kernel's ``char_share``. By weight the
    order would be S F S F S F (``slow`` first on every tie); instead the
    first step is ``fast``'s, passing over ``slow``, and ``slow``'s first
    step comes after ``fast`` has taken more than one. Both still take all
    their steps, each on its own batches and versions."""
    from areal_kernel.testing.packages import pip_install_private

    site = pip_install_private(Path(__file__).parent / "plugin_packages" / "areal-test-rft-reward", tmp_path / "pkg")
    run_dir = str(tmp_path / "run")
    policies = "policies={slow: {reward: {type: slow_char_share}}, fast: {reward: {type: char_share}}}"
    proc = run_areal(
        "train", EXAMPLE, f"model.path={policy_model}", f"run_dir={run_dir}", "trainer.max_steps=3",
        "trainer.batch_size=2", "rollout.gconfig.n_samples=4", "rollout.gconfig.max_new_tokens=6",
        "trainer.eval_size=0", "logging.sinks=[jsonl]", "trainer.policy_order=ready", policies,
        env={"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)},
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    steps = [(n, r) for r in lines for n in ("slow", "fast") if f"policy/{n}/step" in r]
    order = "".join(n[0].upper() for n, _ in steps)
    print(f"\norder: {order}; passed over: {[r[f'policy/{n}/sched/passed_over'] for n, r in steps]}")
    assert sorted(order) == sorted("SSSFFF"), order
    assert order[0] == "F" and steps[0][1]["policy/fast/sched/passed_over"] == 1, order
    assert order.index("S") >= 2, order
    for name in ("slow", "fast"):
        rows = policy_rows(run_dir, name)
        assert [r["version"] for r in rows] == [1, 2, 3]
        assert all(r["rollout/staleness_max"] <= 1 and r["batch/sequences"] == 8 for r in rows)
        assert any(r["reward/mean"] > 0 for r in rows), rows  # the slow reward ran (a failed call scores 0)


# The recovered run's digits policy takes its advantages from a critic of its own.
CRITIC_POLICY = "algorithm: {advantage: gae, critic_lr: 1.0e-2}"


def _recovery_args(model: str, run_dir: str) -> list[str]:
    return [
        "train", EXAMPLE, f"model.path={model}", f"run_dir={run_dir}", "trainer.max_steps=4", "trainer.batch_size=2",
        "trainer.eval_size=0", "rollout.gconfig.n_samples=4", "rollout.gconfig.max_new_tokens=6",
        "rollout.max_staleness=0", "weight_update.mode=disk", "algorithm.dynamic_filter=false",
        f"actor.torch.lr={TINY_POLICY_LR}", "checkpoint.save_every=1", "checkpoint.keep_last=2",
        "logging.sinks=[jsonl]", tiny_policies_override(extra={"digits": CRITIC_POLICY}), *EXACT_SERVER,
        "actor.torch.lr_scheduler=constant",
    ]  # fmt: skip


@pytest.mark.parametrize("order", ["weight", "together"])
def test_a_killed_multi_policy_run_resumes_every_policy_exactly(order, policy_model, tmp_path):
    """``kill -9`` after global step 4 was trained but before its checkpoint,
    then the same command (``recover: auto``): every step trains the same
    sample ids with the same adapter as an uninterrupted run, and both
    adapters end where its did, bit for bit (``check_policies_resume``).
    The digits policy's advantages come from its critic (``gae``), which the
    checkpoints hold: a resume that started the critic over would give it
    other advantages and land the adapter elsewhere. ``together``: both
    policies at every step (global steps 1+2, 3+4...), so the newest
    checkpoint at the kill is step 2's."""
    from areal_kernel.testing.recovery import check_policies_resume

    extra = [f"trainer.policy_order={order}"]
    check_policies_resume(
        lambda run_dir: [*_recovery_args(policy_model, run_dir), *extra], str(tmp_path), list(TINY_POLICY_CHARS),
        checkpoint_step=2 if order == "together" else 3,
    )  # fmt: skip
    recover = tmp_path / "killed" / "recover"
    saved = sorted(d.name for d in recover.glob("step*/critics/*"))
    assert saved and set(saved) == {"digits"}, saved


def test_the_resume_check_fails_a_resume_that_lost_one_policys_optimizer_moments(policy_model, tmp_path):
    """The negative control of the test above: the newest checkpoint's AdamW
    moments of ``letters`` zeroed before the resume (its adapter, step count
    and everything of ``digits`` intact). The resume runs, and the check
    fails on ``letters``: the bit-for-bit comparison sees the lost state."""
    import torch
    from safetensors.torch import load_file, save_file

    from areal_kernel.testing.recovery import check_policies_resume

    def zero_letters_moments(run_dir: str) -> None:
        path = Path(run_dir, "recover", "step3", "engine", "adapters", "letters", "optimizer.safetensors")
        moments = load_file(str(path))
        assert moments and any(float(t.abs().max()) > 0 for t in moments.values())
        save_file({k: torch.zeros_like(t) for k, t in moments.items()}, str(path))

    assert list(TINY_POLICY_CHARS)[0] == "letters"  # checked first, so the failure names it
    args_for = lambda run_dir: _recovery_args(policy_model, run_dir)  # noqa: E731
    with pytest.raises(AssertionError, match=r"^\('letters', [0-9.e-]+, "):
        check_policies_resume(args_for, str(tmp_path), list(TINY_POLICY_CHARS), damage=zero_letters_moments)

