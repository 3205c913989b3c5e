"""The two layouts the 2-rank parity test cannot reach, against the kernel's
single-process torch engine with the parity test's batches, loss, config and
noise-floor rule (``megatron_helpers``):

- ``megatron:t1``: one rank (Megatron with no parallelism at all) on
  SmolLM2-135M-Instruct;
- ``megatron:d2t2p1``: 4 ranks, 2 data-parallel replicas of 2 tensor-parallel
  ranks, on the tiny Llama (4 heads / 2 KV heads split over t2).

The world sizes differ (1 and 4), so each layout is one launch of its own
ranks; each engine is destroyed as soon as its numbers are in, before the
torch reference runs (measured peak: 4.8 GiB resident for this process and
the SmolLM2 rank together), and the module's finalizer stops any
left behind by a failure."""

from __future__ import annotations

import gc

import pytest
from megatron_helpers import CFG, SMOL_CFG, check_against_torch, entropy_rounding, floors, noise_cfg, run_steps

from areal_kernel.engine.torch_engine import TorchTrainEngine

pytestmark = [pytest.mark.slow]

# allocation, world size, model fixture, vocabulary, engine config
LAYOUTS = [
    ("megatron:t1", 1, "smollm2", 49152, SMOL_CFG),
    ("megatron:d2t2p1", 4, "tiny", 256, CFG),
]


@pytest.fixture(scope="module")
def engines():
    """Every Megatron engine the module builds; destroyed at its end."""
    made: list = []
    yield made
    for e in made:
        e.destroy()


@pytest.fixture(scope="module")
def results(engines, tiny_model_dir):
    from areal_kernel.models.resolve import resolve_model_path
    from areal_megatron.engine import MegatronTrainEngine

    models = {"smollm2": resolve_model_path("smollm2-135m-instruct"), "tiny": tiny_model_dir}
    out = {}
    for alloc, _, model, vocab, cfg in LAYOUTS:
        # The Megatron ranks first, gone before the torch reference starts: the
        # SmolLM2 rank (~4 GB with Adam state) and a reference engine in this
        # process never hold memory at the same time.
        eng = MegatronTrainEngine(cfg, alloc)
        engines.append(eng)
        eng.initialize(models[model], 10)
        got = (run_steps(eng, vocab), eng.full_weights())
        eng.destroy()
        ref = TorchTrainEngine(cfg)
        ref.initialize(models[model], 10)
        ref_run, ref_w = run_steps(ref, vocab), dict(ref.named_weights_for_transfer())
        ent_rounding = entropy_rounding(ref, vocab)
        del ref  # its optimizer state goes; the weights stay referenced by ref_w
        gc.collect()
        noise = TorchTrainEngine(noise_cfg(cfg))  # the floor: the reference with another micro-batch split
        noise.initialize(models[model], 10)
        floor = floors(
            ref_run, run_steps(noise, vocab), ref_w, dict(noise.named_weights_for_transfer()), vocab, ent_rounding
        )
        del noise
        gc.collect()
        out[alloc] = ((ref_run, ref_w), *got, floor)
    return out


@pytest.mark.parametrize("alloc,world,clip", [(a, w, c["max_grad_norm"]) for a, w, _, _, c in LAYOUTS])
def test_layout_matches_the_torch_engine(results, alloc, world, clip):
    (ref, ref_w), got, weights, floor = results[alloc]
    check_against_torch(alloc, got, ref, weights, ref_w, floor, world, clip)
