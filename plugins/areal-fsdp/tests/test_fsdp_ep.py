"""Expert parallelism in the fsdp engine (``fsdp:d2e2``: 2 ranks over gloo,
each holding 2 of the 4 experts of every MoE layer; tokens travel to their
experts by all-to-all) against the kernel's single-process torch engine on a
tiny random Qwen3-MoE (hidden 64, 2 sparse layers, 4 experts, top-2): the
same 4 steps give the same losses, grad norms, logprobs, entropies and
weights within a noise floor measured here (the torch engine against itself
with another micro-batch split); the router metrics are reported and the
load-balancing loss equals transformers' ``load_balancing_loss_func``; the
HF export and ``full_weights`` equal the single-process weights; a DCP
checkpoint resumes identically. Negative control: the weight check fails
against a reference trained at 1.05x the learning rate."""

from __future__ import annotations

import os

import pytest
import torch
from fsdp_parity_helpers import (
    CFG,
    MULTIPLE,
    NOISE_CFG,
    STAT_KEYS,
    STEP_BATCHES,
    LOSS,
    assert_weight_check_fails_at_other_lr,
    step_batch,
    step_batches,
)
from safetensors.torch import load_file

from areal_kernel.engine.torch_engine import TorchTrainEngine
from areal_kernel.testing.noise import assert_within_noise, measure_noise_floor
from areal_kernel.testing.rank_engines import (
    RankEngineWeightUpdateSuite,
    random_batch,
    state_round_trip,
    train_beside_references,
)

pytestmark = pytest.mark.slow

N_EXPERTS, TOP_K = 4, 2


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> str:
    from areal_kernel.testing.models import make_tiny_qwen3_moe

    return make_tiny_qwen3_moe(str(tmp_path_factory.mktemp("tiny-moe")), experts=N_EXPERTS, top_k=TOP_K)


@pytest.fixture(scope="module")
def trained(moe_model):
    """One fsdp:d2e2 engine trained 4 steps beside the torch engine (shared by every test here)."""
    from areal_fsdp.engine import FSDPTrainEngine

    ep = FSDPTrainEngine(CFG, allocation="fsdp:d2e2")
    ep.initialize(moe_model, 10)
    try:
        ref, history, floor = train_beside_references(ep, CFG, NOISE_CFG, moe_model, step_batches(), LOSS, STAT_KEYS)
        yield ep, ref, history, floor
    finally:
        ep.destroy()


def test_layout_experts_and_memory(trained):
    """Rank r holds experts [2r, 2r+2) of every layer and half of the rest
    (FSDP): the two ranks together hold each weight exactly once."""
    ep, ref, history, _ = trained
    assert str(ep.layout) == "fsdp:d2e2" and str(ep.allocation) == "fsdp:d2e2"
    assert ep.world_size == ep.data_parallel_size == 2
    assert [ep.layout.rank_coords(r) for r in range(2)] == [{"d": 0, "e": 0}, {"d": 1, "e": 1}]
    assert ep.rank_experts == [[0, 2], [2, 4]]
    total = sum(p.numel() * p.element_size() for p in ref.model.parameters())
    assert sum(ep.rank_param_bytes) == total
    print(f"\nparameter bytes per rank {ep.rank_param_bytes}, one process {total}")
    for a, _ in history:
        assert a["n_ranks"] == 2.0


def test_steps_match_single_process(trained):
    _, _, history, floor = trained
    for a, b in history:
        assert a["skipped"] == b["skipped"] == 0.0
    for k in STAT_KEYS:
        print(assert_within_noise([a[k] for a, _ in history], [b[k] for _, b in history], floor[k], MULTIPLE))
    assert max(b["grad_norm"] for _, b in history) > CFG["max_grad_norm"]  # clipping happened
    for a, _ in history:
        shares = [a[f"moe_load_e{i}"] for i in range(N_EXPERTS)]
        assert sum(shares) == pytest.approx(1.0) and max(shares) == a["moe_load_max"]
        assert a["moe_load_imbalance"] == pytest.approx(a["moe_load_max"] * N_EXPERTS)
        assert not any(k.startswith("_moe") for k in a)  # the ranks' raw sums are turned into metrics
    print({k: round(v, 4) for k, v in history[0][0].items() if k.startswith("moe_")})


