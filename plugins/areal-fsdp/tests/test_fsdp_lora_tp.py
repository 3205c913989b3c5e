"""LoRA on tensor-parallel ranks (``fsdp:t2``: 2 tensor ranks; ``fsdp:d2t2``:
2 FSDP replicas x 2 tensor ranks; gloo) against the kernel's
single-process torch engine with the same adapter on a tiny Llama: adapters
on column-wise (q, k, up) and row-wise (o, down) projections, split with
their base layers (``areal_fsdp.tensor_parallel.module_plan``). The same 4
steps give the same losses, grad norms, logprobs and adapter weights within
a noise floor measured here (the torch engine against itself with other
micro-batch splits); the adapter and merged exports equal the torch engine's; a DCP
checkpoint (the adapter's shards only) resumes identically. Negative
control: the weight check fails against a reference trained at 1.05x the
learning rate. One engine per layout for the whole module."""

from __future__ import annotations

import json
import os

import pytest
from fsdp_parity_helpers import STAT_KEYS, step_batches
from safetensors.torch import load_file

from areal_kernel.algo.losses import make_ppo_loss_fn
from areal_kernel.engine.torch_engine import TorchTrainEngine
from areal_kernel.testing.noise import assert_within_noise, measure_noise_floor
from areal_kernel.testing.rank_engines import ppo_step_inputs, random_batch, state_round_trip

pytestmark = pytest.mark.slow

# test_fsdp_lora's adapter and lr, with clipping active (the grad norm over
# the adapters' DTensor shards decides the factor) and a decaying schedule.
LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "k_proj", "o_proj", "up_proj", "down_proj"]}
CFG = {"lr": 1e-2, "max_tokens_per_mb": 20, "max_grad_norm": 1.0, "lr_scheduler": "linear",
       "warmup_steps_proportion": 0.2, "lora": LORA}  # fmt: skip
# The floor is the largest of three other micro-batch splits: Adam at lr 1e-2
# turns rounding of near-zero adapter gradients into lr-sized steps, and one
# split samples that thinly (measured after the 4 steps, weights: 7.5e-6,
# 2.8e-5 and 1.2e-5 for the splits below, the t2 ranks 2.4e-5; grad norm
# relative 4.8e-7, 1.5e-6, 2.2e-6, the ranks 1.9e-6).
NOISE_SPLITS = (13, 11, 17)
LOSS = make_ppo_loss_fn(eps_clip=0.2, behav_imp_weight_cap=5.0)
# Two tensor ranks add the adapters' partial products in another order than
# one process: rounding like a micro-batch split (test_fsdp_lora's and
# test_fsdp_tp's multiple). A lora_B split the wrong way, or a replicated
# adapter counted twice in the grad norm, lands far beyond it.
MULTIPLE = 4.0


COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")


def _diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.fixture(scope="module", params=["fsdp:t2", "fsdp:d2t2"])
def trained(request, tiny_model_dir):
    """The split engine, the torch reference and the floors, after the 4 steps."""
    from areal_fsdp.engine import FSDPTrainEngine

    tp = FSDPTrainEngine(CFG, allocation=request.param)
    tp.initialize(tiny_model_dir, 10)
    init = dict(tp.full_weights())
    ref = TorchTrainEngine(CFG)
    noises = [TorchTrainEngine({**CFG, "max_tokens_per_mb": mb}) for mb in NOISE_SPLITS]
    for e in (ref, *noises):
        e.initialize(tiny_model_dir, 10)
    try:
        history, noise_history = [], []
        for batch in step_batches():
            history.append(tuple(e.train_batch(batch, LOSS, ppo_step_inputs(batch, e)) for e in (tp, ref)))
            noise_history.append([e.train_batch(batch, LOSS, ppo_step_inputs(batch, e)) for e in noises])
        probe = random_batch([10, 7, 12], seed=99)
        lp_r, ent_r = ref.compute_logprobs_and_entropy(probe)
        w_r = dict(ref.named_weights_for_transfer())
        floor = {}
        for i, noise in enumerate(noises):
            lp_n, ent_n = noise.compute_logprobs_and_entropy(probe)
            got = {k: measure_noise_floor(k, [b[k] for _, b in history], [c[i][k] for c in noise_history], relative=True)
                   for k in STAT_KEYS}  # fmt: skip
            got["logprobs"] = measure_noise_floor("logprobs", lp_r, lp_n)
            got["token_entropy"] = measure_noise_floor("token_entropy", ent_r, ent_n)
            got["weights"] = measure_noise_floor("weights", w_r, dict(noise.named_weights_for_transfer()))
            floor = {k: max(f, floor.get(k, f), key=lambda x: x.value) for k, f in got.items()}
        yield tp, ref, init, history, floor, noises
    finally:
        tp.destroy()


