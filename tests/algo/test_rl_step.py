"""The RL step on a real tiny Llama: estimators and losses picked by name,
KL in reward, proximal interpolation vs recompute, minibatches, and PPO with
a critic (value head) learning a toy reward."""
from __future__ import annotations

import pytest
import torch
from test_grpo import _fixed_batch, sample_groups

from areal_kernel.algo.rl import RLConfig, compute_advantages, prox_interpolation_alpha, rl_train_step
from areal_kernel.api.io import Trajectory, TrajectoryBatch
from areal_kernel.engine.critic import TorchCriticEngine
from areal_kernel.engine.torch_engine import TorchTrainEngine
from areal_kernel.errors import ConfigError
from areal_kernel.testing.noise import assert_within_noise, measure_noise_floor


def test_prox_interpolation_alpha_hand_values():
    versions, mask = [-1, 3, 4, 5], [0, 1, 1, 1]
    # minibatch 1 of 2 at version 5: theta = 5.5; alpha = (5 - v) / (5.5 - v)
    assert prox_interpolation_alpha(versions, mask, 5, 5.5) == pytest.approx([0.0, 0.8, 2 / 3, 0.0])
    # first minibatch: the current weights are the proximal policy -> alpha 1
    assert prox_interpolation_alpha(versions, mask, 5, 5.0) == [0.0, 1.0, 1.0, 1.0]


def test_kl_in_reward_reaches_the_estimator():
    t = Trajectory(input_ids=[5, 6, 7], loss_mask=[0, 1, 1], logprobs=[0.0, -1.0, -1.0], versions=[-1, 0, 0],
                   reward=1.0, group_id="g")  # fmt: skip
    batch = TrajectoryBatch([t])
    ref = [[0.0, -1.5, -0.5]]  # old - ref = .5, -.5
    cfg = RLConfig(advantage="reinforce_pp", adv_norm="none", kl_coef=0.1, kl_in="reward", kl_estimator="k1")
    adv, _ = compute_advantages(batch, cfg, ref_logprobs=ref)
    # token rewards -.05, +.05 (+1 at the end): returns [1.0, 1.05]
    assert adv[0] == pytest.approx([0.0, 1.0, 1.05])
    cfg = RLConfig(advantage="reinforce_pp", adv_norm="none", kl_coef=0.1, kl_in="reward", kl_estimator="k2")
    assert compute_advantages(batch, cfg, ref_logprobs=ref)[0][0] == pytest.approx([0.0, 0.975, 0.9875])
    with pytest.raises(ConfigError, match="ref_logprobs"):
        compute_advantages(batch, cfg)


def _engine(path, **kw):
    e = TorchTrainEngine({"lr": 1e-3, "seed": 0, **kw})
    e.initialize(path, 8)
    return e


def test_interpolated_prox_equals_recompute_for_one_step(tiny_llama_dir):
    """With one optimizer step per batch the interpolation weight is 1 for
    every token, i.e. exactly the recomputed proximal policy, without the pass."""
    batch = _fixed_batch()
    a = rl_train_step(batch, _engine(tiny_llama_dir), RLConfig(recompute_proximal=True, behav_imp_weight_cap=5.0))
    b = rl_train_step(batch, _engine(tiny_llama_dir), RLConfig(recompute_proximal=False, prox_interpolate=True, behav_imp_weight_cap=5.0))
    # Floor (areal_kernel.testing.noise): the recompute again with the other attention kernel.
    # Measured: the two routes are bit-identical here (AVX-512 and avx2); 4x the floor.
    n = rl_train_step(batch, _engine(tiny_llama_dir, attn_implementation="eager"),
                      RLConfig(recompute_proximal=True, behav_imp_weight_cap=5.0))  # fmt: skip
    for key in ("loss", "importance_weight", "behav_imp_weight", "behav_masked_frac", "grad_norm"):
        floor = measure_noise_floor(key, a[key], n[key], relative=True)
        print(assert_within_noise(b[key], a[key], floor, 4.0))
    assert b["importance_weight"] == pytest.approx(1.0)