def test_aux_loss_is_transformers_load_balancing_loss(trained, moe_model):
    """Step 0's ``moe_aux_loss`` (summed by the ranks during training, before
    the first update) equals transformers' ``load_balancing_loss_func`` over
    the same tokens on the initial weights (each sequence run alone with
    ``output_router_logits``); floor: the same with eager attention."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    _, _, history, _ = trained
    batch = step_batch(0, STEP_BATCHES[0])  # no shared prompts: every token runs through the router once
    aux = []
    for attn in ("sdpa", "eager"):
        model = AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32, attn_implementation=attn).eval()
        per_layer: list[list[torch.Tensor]] = []
        with torch.no_grad():
            for t in batch.trajectories:
                out = model(torch.tensor([t.input_ids]), output_router_logits=True, use_cache=False)
                per_layer.append(list(out.router_logits))
        layers = tuple(torch.cat([seq[i] for seq in per_layer]) for i in range(len(per_layer[0])))
        aux.append(float(load_balancing_loss_func(layers, N_EXPERTS, TOP_K)))
    floor = measure_noise_floor("moe_aux_loss", aux[0], aux[1], relative=True)
    print(assert_within_noise(history[0][0]["moe_aux_loss"], aux[0], floor, MULTIPLE))


def test_scores_and_weights_match_after_the_steps(trained, moe_model):
    ep, ref, _, floor = trained
    probe = random_batch([10, 7, 12], seed=99)
    lp_e, ent_e = ep.compute_logprobs_and_entropy(probe)
    lp_r, ent_r = ref.compute_logprobs_and_entropy(probe)
    print(assert_within_noise(lp_e, lp_r, floor["logprobs"], MULTIPLE))
    print(assert_within_noise(ent_e, ent_r, floor["token_entropy"], MULTIPLE))
    got = ep.full_weights()
    want = dict(ref.named_weights_for_transfer())
    assert set(got) == set(want)
    assert got["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == N_EXPERTS  # gathered from both ranks
    assert all(got[k].shape == want[k].shape for k in want)
    print(assert_within_noise(got, want, floor["weights"], MULTIPLE))
    from transformers import AutoModelForCausalLM

    init = AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32).state_dict()
    assert all(not torch.equal(got[k], init[k]) for k in got if ".experts." in k)  # every expert shard trained
    assert ep.step == ref.step == len(STEP_BATCHES)


def test_weight_check_fails_against_another_learning_rate(trained, moe_model):
    """Negative control: the comparison above can fail."""
    ep, _, _, floor = trained
    assert_weight_check_fails_at_other_lr(ep, moe_model, floor["weights"])


def test_hf_export_equals_single_process(trained, tmp_path):
    ep, ref, _, floor = trained
    ref.save_hf(str(tmp_path / "ref"))
    ep.save_hf(str(tmp_path / "ep"), max_shard_bytes=40 << 10)  # several files, expert tensors gathered per file
    files = [f for f in sorted(os.listdir(tmp_path / "ep")) if f.endswith(".safetensors")]
    assert len(files) > 1
    got = {}
    for f in files:
        got.update(load_file(str(tmp_path / "ep" / f)))
    want = load_file(str(tmp_path / "ref" / "model.safetensors"))
    assert set(got) == set(want)
    print(assert_within_noise(got, want, floor["weights"], MULTIPLE, what="HF export weights"))
    again = TorchTrainEngine(CFG)
    again.initialize(str(tmp_path / "ep"), 10)
    probe = random_batch([9, 12, 7], seed=5)
    print(assert_within_noise(again.compute_logprobs(probe), ep.compute_logprobs(probe), floor["logprobs"], MULTIPLE))


def test_dcp_round_trip_continues_identically(trained, tmp_path):
    ep, _, _, _ = trained
    trip = state_round_trip(ep, str(tmp_path / "state"), LOSS)
    assert trip.loaded_step == len(STEP_BATCHES)
    trip.assert_continues_identically()


class TestExpertParallelWeightUpdate(RankEngineWeightUpdateSuite):
    """The in-memory broadcast from 2 expert ranks into a real embedded
    server serving the tiny Qwen3-MoE (the kernel's suite): rank 0 gathers
    each expert tensor from its owners and sends; the server then computes
    what the ranks hold, and the weight-delivery check samples the experts
    where they live."""

    ENGINE_NAME = "fsdp"

    @pytest.fixture(scope="class")
    def tiny_model_dir(self, moe_model):
        return moe_model  # the server serves the model the engine holds

    @pytest.fixture
    def update_engine(self, trained):
        return trained[0]