def test_adapters_are_split_with_their_base_layers(trained, tiny_model_dir):
    """Same peft init as one process (before splitting); each tensor rank
    holds half of every split matrix: the base projections, lora_B of the
    column-wise ones, lora_A of the row-wise ones, and the (frozen) embedding
    by vocabulary rows."""
    tp, ref, init, *_ = trained
    init_ref = TorchTrainEngine(CFG)
    init_ref.initialize(tiny_model_dir, 10)
    assert _diff(init, dict(init_ref.named_weights_for_transfer())) == 0.0
    assert tp.adapter_spec() == ref.adapter_spec()
    assert [n for n, _ in tp.named_weights_for_transfer()] == [n for n, _ in ref.named_weights_for_transfer()]
    whole = split = 0
    for name, p in init_ref.model.named_parameters():
        size = p.numel() * p.element_size()
        whole += size
        col, row = (any(f".{m}." in name for m in ms) for ms in (COLWISE, ROWWISE))
        lora_a, lora_b = ".lora_A." in name, ".lora_B." in name
        # The frozen tied embedding / LM head (named once) is split by vocabulary rows.
        vocab = name.endswith(("embed_tokens.weight", "lm_head.weight"))
        if (col and not lora_a) or (row and not lora_b) or vocab:
            split += size
    # Summed over the ranks: the split matrices once, the rest once per tensor rank.
    assert split > 0 and sum(tp.rank_param_bytes) == 2 * whole - split
    if tp.layout.dp == 1:
        assert tp.rank_param_bytes == [whole - split // 2] * 2


def test_steps_match_single_process(trained):
    _, _, _, history, floor, _ = trained
    for a, b in history:
        assert a["skipped"] == b["skipped"] == 0.0
    for k in STAT_KEYS:
        print(assert_within_noise([a[k] for a, _ in history], [b[k] for _, b in history], floor[k], MULTIPLE))
    assert max(b["grad_norm"] for _, b in history) > CFG["max_grad_norm"]  # clipping happened


def test_adapter_and_scores_match_after_the_steps(trained):
    tp, ref, init, _, floor, _ = trained
    got = dict(tp.full_weights())
    want = dict(ref.named_weights_for_transfer())
    assert all(got[k].shape == want[k].shape for k in want)  # gathered to whole adapter matrices
    print(assert_within_noise(got, want, floor["weights"], MULTIPLE))
    assert _diff(got, init) > 1e-3  # it did train
    probe = random_batch([10, 7, 12], seed=99)
    lp_t, ent_t = tp.compute_logprobs_and_entropy(probe)
    lp_r, ent_r = ref.compute_logprobs_and_entropy(probe)
    print(assert_within_noise(lp_t, lp_r, floor["logprobs"], MULTIPLE))
    print(assert_within_noise(ent_t, ent_r, floor["token_entropy"], MULTIPLE))


def test_weight_check_fails_against_another_learning_rate(trained, tiny_model_dir):
    """Negative control: the adapter comparison above can fail."""
    tp, _, _, _, floor, _ = trained
    other = TorchTrainEngine({**CFG, "lr": CFG["lr"] * 1.05})
    other.initialize(tiny_model_dir, 10)
    for batch in step_batches():
        other.train_batch(batch, LOSS, ppo_step_inputs(batch, other))
    with pytest.raises(AssertionError, match="weights"):
        assert_within_noise(tp.full_weights(), dict(other.named_weights_for_transfer()), floor["weights"], MULTIPLE)


def test_adapter_export_equals_single_process(trained, tmp_path):
    tp, ref, _, _, floor, _ = trained
    tp.save_hf(str(tmp_path / "tp"))
    ref.save_hf(str(tmp_path / "ref"))
    files = sorted(os.listdir(tmp_path / "ref"))
    assert sorted(os.listdir(tmp_path / "tp")) == files and "adapter_model.safetensors" in files

    def read(d: str) -> tuple[dict, dict]:
        with open(tmp_path / d / "adapter_config.json") as f:
            return json.load(f), load_file(str(tmp_path / d / "adapter_model.safetensors"))

    (cfg_t, w_t), (cfg_r, w_r) = read("tp"), read("ref")
    assert cfg_t == cfg_r
    print(assert_within_noise(w_t, w_r, floor["weights"], MULTIPLE, what="adapter export"))


def test_merged_export_equals_single_process(trained, tmp_path, tiny_model_dir):
    """``lora.export: merged``: each base weight gathered from its tensor
    shards with its adapter and merged on rank 0. The floor: the torch
    engine's merged exports after the other micro-batch splits."""
    from areal_kernel.testing.recovery import load_weights

    tp, ref, _, _, _, noises = trained

    def merged(engine, name: str) -> dict:
        lora = engine.config.lora
        engine.config = engine.config.model_copy(update={"lora": lora.model_copy(update={"export": "merged"})})
        try:
            engine.save_hf(str(tmp_path / name))
        finally:
            engine.config = engine.config.model_copy(update={"lora": lora})
        return load_weights(str(tmp_path / name))

    want = merged(ref, "ref")
    floor = max(
        (measure_noise_floor("merged weights", want, merged(n, f"noise{i}")) for i, n in enumerate(noises)),
        key=lambda f: f.value,
    )
    got = merged(tp, "tp")
    print(assert_within_noise(got, want, floor, MULTIPLE, what="merged export"))
    base = load_weights(tiny_model_dir)
    assert set(got) == set(base) and _diff(got, base) > 1e-3  # the adapter is in it


def test_dcp_round_trip_continues_identically(trained, tmp_path):
    """The checkpoint holds the adapter's shards and their moments only."""
    from torch.distributed.checkpoint import FileSystemReader

    tp = trained[0]
    trip = state_round_trip(tp, str(tmp_path / "state"), LOSS)
    keys = list(FileSystemReader(os.path.join(trip.ckpt, "dcp")).read_metadata().state_dict_metadata)
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys), model_keys
    trip.assert_continues_identically()
