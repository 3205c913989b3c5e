"""Several policies stepped in one pass over the base (``engine.train_policies``,
``areal_kernel.engine.together``): micro-batches mix the policies'
sequences, each adapter updating its own tokens only. It must equal one
``policy(name).train_batch`` per policy (the path a trainer takes one policy
at a time) within float rounding, with and without shared prompts."""

from __future__ import annotations

import math
from typing import Any

import torch
from engine_helpers import VOCAB
from test_multi_adapter import LORA_A, LORA_B, multi_engine, opt_tensors, weights
from test_torch_engine import MULTIPLE, advantages_for, ppo_like_loss

from areal_kernel.engine.together import PolicyJob
from areal_kernel.testing.noise import assert_within_noise, max_difference, measure_noise_floor
from areal_kernel.testing.rank_engines import random_batch

# Policies with batches of different sizes and lengths, so that one runs out
# of micro-batches before the other; prompts shared in pairs (GRPO groups).
X_LENGTHS, Y_LENGTHS = [9, 12, 17, 5, 14, 12, 7, 30], [11, 8, 21, 6]
STEPS = 3


def _batches(seed: int) -> tuple:
    x = random_batch(X_LENGTHS, seed=seed, prompt_len=4, vocab=VOCAB, shared_prompts=True)
    y = random_batch(Y_LENGTHS, seed=seed + 100, prompt_len=4, vocab=VOCAB, shared_prompts=True)
    return x, y


def _jobs(x, y, loss=ppo_like_loss) -> dict[str, PolicyJob]:
    return {"A": PolicyJob(x, loss, advantages_for(x)), "b.v2": PolicyJob(y, loss, advantages_for(y))}


def _one_at_a_time(engine) -> list[dict]:
    stats = []
    for s in range(STEPS):
        x, y = _batches(s)
        stats.append(
            {
                "A": engine.policy("A").train_batch(x, ppo_like_loss, advantages_for(x)),
                "b.v2": engine.policy("b.v2").train_batch(y, ppo_like_loss, advantages_for(y)),
            }
        )
    return stats


def _state(engine) -> dict[str, torch.Tensor]:
    out = {}
    for name in ("A", "b.v2"):
        view = engine.policy(name)
        out.update({f"{name}/{k}": v for k, v in weights(view).items()})
        out.update({f"{name}/opt/{k}": v for k, v in opt_tensors(view).items()})
    return out


def _joint_against_one_at_a_time(joint, alone, split, what: str) -> tuple[list, list, list, Any]:
    """STEPS joint steps on ``joint`` (every one shared), one policy at a
    time on ``alone`` and ``split`` (another micro-batch split: the same
    numbers summed in another order, the floor); the adapters and AdamW
    moments of ``joint`` within MULTIPLE x that floor of ``alone``'s.
    Returns the three engines' per-step statistics and the floor."""
    got = [joint.train_policies(_jobs(*_batches(s))) for s in range(STEPS)]
    assert all(st["joint"] == 1.0 for step in got for st in step.values())
    want, floor_run = _one_at_a_time(alone), _one_at_a_time(split)
    floor = measure_noise_floor("adapters and moments after 3 steps, other split", _state(alone), _state(split))
    print(assert_within_noise(_state(joint), _state(alone), floor, MULTIPLE, what=what))
    return got, want, floor_run, floor


def test_joint_steps_equal_one_step_per_policy(tiny_model_dir):
    # max_tokens_per_mb 48: several micro-batches per policy, some sharing a prompt.
    joint, alone, split = (multi_engine(tiny_model_dir, max_tokens_per_mb=mb) for mb in (48, 48, 24))
    assert max_difference(_state(joint), _state(alone)).value == 0  # the same start
    base = {n: p.detach().clone() for n, p in joint.model.named_parameters() if ".lora_" not in n}

    got, want, floor_run, floor = _joint_against_one_at_a_time(joint, alone, split, "joint steps vs one at a time")
    assert [st["A"]["n_mbs"] for st in got] != [st["b.v2"]["n_mbs"] for st in got]  # uneven micro-batch counts
    # Prompts were shared: fewer model tokens than batch tokens, as alone.
    assert all(g[n]["n_model_tokens"] == w[n]["n_model_tokens"] < w[n]["n_tokens"] for g, w in zip(got, want) for n in g)
    for key in ("loss", "grad_norm", "entropy", "tok"):
        got_k = [[g[n][key] for n in ("A", "b.v2")] for g in got]
        want_k = [[w[n][key] for n in ("A", "b.v2")] for w in want]
        f = measure_noise_floor(key, want_k, [[w[n][key] for n in ("A", "b.v2")] for w in floor_run])
        assert_within_noise(got_k, want_k, f, MULTIPLE, what=f"joint {key}")
    for n in ("A", "b.v2"):
        assert [g[n]["lr"] for g in got] == [w[n]["lr"] for w in want]  # each its own schedule step
        assert joint.policy(n).step == alone.policy(n).step == STEPS
    after = {n: p.detach() for n, p in joint.model.named_parameters() if ".lora_" not in n}
    assert all(torch.equal(after[n], base[n]) for n in base)  # the base stays frozen

    # Negative control: the policies' batches swapped lands far outside.
    swapped = multi_engine(tiny_model_dir, max_tokens_per_mb=48)
    for s in range(STEPS):
        x, y = _batches(s)
        swapped.train_policies(_jobs(y, x))
    assert max_difference(_state(swapped), _state(alone)).value > MULTIPLE * floor.value


