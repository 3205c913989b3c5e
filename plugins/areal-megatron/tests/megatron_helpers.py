"""Helpers of the areal-megatron tests, imported by module name (a bare
``from conftest import`` resolves to whichever tests directory's conftest a
whole-suite run loaded first)."""

from __future__ import annotations

from typing import Any

from areal_kernel.algo.losses import make_ppo_loss_fn
from areal_kernel.testing.noise import (
    NoiseFloor,
    assert_within_noise,
    max_difference,
    measure_noise_floor,
    sum_rounding,
)
from areal_kernel.testing.rank_engines import ppo_step_inputs, random_batch

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
# STEP_BATCHES in a micro-batch of its own) and its other attention kernel
# (eager), which changes the summation order and nothing else. A Megatron
# layout changes more than the order (its own layer norm, rotary, fused qkv and
# loss kernels, the loss summed per rank/stage), all of it rounding: MULTIPLE x
# the floor, per quantity (``floors``). Measured, diff / floor, max over the
# quantities of each layout: AVX-512 (this machine) t2 1.5, d2t2p1 0.9, and
# the SmolLM2 layouts (t1, p2, d2: identical numbers) 1.2 (probe entropy:
# 1.1 of the reference's own float32 rounding, 4.6e-5 relative);
# ATEN_CPU_CAPABILITY=avx2: t2 2.3, SmolLM2 grad norm 4.3 (p2) and 3.3 (d2),
# probe entropy 1.0 (t1; the rounding there is 1.1e-4 relative: why a fixed
# 1e-4 failed on an AVX-512 CI machine). 8x leaves 1.9x headroom over the
# largest (4.3); a wrong reduction or a lost micro-batch is off by > 1e-2,
# hundreds of floors.
NOISE_MB = 13  # the longest sequence of STEP_BATCHES and of the probe
MULTIPLE = 8.0
STAT_KEYS = ("loss", "grad_norm", "lr", "entropy", "pg_loss", "n_loss_tokens")


def noise_cfg(cfg: dict[str, Any]) -> dict[str, Any]:
    assert cfg["max_tokens_per_mb"] != NOISE_MB
    return {**cfg, "max_tokens_per_mb": NOISE_MB, "attn_implementation": "eager"}


def run_steps(engine: Any, vocab: int) -> tuple[list[dict[str, float]], Any]:
    """The 4 steps of ``STEP_BATCHES``, then (logprobs, entropy) of a probe batch."""
    hist = []
    for seed, lengths in enumerate(STEP_BATCHES):
        batch = random_batch(lengths, seed=seed, vocab=vocab)
        hist.append(engine.train_batch(batch, LOSS, ppo_step_inputs(batch, engine)))
    probe = random_batch([10, 7, 12], seed=99, vocab=vocab)
    return hist, engine.compute_logprobs_and_entropy(probe)


def entropy_rounding(engine: Any, vocab: int) -> float:
    """The torch engine's own float32 rounding of the probe's per-token
    entropies: its formula (logsumexp - sum(softmax * z)) in float32 against
    float64 on the same logits, max relative difference. The sum over the
    vocabulary cancels (terms up to |logsumexp|, result 3-8 nats), so this is
    larger than ``sum_rounding(vocab)``, and it differs between CPUs."""
    import torch

    worst = 0.0
    device = next(engine.model.parameters()).device  # the engine's (a GPU in bench/gpu_check.py)
    for t in random_batch([10, 7, 12], seed=99, vocab=vocab).trajectories:
        with torch.no_grad():
            z = engine.model(torch.tensor([t.input_ids], device=device)).logits[0, :-1].float()
        e32 = torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)
        zd = z.double()
        e64 = torch.logsumexp(zd, -1) - (torch.softmax(zd, -1) * zd).sum(-1)
        worst = max(worst, float(((e32.double() - e64).abs() / e64.abs().clamp(min=1.0)).max()))
    return worst


def floors(
    ref: Any, noise: Any, ref_w: dict[str, Any], noise_w: dict[str, Any], vocab: int, ent_rounding: float
) -> dict[str, NoiseFloor]:
    """Per-quantity floors: the torch engine (``ref``) against itself with
    another micro-batch split and attention kernel (``noise``), both
    ``run_steps`` results.

    Logprobs (through a logsumexp) and entropies are float32 sums over the
    whole vocabulary, which the torch twin reduces in the same order as the
    reference: it cannot show that rounding, while Megatron's own loss kernel
    rounds each term differently. Measured: the torch engine's own mean
    entropy of a step moves by 1.3e-5 relative between AVX-512 and AVX2 (the
    twin on one CPU: 2e-7), Megatron's by 3e-7. Their floors are bounded
    below by ``sum_rounding(vocab)`` (1.3e-5 for SmolLM2's 49152 tokens), the
    per-token entropies also by the reference's own float32-vs-float64
    rounding of them (``entropy_rounding``)."""
    (ref_hist, (ref_lp, ref_ent)), (n_hist, (n_lp, n_ent)) = ref, noise
    vocab_sum = sum_rounding(vocab)
    out = {
        k: measure_noise_floor(k, [h[k] for h in ref_hist], [h[k] for h in n_hist], relative=True,
                               lower_bound=vocab_sum if k == "entropy" else 0.0)
        for k in STAT_KEYS
    }  # fmt: skip
    out["logprobs"] = measure_noise_floor("logprobs", ref_lp, n_lp, lower_bound=vocab_sum)
    # Entropies are 3-8 nats on SmolLM2's 49152-token vocabulary: relative.
    out["token_entropy"] = measure_noise_floor(
        "token_entropy", ref_ent, n_ent, relative=True, lower_bound=max(vocab_sum, ent_rounding)
    )
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
    cases = [(f"{name} {k} per step", [h[k] for h in hist], [h[k] for h in ref_hist], floor[k]) for k in STAT_KEYS]
    cases += [(f"{name} probe logprobs", lp, ref_lp, floor["logprobs"]),
              (f"{name} probe entropy", ent, ref_ent, floor["token_entropy"]),
              (f"{name} weights", weights, ref_w, floor["weights"])]  # fmt: skip
    ratios, failures = {}, []
    for what, a_, b_, fl in cases:
        try:
            ratios[what] = round(assert_within_noise(a_, b_, fl, MULTIPLE, what=what).ratio, 2)
        except AssertionError as e:  # every quantity is measured and printed before the first failure is raised
            failures.append(e)
            ratios[what] = round(max_difference(a_, b_, relative=fl.relative).value / fl.value, 2)
    print(
        name,
        "floors",
        {k: f"{f.value:.3g}" for k, f in floor.items()},
        "entropy rounding",
        floor["token_entropy"].lower_bound,
    )
    print(name, "diff / floor", ratios)
    if failures:
        raise failures[0]
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
