"""Megatron layouts against the kernel's single-process torch engine, all in
ONE launch of 2 real rank processes (gloo), re-initialising megatron-core's
parallel state between layouts:

- ``megatron:t2`` on a tiny Llama (SmolLM2-135M has 9 attention heads and 3
  KV heads: it cannot be split over 2 tensor-parallel ranks);
- ``megatron:p2`` and ``megatron:d2`` on SmolLM2-135M-Instruct itself.

Per layout, 4 optimizer steps (PPO loss, clipping active, linear schedule):
loss, grad norm, logprobs and the weights after the steps must match the
torch engine within ``MULTIPLE`` x a noise floor measured in the same run
(the torch engine with another micro-batch split and attention kernel;
``megatron_helpers``);
a wrong reduction or a lost micro-batch is off by > 1e-2. The t2 engine
also checks save -> load -> identical steps
through megatron's distributed checkpointing, and the p2 engine the HF
export (streamed from both pipeline stages) against the torch engine's."""

from __future__ import annotations

import gc
import os
import shutil

import pytest
from megatron_helpers import (
    CFG,
    LOSS,
    MULTIPLE,
    SMOL_CFG,
    check_against_torch,
    entropy_rounding,
    floors,
    noise_cfg,
    run_steps,
)

from areal_kernel.engine.torch_engine import TorchTrainEngine
from areal_kernel.testing.noise import assert_within_noise
from areal_kernel.testing.rank_engines import state_round_trip

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_dir():
    from areal_kernel.models.resolve import resolve_model_path

    return resolve_model_path("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def results(rank_pool, tiny_model_dir, smollm2_dir, tmp_path_factory):
    """Every layout trained once; the torch references, and per model the
    floors (the torch engine again with another micro-batch split), too."""
    out = {}
    scratch: list[str] = []
    for alloc, model_dir, vocab in (("megatron:t2", tiny_model_dir, 256), ("megatron:p2", smollm2_dir, 49152),
                                     ("megatron:d2", smollm2_dir, 49152)):  # fmt: skip
        ref_key = model_dir
        cfg = CFG if model_dir == tiny_model_dir else SMOL_CFG
        if ref_key not in out:
            ref = TorchTrainEngine(cfg)
            ref.initialize(model_dir, 10)
            ref_run, ref_w = run_steps(ref, vocab), dict(ref.named_weights_for_transfer())
            noise = TorchTrainEngine(noise_cfg(cfg))
            noise.initialize(model_dir, 10)
            noise_run = run_steps(noise, vocab)
            floor = floors(
                ref_run, noise_run, ref_w, dict(noise.named_weights_for_transfer()), vocab, entropy_rounding(ref, vocab)
            )
            del noise  # before any Megatron rank builds on SmolLM2: the two never share memory
            gc.collect()
            out[ref_key] = (ref_run, ref_w, ref, floor)
        eng = rank_pool.build(cfg, alloc, model_dir, 10)
        out[alloc] = (run_steps(eng, vocab), eng.full_weights())
        extra = {}
        if alloc == "megatron:t2":
            scratch.append(str(tmp_path_factory.mktemp("ckpt")))
            extra["ckpt"] = state_round_trip(eng, os.path.join(scratch[-1], "state"), LOSS)
        if alloc == "megatron:p2":
            d = str(tmp_path_factory.mktemp("export"))
            scratch.append(d)
            eng.save_hf(os.path.join(d, "meg"), max_shard_bytes=64 << 20)
            out[ref_key][2].save_hf(os.path.join(d, "ref"))
            extra["export"] = d
        out[alloc] += (extra,)
    yield out
    # Two SmolLM2 exports and a checkpoint (~1.1 GB): gone with the module, not at the session's end.
    for d in scratch:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("alloc", ["megatron:t2", "megatron:p2", "megatron:d2"])
def test_layout_matches_the_torch_engine(results, alloc, tiny_model_dir, smollm2_dir):
    model_dir = tiny_model_dir if alloc == "megatron:t2" else smollm2_dir
    ref, ref_w, _, floor = results[model_dir]
    got, weights, _ = results[alloc]
    clip = (CFG if alloc == "megatron:t2" else SMOL_CFG)["max_grad_norm"]
    check_against_torch(alloc, got, ref, weights, ref_w, floor, 2, clip)


def test_dist_checkpoint_continues_identically(results):
    trip = results["megatron:t2"][2]["ckpt"]
    assert os.path.isdir(os.path.join(trip.ckpt, "model"))
    trip.assert_continues_identically()


def test_hf_export_from_two_stages_equals_the_torch_engines(results, smollm2_dir):
    import glob

    from safetensors.torch import load_file

    d = results["megatron:p2"][2]["export"]
    got, want = {}, {}
    for f in glob.glob(os.path.join(d, "meg", "*.safetensors")):
        got.update(load_file(f))
    for f in glob.glob(os.path.join(d, "ref", "*.safetensors")):
        want.update(load_file(f))
    assert len(glob.glob(os.path.join(d, "meg", "*.safetensors"))) > 1  # streamed in several files
    assert set(got) == set(want) and "lm_head.weight" not in got
    # The torch engine's export is its weights: the same floor as the weights.
    assert_within_noise(got, want, results[smollm2_dir][3]["weights"], MULTIPLE, what="p2 HF export")
    assert os.path.isfile(os.path.join(d, "meg", "config.json")) and os.path.isfile(
        os.path.join(d, "meg", "tokenizer_config.json")
    )