def test_minibatches_take_several_optimizer_steps(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    engine.set_version(3)
    stats = rl_train_step(_fixed_batch(), engine, RLConfig(recompute_proximal=False, prox_interpolate=True, ppo_n_minibatches=2))
    assert engine.step == 2
    assert stats["skipped"] == 0 and stats["n_seqs"] == 2  # averaged over the two minibatches of 2
    with pytest.raises(ConfigError, match="ppo_n_minibatches"):
        rl_train_step(_fixed_batch(), engine, RLConfig(ppo_n_minibatches=5))


@pytest.mark.parametrize("advantage, extra", [
    ("dr_grpo", {"loss_agg": "seq-mean-token-sum"}),
    ("rloo", {}),
    ("reinforce_pp", {"gamma": 0.99}),
    ("reinforce_pp_baseline", {}),
    ("grpo", {"ratio_level": "sequence", "eps_clip": 3e-4, "eps_clip_high": 4e-4, "loss_agg": "seq-mean-token-mean"}),
    ("grpo", {"eps_clip_high": 0.28, "dual_clip": 3.0, "behav_imp_weight_mode": "clamp", "behav_imp_weight_cap": 2.0}),
])  # fmt: skip
def test_each_estimator_and_loss_option_trains(tiny_llama_dir, advantage, extra):
    engine = _engine(tiny_llama_dir)
    before = engine.model.lm_head.weight.detach().clone()
    stats = rl_train_step(_fixed_batch(), engine, RLConfig(advantage=advantage, **extra))
    assert stats["skipped"] == 0 and torch.isfinite(torch.tensor(stats["loss"]))
    assert stats["adv_abs"] > 0
    assert not torch.equal(before, engine.model.lm_head.weight)


def test_gae_without_critic_is_a_config_error(tiny_llama_dir):
    with pytest.raises(ConfigError, match="critic"):
        rl_train_step(_fixed_batch(), _engine(tiny_llama_dir), RLConfig(advantage="gae"))


def test_critic_values_align_and_fit_returns(tiny_llama_dir):
    critic = TorchCriticEngine({"lr": 1e-2, "seed": 0, "max_tokens_per_mb": 16})
    critic.initialize(tiny_llama_dir, 20)
    batch = _fixed_batch()
    v0 = critic.compute_values(batch)
    assert [len(v) for v in v0] == [len(t.input_ids) for t in batch.trajectories]
    assert all(x == 0.0 for row in v0 for x in row)  # zero-initialised head
    returns = [[float(t.reward) if m else 0.0 for m in t.loss_mask] for t in batch.trajectories]
    losses = []
    for _ in range(15):
        old = critic.compute_values(batch)
        losses.append(critic.train_values(batch, returns, old, value_eps_clip=None)["value_loss"])
    assert losses[-1] < 0.2 * losses[0], losses
    # Packing does not change the values: score each sequence alone.
    packed = critic.compute_values(batch)
    alone = critic.compute_values(TrajectoryBatch(batch.trajectories[:1]))
    # Floor: the same weights with the other attention kernel, packed too
    # (measured 0.16-0.33x it on AVX-512 and avx2; 4x).
    eager = TorchCriticEngine({"lr": 1e-2, "seed": 0, "max_tokens_per_mb": 16, "attn_implementation": "eager"})
    eager.initialize(tiny_llama_dir, 20)
    eager.decoder.load_state_dict(critic.decoder.state_dict())
    eager.head.load_state_dict(critic.head.state_dict())
    floor = measure_noise_floor("values", packed[0], eager.compute_values(batch)[0])
    print(assert_within_noise(alone[0], packed[0], floor, 4.0))


def test_critic_state_round_trip_continues_exactly(tiny_llama_dir, tmp_path):
    """A recovery checkpoint holds the critic: after save/load into a fresh
    critic, the next training step gives the same values as the original's."""
    batch = _fixed_batch()
    returns = [[float(t.reward) if m else 0.0 for m in t.loss_mask] for t in batch.trajectories]
    a = TorchCriticEngine({"lr": 1e-2, "seed": 0, "max_tokens_per_mb": 16})
    a.initialize(tiny_llama_dir, 20)
    for _ in range(2):
        a.train_values(batch, returns, a.compute_values(batch), value_eps_clip=None)
    a.save_state(str(tmp_path / "critic"))
    b = TorchCriticEngine({"lr": 1e-2, "seed": 1, "max_tokens_per_mb": 16})
    b.initialize(tiny_llama_dir, 20)
    b.load_state(str(tmp_path / "critic"))
    saved = a.compute_values(batch)
    assert b.compute_values(batch) == saved
    for e in (a, b):  # moments and step restored: the next update is identical too
        e.train_values(batch, returns, e.compute_values(batch), value_eps_clip=None)
    va, vb = a.compute_values(batch), b.compute_values(batch)
    assert va != saved  # the step did change the values
    assert va == vb
    with pytest.raises(Exception, match="not a critic checkpoint"):
        b.load_state(str(tmp_path))


def test_ppo_with_critic_raises_toy_reward(tiny_llama_dir):
    """PPO (GAE + value head) on the toy reward of test_grpo: the sampling
    reward rises (a trend over 12 steps, not a value)."""
    engine = TorchTrainEngine({"lr": 2e-2, "max_tokens_per_mb": 512, "seed": 0})
    engine.initialize(tiny_llama_dir, 12)
    critic = TorchCriticEngine({"lr": 1e-2, "max_tokens_per_mb": 512, "seed": 0})
    critic.initialize(tiny_llama_dir, 12)
    cfg = RLConfig(advantage="gae", gamma=1.0, lam=0.95, eps_clip=0.2)
    gen = torch.Generator().manual_seed(0)
    rewards, vloss = [], []
    for step in range(12):
        batch = sample_groups(engine, n_prompts=8, group_size=8, new_tokens=8, gen=gen)
        stats = rl_train_step(batch, engine, cfg, critic=critic)
        assert stats["skipped"] == 0 and stats["critic_skipped"] == 0
        rewards.append(stats["reward"])
        vloss.append(stats["critic_value_loss"])
        engine.set_version(step + 1)
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.1, rewards
