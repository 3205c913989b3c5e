"""Several LoRA adapters on one sharded base (``adapters:``) on 2 real FSDP2
ranks (gloo), against the kernel's single-process torch engine holding the
same adapters: each policy's view trains, scores, exports and checkpoints its
own adapter as the torch engine's view does, and leaves the other alone."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from areal_kernel.algo.losses import make_ppo_loss_fn
from areal_kernel.api.engine import WeightUpdateMeta
from areal_kernel.errors import ConfigError, DataError
from areal_kernel.testing.contracts import JointPoliciesContract, policies_engine_maker
from areal_kernel.testing.noise import assert_within_noise, max_difference, measure_noise_floor
from areal_kernel.testing.rank_engines import ppo_step_inputs, random_batch, torch_references

pytestmark = pytest.mark.slow

# Two adapters of different shapes and targets (as the kernel's test): nothing
# may rely on them matching. A decaying schedule: a step counter shared by the
# policies would give each another lr than its own engine's.
LORA_A = {"name": "A", "rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]}
LORA_B = {"name": "b.v2", "rank": 2, "alpha": 4, "target_modules": ["k_proj", "o_proj"]}
CFG = {"lr": 1e-2, "max_tokens_per_mb": 20, "lr_scheduler": "cosine", "adapters": [LORA_A, LORA_B]}
# The floor: the torch engine with another micro-batch split (test_fsdp_lora's
# reasoning and multiple: two ranks sum the same numbers in another order).
NOISE_CFG = {**CFG, "max_tokens_per_mb": 13}
MULTIPLE = 4.0
LOSS = make_ppo_loss_fn(eps_clip=0.2, behav_imp_weight_cap=5.0)
# Interleaved, as the multi-policy trainer alternates policies.
ROUNDS = [("A", 0, [7, 9, 5, 12]), ("b.v2", 1, [11, 6, 8, 10]), ("A", 2, [9, 13, 6]), ("b.v2", 3, [8, 12, 7, 5])]
PROBE = random_batch([10, 7, 12], seed=99)


def _train(view, seed: int, lengths: list[int]) -> dict[str, float]:
    batch = random_batch(lengths, seed=seed)
    return view.train_batch(batch, LOSS, ppo_step_inputs(batch, view))


def _torch_weights(view) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in view.named_weights_for_transfer()}


def _diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    from areal_fsdp.engine import FSDPTrainEngine

    fsdp = FSDPTrainEngine(CFG, world_size=2)
    fsdp.initialize(tiny_model_dir, 4)
    ref, noise = torch_references(CFG, NOISE_CFG, tiny_model_dir, 4)
    init = {n: (dict(fsdp.policy(n).full_weights()), _torch_weights(ref.policy(n))) for n in ("A", "b.v2")}
    stats = []
    try:
        for name, seed, lengths in ROUNDS:
            stats.append([_train(e.policy(name), seed, lengths) for e in (fsdp, ref, noise)])
        yield fsdp, ref, noise, init, stats
    finally:
        fsdp.destroy()


def test_each_adapter_trains_like_the_torch_engines(engines, tiny_model_dir):
    fsdp, ref, noise, init, stats = engines
    for name in ("A", "b.v2"):
        assert _diff(*init[name]) == 0.0  # same seed, same peft init of every adapter
        view, want = fsdp.policy(name), ref.policy(name)
        assert view.step == want.step == 2 and view.current_lr() == want.current_lr()
        assert view.adapter_spec() == want.adapter_spec()
        assert [m["name"] for m in view.weight_transfer_meta()] == [m["name"] for m in want.weight_transfer_meta()]
        now = dict(view.full_weights())
        floor = measure_noise_floor(f"{name} weights", _torch_weights(want), _torch_weights(noise.policy(name)))
        print(assert_within_noise(now, _torch_weights(want), floor, MULTIPLE, what=f"{name} on fsdp"))
        assert _diff(now, init[name][0]) > 1e-3  # it did train
        want_lp = want.compute_logprobs(PROBE)
        lp_floor = measure_noise_floor(f"{name} logprobs", want_lp, noise.policy(name).compute_logprobs(PROBE))
        print(assert_within_noise(view.compute_logprobs(PROBE), want_lp, lp_floor, MULTIPLE, what=f"{name} logprobs"))
    for got, want, _ in stats:
        assert got["lr"] == want["lr"] and got["n_loss_tokens"] == want["n_loss_tokens"]
    # Negative control: adapter A trained at 1.05x the lr lands outside the bound.
    from areal_kernel.engine.torch_engine import TorchTrainEngine

    other = TorchTrainEngine({**CFG, "lr": CFG["lr"] * 1.05})
    other.initialize(tiny_model_dir, 4)
    for name, seed, lengths in ROUNDS:
        _train(other.policy(name), seed, lengths)
    floor = measure_noise_floor("A weights", _torch_weights(ref.policy("A")), _torch_weights(noise.policy("A")))
    with pytest.raises(AssertionError, match="weights"):
        assert_within_noise(fsdp.policy("A").full_weights(), _torch_weights(other.policy("A")), floor, MULTIPLE)


def test_training_one_adapter_leaves_the_other_exactly(engines):
    fsdp, ref, noise, _, _ = engines
    a, b = fsdp.policy("A"), fsdp.policy("b.v2")
    w_b, lp_b, lp_a = dict(b.full_weights()), b.compute_logprobs(PROBE), a.compute_logprobs(PROBE)
    for e in (fsdp, ref, noise):  # the references too, so later tests still compare like with like
        _train(e.policy("A"), 5, [6, 10, 8])
    assert _diff(dict(b.full_weights()), w_b) == 0.0
    assert b.compute_logprobs(PROBE) == lp_b
    assert b.step == 2 and a.step == 3
    # Negative control: training A did change how A scores.
    assert max_difference(a.compute_logprobs(PROBE), lp_a).value > 1e-4


def test_each_adapter_exports_and_updates_as_the_torch_engine(engines, tmp_path):
    fsdp, ref, noise, _, _ = engines
    for name in ("A", "b.v2"):
        view, want = fsdp.policy(name), ref.policy(name)
        view.save_hf(str(tmp_path / name / "fsdp"))
        want.save_hf(str(tmp_path / name / "torch"))
        noise.policy(name).save_hf(str(tmp_path / name / "noise"))
        read = {
            k: load_file(str(tmp_path / name / k / "adapter_model.safetensors")) for k in ("fsdp", "torch", "noise")
        }
        floor = measure_noise_floor(f"{name} export", read["torch"], read["noise"])
        print(assert_within_noise(read["fsdp"], read["torch"], floor, MULTIPLE, what=f"{name} export"))
        cfgs = [json.loads((tmp_path / name / k / "adapter_config.json").read_text()) for k in ("fsdp", "torch")]
        assert cfgs[0] == cfgs[1] and cfgs[0]["r"] == {"A": 4, "b.v2": 2}[name]
        # A disk weight update ships this adapter alone.
        view.send_weights(WeightUpdateMeta(kind="disk", version=1, path=str(tmp_path / name / "upd")))
        assert sorted(os.listdir(tmp_path / name / "upd")) == ["adapter_config.json", "adapter_model.safetensors"]
        sent = load_file(str(tmp_path / name / "upd" / "adapter_model.safetensors"))
        assert _diff(sent, read["fsdp"]) == 0.0
    # The two adapters' files differ (no export of the wrong adapter).
    assert set(read["fsdp"]) != set(load_file(str(tmp_path / "A" / "fsdp" / "adapter_model.safetensors")))


def test_score_base_is_the_base_with_every_adapter_off(engines, tiny_model_dir):
    fsdp, ref, noise, _, _ = engines
    want = ref.score_base(PROBE)
    floor = measure_noise_floor("base logprobs", want, noise.score_base(PROBE))
    print(assert_within_noise(fsdp.score_base(PROBE), want, floor, MULTIPLE, what="score_base"))
    # Negative control: the trained policies no longer score as the base.
    for name in ("A", "b.v2"):
        assert max_difference(fsdp.policy(name).compute_logprobs(PROBE), want).value > MULTIPLE * floor.value
    # Scoring the base leaves the active adapter as it was.
    lp_a = fsdp.policy("A").compute_logprobs(PROBE)
    fsdp.score_base(PROBE)
    assert fsdp.policy("A").compute_logprobs(PROBE) == lp_a


def test_one_policy_calls_and_bad_names_are_refused(engines):
    fsdp = engines[0]
    assert fsdp.policy_names() == ["A", "b.v2"]
    with pytest.raises(ConfigError, match="unknown policy 'c'"):
        fsdp.policy("c")
    for call in (lambda: fsdp.compute_logprobs(PROBE), fsdp.adapter_spec, fsdp.weight_transfer_meta):
        with pytest.raises(ConfigError, match="engine.policy"):
            call()
    with pytest.raises(ConfigError, match="several adapters are not validated with tensor parallelism"):
        from areal_fsdp.engine import FSDPTrainEngine

        FSDPTrainEngine(CFG, "fsdp:t2")


def test_engine_state_round_trip_of_every_adapter(engines, tmp_path):
    """Last (it trains the fsdp engine alone): the engine's checkpoint holds
    every adapter and optimizer; after loading it, both policies continue
    exactly as they did the first time."""
    fsdp = engines[0]
    a, b = fsdp.policy("A"), fsdp.policy("b.v2")
    a.set_version(3)
    b.set_version(5)
    ckpt = str(tmp_path / "state")
    fsdp.save_state(ckpt)
    from torch.distributed.checkpoint import FileSystemReader

    keys = list(FileSystemReader(os.path.join(ckpt, "dcp")).read_metadata().state_dict_metadata)
    for name, n_tensors in (("A", 12), ("b.v2", 8)):
        model_keys = [k for k in keys if k.startswith(f"{name}.model.")]
        assert len(model_keys) == n_tensors and all(".lora_" in k for k in model_keys), model_keys
        assert any(k.startswith(f"{name}.optim.state.") and k.endswith(".exp_avg") for k in keys)

    def continue_both():
        stats = [_train(a, 30, [8, 11, 6]), _train(b, 31, [9, 7, 10]), _train(b, 32, [5, 12])]
        return stats, dict(a.full_weights()), dict(b.full_weights()), a.step, b.step

    first = continue_both()
    a.set_version(9)
    fsdp.load_state(ckpt)
    assert (a.get_version(), b.get_version(), a.step, b.step) == (3, 5, 3, 2)
    second = continue_both()
    assert [s["loss"] for s in first[0]] == [s["loss"] for s in second[0]]
    assert _diff(first[1], second[1]) == 0.0 and _diff(first[2], second[2]) == 0.0
    assert first[3:] == second[3:]
    # Negative control: the continuation did move the weights away from the checkpoint.
    fsdp.load_state(ckpt)
    assert _diff(dict(a.full_weights()), first[1]) > 1e-4
    # A view's own checkpoint holds its adapter alone: loading it restores b, A stays as it is.
    view_ckpt = str(tmp_path / "view")
    b.save_state(view_ckpt)
    saved_b, step_b = dict(b.full_weights()), b.step
    _train(b, 33, [6, 9])
    _train(a, 34, [7, 8])
    now_a = dict(a.full_weights())
    assert _diff(dict(b.full_weights()), saved_b) > 1e-4
    b.load_state(view_ckpt)
    assert _diff(dict(b.full_weights()), saved_b) == 0.0 and b.step == step_b
    assert _diff(dict(a.full_weights()), now_a) == 0.0
    # A checkpoint of other policies is refused.
    with open(os.path.join(ckpt, "engine_state.json")) as f:
        meta = json.load(f)
    meta["policies"]["c"] = meta["policies"].pop("b.v2")
    with open(os.path.join(ckpt, "engine_state.json"), "w") as f:
        json.dump(meta, f)
    with pytest.raises(DataError, match="holds the policies"):
        fsdp.load_state(ckpt)


def test_a_joint_step_of_uneven_policies_trains_each_like_its_own_step(tiny_model_dir):
    """``train_policies`` where the ranks' micro-batches hold different
    policies: A's six sequences need several micro-batches per rank, b.v2's
    one sequence lands on one rank only, so the other rank's forwards hold A
    alone (and fillers). Each adapter must still end where one
    ``train_batch`` of it on the torch engine ends (within the floor of
    another micro-batch split), through the shared forwards (``joint`` 1)."""
    from areal_fsdp.engine import FSDPTrainEngine

    from areal_kernel.engine.together import PolicyJob

    fsdp = FSDPTrainEngine(CFG, world_size=2)
    fsdp.initialize(tiny_model_dir, 4)
    ref, noise = torch_references(CFG, NOISE_CFG, tiny_model_dir, 4)
    batches = {"A": random_batch([7, 9, 5, 12, 8, 11], seed=40), "b.v2": random_batch([6], seed=41)}
    try:
        init = {n: dict(fsdp.policy(n).full_weights()) for n in batches}
        jobs = {n: PolicyJob(b, LOSS, ppo_step_inputs(b, fsdp.policy(n))) for n, b in batches.items()}
        got = fsdp.train_policies(jobs)
        for n, b in batches.items():
            want = ref.policy(n).train_batch(b, LOSS, ppo_step_inputs(b, ref.policy(n)))
            noise.policy(n).train_batch(b, LOSS, ppo_step_inputs(b, noise.policy(n)))
            assert got[n]["joint"] == 1.0 and got[n]["skipped"] == 0.0, got[n]
            assert got[n]["lr"] == want["lr"] and got[n]["n_loss_tokens"] == want["n_loss_tokens"]
            assert fsdp.policy(n).step == 1
            now = dict(fsdp.policy(n).full_weights())
            assert _diff(now, init[n]) > 0  # it trained
            floor = measure_noise_floor(f"{n} weights", _torch_weights(ref.policy(n)), _torch_weights(noise.policy(n)))
            print(assert_within_noise(now, _torch_weights(ref.policy(n)), floor, MULTIPLE, what=f"{n}: joint on fsdp"))
        # Then one policy at a time again (the ranks' active adapter, flags and
        # schedule steps restored): still each like the torch engine's.
        for n, seed, lengths in (("b.v2", 42, [9, 6, 10]), ("A", 43, [8, 7])):
            for e in (fsdp, ref, noise):
                _train(e.policy(n), seed, lengths)
            floor = measure_noise_floor(f"{n} weights", _torch_weights(ref.policy(n)), _torch_weights(noise.policy(n)))
            print(assert_within_noise(dict(fsdp.policy(n).full_weights()), _torch_weights(ref.policy(n)), floor,
                                      MULTIPLE, what=f"{n}: a step alone after the joint one"))  # fmt: skip
            assert fsdp.policy(n).step == ref.policy(n).step == 2
    finally:
        fsdp.destroy()


def test_a_joint_step_with_adapter_dropout_on_uneven_ranks(tiny_model_dir):
    """With LoRA dropout each policy's tokens run through its own adapter
    (a mask drawn per adapter), so the zero share of an adapter absent from
    a micro-batch is added on that path too: b.v2's one sequence sits on one
    rank, the other rank's forwards hold A alone, and the step completes on
    both ranks with both adapters trained in shared forwards (without that
    share the ranks' gradient reductions mismatched and a rank died)."""
    from areal_fsdp.engine import FSDPTrainEngine

    from areal_kernel.engine.together import PolicyJob

    cfg = {**CFG, "adapters": [{**LORA_A, "dropout": 0.1}, {**LORA_B, "dropout": 0.1}]}
    fsdp = FSDPTrainEngine(cfg, world_size=2)
    fsdp.initialize(tiny_model_dir, 4)
    batches = {"A": random_batch([7, 9, 5, 12, 8, 11], seed=40), "b.v2": random_batch([6], seed=41)}
    try:
        before = {n: dict(fsdp.policy(n).full_weights()) for n in batches}
        got = fsdp.train_policies(
            {n: PolicyJob(b, LOSS, ppo_step_inputs(b, fsdp.policy(n))) for n, b in batches.items()}
        )
        for n in batches:
            assert got[n]["joint"] == 1.0 and got[n]["skipped"] == 0.0 and got[n]["grad_norm"] > 0
            assert _diff(dict(fsdp.policy(n).full_weights()), before[n]) > 1e-3
    finally:
        fsdp.destroy()


def test_an_adapter_on_the_lm_head_shares_the_joint_step_on_fsdp(tiny_model_dir):
    """The ranks run the whole model on the packed row (the head is not split
    off as in the torch engine, where an LM-head adapter makes the joint step
    fall back): A on ``q_proj`` and ``lm_head`` still trains in shared
    forwards (``joint`` 1), each adapter within the floor of the torch
    engine's one step each."""
    from areal_fsdp.engine import FSDPTrainEngine

    from areal_kernel.engine.together import PolicyJob

    adapters = [{**LORA_A, "target_modules": ["q_proj", "lm_head"]}, LORA_B]
    cfg, noise_cfg = {**CFG, "adapters": adapters}, {**NOISE_CFG, "adapters": adapters}
    fsdp = FSDPTrainEngine(cfg, world_size=2)
    fsdp.initialize(tiny_model_dir, 4)
    ref, noise = torch_references(cfg, noise_cfg, tiny_model_dir, 4)
    batches = {"A": random_batch([7, 9, 5, 12], seed=60), "b.v2": random_batch([6, 8], seed=61)}
    try:
        got = fsdp.train_policies(
            {n: PolicyJob(b, LOSS, ppo_step_inputs(b, fsdp.policy(n))) for n, b in batches.items()}
        )
        for n, b in batches.items():
            assert got[n]["joint"] == 1.0 and got[n]["skipped"] == 0.0
            for e in (ref, noise):
                e.policy(n).train_batch(b, LOSS, ppo_step_inputs(b, e.policy(n)))
            want = _torch_weights(ref.policy(n))
            assert any("lm_head" in k for k in want) == (n == "A")
            floor = measure_noise_floor(f"{n} weights", want, _torch_weights(noise.policy(n)))
            print(assert_within_noise(dict(fsdp.policy(n).full_weights()), want, floor, MULTIPLE, what=f"{n}: lm_head"))
    finally:
        fsdp.destroy()


def test_a_joint_step_skips_a_policy_whose_loss_is_not_finite_on_one_rank_alone(tiny_model_dir):
    """b.v2's one sequence (on one rank) has a NaN loss: every rank skips
    b.v2's step (its adapter stays as it was), none hangs, and A trains
    exactly as beside a finite b.v2 (the NaN never enters the backward)."""
    import math

    from areal_fsdp.engine import FSDPTrainEngine

    from areal_kernel.engine.together import PolicyJob

    def nan_loss(logprobs, entropy, data):
        loss, stats = LOSS(logprobs, entropy, data)
        return loss * float("nan"), stats

    batches = {"A": random_batch([7, 9, 5, 12], seed=50), "b.v2": random_batch([6], seed=51)}
    engines = [FSDPTrainEngine(CFG, world_size=2) for _ in range(2)]
    try:
        for e in engines:
            e.initialize(tiny_model_dir, 4)
        ok, bad = engines
        before = {n: dict(bad.policy(n).full_weights()) for n in batches}
        jobs = {n: PolicyJob(b, LOSS, ppo_step_inputs(b, ok.policy(n))) for n, b in batches.items()}
        want = ok.train_policies(jobs)
        jobs["b.v2"] = PolicyJob(batches["b.v2"], nan_loss, jobs["b.v2"].extra)
        got = bad.train_policies(jobs)
        assert got["b.v2"]["skipped"] == 1.0 and math.isnan(got["b.v2"]["loss"]) and got["b.v2"]["joint"] == 1.0
        assert got["A"]["skipped"] == 0.0 and got["A"]["loss"] == want["A"]["loss"]
        assert _diff(dict(bad.policy("b.v2").full_weights()), before["b.v2"]) == 0.0
        assert _diff(dict(bad.policy("A").full_weights()), dict(ok.policy("A").full_weights())) == 0.0
        assert _diff(dict(bad.policy("A").full_weights()), before["A"]) > 0  # A did train
    finally:
        for e in engines:
            e.destroy()


class TestFSDPEnginePolicies(JointPoliciesContract):
    """The kernel's suites for the capabilities ``policies`` and
    ``joint_policies`` on 2 FSDP ranks (the joint step against one
    ``train_batch`` per policy: adapters A and b.v2 sit on different
    layers, so every adapted layer's forward holds one adapter's tokens and
    the other's zero share)."""

    @pytest.fixture
    def make_policies_engine(self, tiny_model_dir):
        from areal_fsdp.engine import FSDPTrainEngine

        def new(split: bool):
            return FSDPTrainEngine({**CFG, "lr": 1e-3, "max_tokens_per_mb": 8 if split else 64}, world_size=2)

        with policies_engine_maker(new, tiny_model_dir, 10) as make:
            yield make