def test_a_policy_whose_loss_is_not_finite_skips_its_step_alone(tiny_model_dir):
    """``b.v2``'s loss is NaN: its adapter and moments stay as they were, and
    ``A`` trains as it does beside a finite ``b.v2`` (its loss is left out
    of the backward, so no NaN reaches ``A`` through the shared layers)."""
    ok, bad = multi_engine(tiny_model_dir, max_tokens_per_mb=48), multi_engine(tiny_model_dir, max_tokens_per_mb=48)
    before = _state(bad)

    def nan_loss(logprobs, entropy, data):
        loss, stats = ppo_like_loss(logprobs, entropy, data)
        return loss * float("nan"), stats

    x, y = _batches(0)
    want = ok.train_policies(_jobs(x, y))
    jobs = _jobs(x, y)
    jobs["b.v2"] = PolicyJob(y, nan_loss, advantages_for(y))
    got = bad.train_policies(jobs)
    assert got["b.v2"]["skipped"] == 1.0 and got["A"]["skipped"] == 0.0 and math.isnan(got["b.v2"]["loss"])
    after = _state(bad)
    assert all(torch.equal(after[k], before[k]) for k in before if k.startswith("b.v2/"))
    assert all(torch.isfinite(t).all() for t in after.values())
    a_got = {k: v for k, v in after.items() if k.startswith("A/")}
    a_want = {k: v for k, v in _state(ok).items() if k.startswith("A/")}
    assert max_difference(a_got, a_want).value == 0  # A's tokens are computed the same either way
    assert got["A"]["loss"] == want["A"]["loss"]


def test_it_falls_back_to_one_forward_per_policy_where_it_cannot_share(tiny_model_dir):
    """One job, or an adapter on the LM head (which runs on the scored
    positions only): each policy trains alone (``joint`` 0), as its view would."""
    one = multi_engine(tiny_model_dir)
    x, y = _batches(0)
    out = one.train_policies({"A": PolicyJob(x, ppo_like_loss, advantages_for(x))})
    assert out["A"]["joint"] == 0.0 and one.policy("A").step == 1 and one.policy("b.v2").step == 0

    head = {**LORA_B, "target_modules": ["k_proj", "lm_head"]}
    engines = [multi_engine(tiny_model_dir, adapters=[LORA_A, head]) for _ in range(2)]
    got = engines[0].train_policies(_jobs(x, y))
    assert {st["joint"] for st in got.values()} == {0.0}
    _one = engines[1]
    _one.policy("A").train_batch(x, ppo_like_loss, advantages_for(x))
    _one.policy("b.v2").train_batch(y, ppo_like_loss, advantages_for(y))
    assert max_difference(_state(engines[0]), _state(_one)).value == 0  # the same calls, bit for bit


def test_with_lora_dropout_each_segment_runs_through_its_own_adapter(tiny_model_dir):
    """Adapters with dropout (a mask drawn per adapter) take the per-segment
    path instead of the stacked one; with the dropout rate then set to 0 the
    joint steps must still equal one step per policy (within the floor of
    the first test's kind)."""
    drop = [{**LORA_A, "dropout": 0.1}, {**LORA_B, "dropout": 0.1}]
    joint, alone, split = (multi_engine(tiny_model_dir, adapters=drop, max_tokens_per_mb=mb) for mb in (48, 48, 24))
    for e in (joint, alone, split):
        mods = [m for m in e.model.modules() if isinstance(m, torch.nn.Dropout)]
        assert mods  # peft built dropout modules: the stacked path is not taken
        for m in mods:
            m.p = 0.0
    _joint_against_one_at_a_time(joint, alone, split, "joint steps, per-segment path")


def test_joint_micro_batches_mix_policies_within_the_budget():
    """``joint_plan``: every sequence of every policy in exactly one
    micro-batch, a shared prompt's chunk never holding two policies, no
    micro-batch over ``max_tokens_per_mb`` (unless one chunk alone is), and
    micro-batches that hold both policies (else nothing would be shared)."""
    from areal_kernel.engine.config import TorchEngineConfig
    from areal_kernel.engine.together import joint_plan

    x, y = _batches(0)
    batches = {"A": x, "b.v2": y}
    for budget in (48, 96, 4096):
        plan = joint_plan(TorchEngineConfig(max_tokens_per_mb=budget), batches)
        for name, b in batches.items():
            members = sorted(m for mb in plan for c in mb.get(name, []) for m in c.members)
            assert members == list(range(len(b)))
        for mb in plan:
            costs = [c.cost([len(t.input_ids) for t in batches[n].trajectories]) for n, cs in mb.items() for c in cs]
            assert sum(costs) <= budget or len(costs) == 1, (budget, costs)
        assert any(len(mb) == 2 for mb in plan), budget
        assert any(c.prefix_len > 0 for mb in plan for cs in mb.values() for c in cs)  # prompts shared
    assert len(joint_plan(TorchEngineConfig(max_tokens_per_mb=4096), batches)) == 1  # one forward for both


def test_with_gradient_checkpointing_the_recomputed_layers_keep_each_policys_adapter(tiny_model_dir):
    """Gradient checkpointing runs the layers again during the backward: the
    joint step back-propagates while every adapter still updates only its
    own tokens, so it equals one step per policy as without checkpointing."""
    joint, alone, split = (
        multi_engine(tiny_model_dir, max_tokens_per_mb=mb, gradient_checkpointing=True) for mb in (48, 48, 24)
    )
    _joint_against_one_at_a_time(joint, alone, split, "joint steps, checkpointed")
