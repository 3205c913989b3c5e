"""GRPO glue on a real tiny model: advantages reach the loss, proximal
recomputation, config checks, and a learning trend on a toy reward."""
from __future__ import annotations

import random

import pytest
import torch

from areal_kernel.algo.grpo import GRPOConfig, grpo_train_step, sequence_advantages
from areal_kernel.api.io import Trajectory, TrajectoryBatch
from areal_kernel.engine.torch_engine import TorchTrainEngine
from areal_kernel.errors import ConfigError

TARGET = 7  # reward = fraction of generated tokens equal to this id


@torch.no_grad()
def sample_groups(engine, n_prompts: int, group_size: int, new_tokens: int, gen: torch.Generator, temperature=1.0):
    """Sample from the engine's own model (plain torch, no cache), recording
    behaviour logprobs, and build GRPO groups with the toy reward."""
    model = engine.model
    model.eval()
    trajs = []
    for p in range(n_prompts):
        prompt = torch.randint(4, 256, (3,), generator=gen).tolist()
        seqs = torch.tensor([prompt] * group_size)
        lps = []
        for _ in range(new_tokens):
            logits = model(seqs, use_cache=False).logits[:, -1].float() / temperature
            logp = logits.log_softmax(-1)
            nxt = torch.multinomial(logp.exp(), 1, generator=gen)
            lps.append(logp.gather(-1, nxt)[:, 0])
            seqs = torch.cat([seqs, nxt], dim=1)
        lps = torch.stack(lps, dim=1)
        for g in range(group_size):
            out = seqs[g, 3:].tolist()
            trajs.append(
                Trajectory(
                    input_ids=seqs[g].tolist(),
                    loss_mask=[0] * 3 + [1] * new_tokens,
                    logprobs=[0.0] * 3 + lps[g].tolist(),
                    versions=[-1] * 3 + [engine.get_version()] * new_tokens,
                    reward=sum(t == TARGET for t in out) / new_tokens,
                    group_id=f"p{p}",
                )
            )
    model.train()
    return TrajectoryBatch(trajs)


def test_grpo_raises_toy_reward(tiny_llama_dir):
    engine = TorchTrainEngine({"lr": 2e-2, "max_tokens_per_mb": 512, "seed": 0})
    engine.initialize(tiny_llama_dir, 12)
    cfg = GRPOConfig(eps_clip=0.2)
    gen = torch.Generator().manual_seed(0)
    rewards = []
    for step in range(12):
        batch = sample_groups(engine, n_prompts=8, group_size=8, new_tokens=8, gen=gen)
        stats = grpo_train_step(batch, engine, cfg)
        assert stats["skipped"] == 0
        rewards.append(stats["reward"])
        engine.set_version(step + 1)
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.1, rewards


def _fixed_batch() -> TrajectoryBatch:
    rng = random.Random(0)
    trajs = []
    for k in range(4):
        n = 6 + k
        trajs.append(
            Trajectory(
                input_ids=[rng.randrange(4, 256) for _ in range(n)],
                loss_mask=[0, 0] + [1] * (n - 2),
                logprobs=[0.0, 0.0] + [-4.0] * (n - 2),
                versions=[-1, -1] + [0] * (n - 2),
                reward=[1.0, 0.0, 0.5, 0.5][k],
                group_id=["a", "a", "b", "b"][k],
            )
        )
    return TrajectoryBatch(trajs)


def test_sequence_advantages_follow_reward_norm():
    batch = _fixed_batch()
    assert sequence_advantages(batch, GRPOConfig()) == pytest.approx([1.0, -1.0, 0.0, 0.0], abs=1e-5)
    assert sequence_advantages(batch, GRPOConfig(adv_norm="none")) == [1.0, 0.0, 0.5, 0.5]
    # batch: mean 0.5, population std sqrt(0.125)
    assert sequence_advantages(batch, GRPOConfig(adv_norm="batch", std_normalize=False)) == pytest.approx(
        [0.5, -0.5, 0.0, 0.0]
    )


def test_recompute_proximal_makes_ratio_one(tiny_llama_dir):
    engine = TorchTrainEngine({"lr": 1e-3})
    engine.initialize(tiny_llama_dir, 4)
    batch = _fixed_batch()
    stats = grpo_train_step(batch, engine, GRPOConfig(recompute_proximal=True, behav_imp_weight_cap=5.0))
    # prox = current weights, so the PPO ratio is exactly 1 and nothing clips;
    # the behaviour weights exp(prox - old) are far from 1 (old = -4.0, current ~ -log(256)).
    assert stats["importance_weight"] == pytest.approx(1.0, abs=1e-6)
    assert stats["clip_frac"] == 0.0
    assert stats["behav_imp_weight"] < 0.5
    assert stats["reward"] == pytest.approx(0.5)
    assert stats["adv_abs"] == pytest.approx(0.5, abs=1e-5)


def test_grpo_config_checks(tiny_llama_dir):
    engine = TorchTrainEngine({"temperature": 0.7})
    engine.initialize(tiny_llama_dir, 4)
    with pytest.raises(ConfigError, match="temperature"):
        grpo_train_step(_fixed_batch(), engine, GRPOConfig(temperature=1.0))
    with pytest.raises(ConfigError, match="ref_logprobs"):
        grpo_train_step(_fixed_batch(), engine, GRPOConfig(temperature=0.7, kl_coef=0.1))
    with pytest.raises(Exception, match="eps_clip"):
        GRPOConfig(eps_clip=-1)
