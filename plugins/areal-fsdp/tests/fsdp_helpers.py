"""Helpers of the areal-fsdp tests."""

from __future__ import annotations


def random_batch(
    lengths: list[int], seed: int = 0, prompt_len: int = 3, vocab: int = 256, shared_prompts: bool = False
):
    """Trajectories of random tokens; consecutive pairs form a GRPO group
    (with ``shared_prompts`` the pair also shares its first ``prompt_len`` tokens)."""
    import random

    from areal_kernel.api.io import Trajectory, TrajectoryBatch

    rng = random.Random(seed)
    trajs = []
    for k, n in enumerate(lengths):
        p = min(prompt_len, n - 1)
        ids = [rng.randrange(4, vocab) for _ in range(n)]
        if shared_prompts and k % 2 == 1 and len(trajs[-1].input_ids) > p:
            ids[:p] = trajs[-1].input_ids[:p]
        trajs.append(
            Trajectory(
                input_ids=ids,
                loss_mask=[0] * p + [1] * (n - p),
                logprobs=[0.0] * p + [-rng.uniform(3.0, 8.0) for _ in range(n - p)],
                versions=[-1] * p + [0] * (n - p),
                reward=float(k % 2),
                group_id=f"g{k // 2}",
            )
        )
    return TrajectoryBatch(trajs)


def ppo_step_inputs(batch, engine):
    """GRPO-style extras: +1/-1 advantages by reward, proximal logprobs from ``engine``."""
    adv = [[(1.0 if t.reward > 0 else -1.0) * m for m in t.loss_mask] for t in batch.trajectories]
    return {"advantages": adv, "prox_logprobs": engine.compute_logprobs(batch, only_loss_tokens=True)}


def forward_floor(model_dir: str, weights: dict, ids: list[int], start: int):
    """The noise floor of a comparison with these weights' logprobs of
    ``ids[start:]``: transformers' forward with sdpa against eager attention
    (``areal_kernel.testing.noise``)."""
    import torch
    from transformers import AutoModelForCausalLM

    from areal_kernel.testing.noise import measure_noise_floor

    rows = []
    for attn in ("sdpa", "eager"):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn).eval()
        model.load_state_dict(weights, strict=False)  # a tied lm_head is not in the transfer names
        with torch.no_grad():
            logp = model(torch.tensor([ids])).logits[0].log_softmax(-1)
        rows.append([logp[i - 1, ids[i]].item() for i in range(start, len(ids))])
    return measure_noise_floor("logprobs, same weights", rows[0], rows[1])
