"""Shared-prompt packing (``engine.prefix_tree``): the model runs each group's
prompt once, and scores, losses and gradients equal plain packing."""
from __future__ import annotations

import random

import pytest
import torch

from areal_kernel.api.io import Trajectory, TrajectoryBatch
from areal_kernel.engine.prefix_tree import (
    SharedChunk,
    allocate_shared_micro_batches,
    build_tree_row,
    plan_chunks,
    shared_prefix_len,
)

from engine_helpers import VOCAB
from test_torch_engine import MULTIPLE, advantages_for, grads_of, make_engine, ppo_like_loss, seq_mean_loss

from areal_kernel.testing.noise import assert_within_noise, measure_noise_floor

# Shared-prompt rows against plain packing: against a floor measured in the
# same test (plain packing with the other attention kernel, sdpa vs eager),
# MULTIPLE (test_torch_engine) times it.


def grouped_batch(n_groups: int = 3, group_size: int = 4, prompt_lens=(9, 5, 12), seed: int = 0) -> TrajectoryBatch:
    """Groups of samples sharing a random prompt, with completions of varied length."""
    rng = random.Random(seed)
    trajs = []
    for g in range(n_groups):
        p = prompt_lens[g % len(prompt_lens)]
        prompt = [rng.randrange(4, VOCAB) for _ in range(p)]
        for k in range(group_size):
            c = rng.randint(1, 7)
            trajs.append(
                Trajectory(
                    input_ids=prompt + [rng.randrange(4, VOCAB) for _ in range(c)],
                    loss_mask=[0] * p + [1] * c,
                    logprobs=[0.0] * p + [-rng.uniform(3.0, 8.0) for _ in range(c)],
                    versions=[-1] * p + [0] * c,
                    reward=float((g + k) % 2),
                    group_id=f"g{g}",
                )
            )
    # Interleave groups so sharing cannot rely on batch order.
    rng.shuffle(trajs)
    return TrajectoryBatch(trajs)


def test_chunks_group_equal_prompts_and_respect_the_budget():
    ids = [[5, 6, 7, 8], [5, 6, 7, 9, 9], [5, 6, 1, 2], [5, 6, 7, 4]]
    masks = [[0, 0, 0, 1], [0, 0, 0, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1]]
    assert shared_prefix_len(ids[0], masks[0]) == 3
    chunks = plan_chunks(ids, masks, 100)
    assert SharedChunk(3, (0, 1, 3)) in chunks
    assert SharedChunk(0, (2,)) in chunks  # a different prompt: nothing to share with
    # Budget 6: prompt (3) + suffixes 1 + 2 fit, the third member starts a new chunk.
    small = plan_chunks(ids, masks, 6)
    assert SharedChunk(3, (0, 1)) in small and SharedChunk(0, (3,)) in small
    lengths = [len(x) for x in ids]
    for mb in allocate_shared_micro_batches(ids, masks, 8):
        assert sum(c.cost(lengths) for c in mb) <= 8


def test_tree_mask_lets_suffixes_see_the_prompt_but_not_each_other():
    ids = [[5, 6, 7, 8, 8], [5, 6, 7, 9]]
    tree = build_tree_row([SharedChunk(3, (0, 1))], ids, "cpu")
    assert tree.input_ids.tolist() == [5, 6, 7, 8, 8, 9]
    assert tree.position_ids.tolist() == [0, 1, 2, 3, 4, 3]
    assert tree.virt_to_tree.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 5]
    m = tree.attention_mask[0, 0]
    assert m[5, :3].all() and not m[5, 3] and not m[5, 4] and m[5, 5]  # member 1 skips member 0's suffix
    assert m[4, 3] and not m[3, 4]  # causal inside a suffix
    assert not m[2, 3:].any()  # the prompt never sees a suffix
    additive = build_tree_row([SharedChunk(3, (0, 1))], ids, "cpu", additive_mask_dtype=torch.float32)
    assert ((additive.attention_mask[0, 0] == 0) == m).all()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_scores_equal_plain_packing(tiny_model_dir, attn):
    batch = grouped_batch()
    shared = make_engine(tiny_model_dir, attn_implementation=attn, max_tokens_per_mb=10_000)
    plain = make_engine(tiny_model_dir, attn_implementation=attn, max_tokens_per_mb=10_000, share_prompts=False)
    other = "eager" if attn == "sdpa" else "sdpa"
    noise = make_engine(tiny_model_dir, attn_implementation=other, max_tokens_per_mb=10_000, share_prompts=False)
    lp_s, ent_s = shared.compute_logprobs_and_entropy(batch)
    lp_p, ent_p = plain.compute_logprobs_and_entropy(batch)
    lp_n, ent_n = noise.compute_logprobs_and_entropy(batch)
    lp_floor = measure_noise_floor("logprobs", lp_p, lp_n)
    print(assert_within_noise(lp_s, lp_p, lp_floor, MULTIPLE))
    print(assert_within_noise(ent_s, ent_p, measure_noise_floor("entropy", ent_p, ent_n), MULTIPLE))
    only = shared.compute_logprobs(batch, only_loss_tokens=True)
    on_loss = [[a if m else 0.0 for a, m in zip(row, t.loss_mask)] for row, t in zip(lp_p, batch.trajectories)]
    print(assert_within_noise(only, on_loss, lp_floor, MULTIPLE, what="loss-token logprobs"))
    # Sensitivity: a mask that let suffixes see each other would change scores.
    leaky = build_tree_row([SharedChunk(9, (0, 1))], [list(range(4, 14)) + [20], list(range(4, 14)) + [21]], "cpu")
    assert leaky.attention_mask[0, 0, 11, 10] == False  # noqa: E712


@pytest.mark.parametrize("loss_fn", [ppo_like_loss, seq_mean_loss])
def test_shared_step_equals_plain_step(tiny_model_dir, loss_fn):
    batch = grouped_batch()
    extra = advantages_for(batch)
    a = make_engine(tiny_model_dir, max_tokens_per_mb=10_000, max_grad_norm=None, lr=1e-5)
    b = make_engine(tiny_model_dir, max_tokens_per_mb=10_000, max_grad_norm=None, lr=1e-5, share_prompts=False)
    c = make_engine(tiny_model_dir, max_tokens_per_mb=24, max_grad_norm=None, lr=1e-5)  # groups cut into chunks
    n = make_engine(tiny_model_dir, max_tokens_per_mb=10_000, max_grad_norm=None, lr=1e-5, share_prompts=False,
                    attn_implementation="eager")  # the floor: plain packing, the other attention kernel  # fmt: skip
    sa, sb, sc, sn = (e.train_batch(batch, loss_fn, extra) for e in (a, b, c, n))
    assert sa["n_model_tokens"] < 0.6 * sb["n_model_tokens"] and sb["n_model_tokens"] == sb["n_tokens"]
    assert sc["n_mbs"] > 1
    floors = {k: measure_noise_floor(k, sb[k], sn[k], relative=True) for k in ("loss", "grad_norm")}
    grad_floor = measure_noise_floor("gradients", grads_of(b), grads_of(n))
    for name, e, s in (("shared", a, sa), ("shared in chunks", c, sc)):
        for k in ("loss", "grad_norm"):
            print(assert_within_noise(s[k], sb[k], floors[k], MULTIPLE, what=f"{name} {k}"))
        print(assert_within_noise(grads_of(e), grads_of(b), grad_floor, MULTIPLE, what=f"{name} gradients"))
