"""Helpers of the areal-megatron tests, imported by module name (a bare
``from conftest import`` resolves to whichever tests directory's conftest a
whole-suite run loaded first)."""

from __future__ import annotations

import os
import sys
from typing import Any

from areal_kernel.algo.losses import make_ppo_loss_fn
from areal_kernel.testing.noise import NoiseFloor, assert_within_noise, measure_noise_floor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "areal-fsdp", "tests"))
from fsdp_helpers import ppo_step_inputs, random_batch  # noqa: E402

# The parity comparison shared by test_megatron_parity and test_megatron_layouts:
# 4 optimizer steps (PPO loss, clipping active, linear schedule) of a layout
# against the single-process torch engine.
CFG = {"lr": 1e-3, "max_tokens_per_mb": 24, "max_grad_norm": 1.0, "lr_scheduler": "linear",
       "warmup_steps_proportion": 0.2, "weight_decay": 0.01, "share_prompts": False}  # fmt: skip
STEP_BATCHES = [[7, 9, 5, 12], [11, 6, 9], [9], [13, 6, 8, 10]]  # [9]: one replica of d2 gets nothing
# SmolLM2 (a trained model) with lr 1e-3 lets Adam turn 1e-6 rounding
# differences into 1e-3 changes within 4 steps; 1e-4 keeps the comparison about
# the engine, not about how chaotic such steps are.
SMOL_CFG = {**CFG, "lr": 1e-4, "max_grad_norm": 0.5}  # its grad norms are ~0.6: clipping stays active
LOSS = make_ppo_loss_fn(eps_clip=0.2, behav_imp_weight_cap=5.0)

# The noise floor (areal_kernel.testing.noise), measured in the same test: the
# torch engine again with another micro-batch split (every sequence of
# STEP_BATCHES in a micro-batch of its own), which sums the same numbers in
# another order and changes nothing else. A Megatron layout changes more than
# the order (its own layer norm, rotary and fused-qkv kernels, the loss summed
# per rank/stage), all of it rounding: MULTIPLE x the floor, per quantity.
# MULTIPLE_NOTE
NOISE_MB = 13  # the longest sequence of STEP_BATCHES and of the probe
MULTIPLE = 8.0
STAT_KEYS = ("loss", "grad_norm", "lr", "entropy", "pg_loss", "n_loss_tokens")


def noise_cfg(cfg: dict[str, Any]) -> dict[str, Any]:
    assert cfg["max_tokens_per_mb"] != NOISE_MB
    return {**cfg, "max_tokens_per_mb": NOISE_MB}


def max_diff(a: Any, b: Any) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def run_steps(engine: Any, vocab: int) -> tuple[list[dict[str, float]], Any]:
    """The 4 steps of ``STEP_BATCHES``, then (logprobs, entropy) of a probe batch."""
    hist = []
    for seed, lengths in enumerate(STEP_BATCHES):
        batch = random_batch(lengths, seed=seed, vocab=vocab)
        hist.append(engine.train_batch(batch, LOSS, ppo_step_inputs(batch, engine)))
    probe = random_batch([10, 7, 12], seed=99, vocab=vocab)
    return hist, engine.compute_logprobs_and_entropy(probe)


def floors(ref: Any, noise: Any, ref_w: dict[str, Any], noise_w: dict[str, Any]) -> dict[str, NoiseFloor]:
    """Per-quantity floors: the torch engine (``ref``) against itself with
    another micro-batch split (``noise``), both ``run_steps`` results."""
    (ref_hist, (ref_lp, ref_ent)), (n_hist, (n_lp, n_ent)) = ref, noise
    out = {
        k: measure_noise_floor(k, [h[k] for h in ref_hist], [h[k] for h in n_hist], relative=True) for k in STAT_KEYS
    }
    out["logprobs"] = measure_noise_floor("logprobs", ref_lp, n_lp)
    # Entropies are 3-8 nats on SmolLM2's 49152-token vocabulary: relative.
    out["token_entropy"] = measure_noise_floor("token_entropy", ref_ent, n_ent, relative=True)
    out["weights"] = measure_noise_floor("weights", ref_w, noise_w)
    return out


def check_against_torch(
    name: str, got: Any, ref: Any, weights: dict[str, Any], ref_w: dict[str, Any], floor: dict[str, NoiseFloor],
    n_ranks: int, clip: float,
) -> dict[str, float]:  # fmt: skip
    """Assert that a layout's ``run_steps`` result and weights equal the torch
    engine's within ``MULTIPLE`` x the floors; returns each quantity's
    difference in floors (printed, for the record)."""
    (ref_hist, (ref_lp, ref_ent)), (hist, (lp, ent)) = ref, got
    for a, b in zip(hist, ref_hist):
        assert a["skipped"] == b["skipped"] == 0.0 and a["n_ranks"] == float(n_ranks)
    assert max(b["grad_norm"] for b in ref_hist) > clip  # clipping happened
    checks = [assert_within_noise([h[k] for h in hist], [h[k] for h in ref_hist], floor[k], MULTIPLE,
                                  what=f"{name} {k} per step") for k in STAT_KEYS]  # fmt: skip
    checks.append(assert_within_noise(lp, ref_lp, floor["logprobs"], MULTIPLE, what=f"{name} probe logprobs"))
    checks.append(assert_within_noise(ent, ref_ent, floor["token_entropy"], MULTIPLE, what=f"{name} probe entropy"))
    checks.append(assert_within_noise(weights, ref_w, floor["weights"], MULTIPLE, what=f"{name} weights"))
    ratios = {c.what: round(c.ratio, 2) for c in checks}
    print(name, "floors", {k: f"{f.value:.3g}" for k, f in floor.items()})
    print(name, "diffs", {c.what: f"{c.diff.value:.3g}" for c in checks})
    print(name, "diff / floor", ratios)
    return ratios


def make_tiny_qwen(path: str, model_type: str, seed: int = 0) -> str:
    """A random-init Qwen2 (qkv biases) or Qwen3 (q/k norms, explicit head_dim)
    from its real ``transformers`` config class, untied embeddings."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    if model_type == "qwen2":
        cfg, cls = Qwen2Config(**common), Qwen2ForCausalLM
    else:
        cfg, cls = Qwen3Config(head_dim=24, **common), Qwen3ForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(cfg)
        with torch.no_grad():
            for p in model.parameters():  # norms and biases non-trivial too
                p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path, safe_serialization=True)
    return path
