"""Context parallelism in the fsdp engine (``fsdp:c2``: every micro-batch's
row split along the sequence over 2 ranks; ``fsdp:d2c2``: 2 FSDP replicas x
2 context ranks, 4 processes over gloo) against the kernel's single-process
torch engine on the conftest's tiny Llama (4 heads over 2 kv heads: the
context attention repeats the key/value heads): the same 4 steps give the
same losses, grad norms, logprobs, entropies and weights within a noise
floor measured here (the torch engine against itself with another
micro-batch split); rows of every length (padded to a multiple of c) score
as one process does; the HF export equals the single-process one; a DCP
checkpoint resumes identically. Negative control: the same weight check
fails against a reference trained with another learning rate."""

from __future__ import annotations

import os

import pytest
import torch
from fsdp_parity_helpers import (
    CFG,
    LOSS,
    MULTIPLE,
    NOISE_CFG,
    STAT_KEYS,
    STEP_BATCHES,
    assert_weight_check_fails_at_other_lr,
    step_batches,
)
from safetensors.torch import load_file

from areal_kernel.engine.torch_engine import TorchTrainEngine
from areal_kernel.testing.noise import assert_within_noise
from areal_kernel.testing.rank_engines import random_batch, state_round_trip, train_beside_references

pytestmark = pytest.mark.slow

# CFG, NOISE_CFG, STEP_BATCHES, LOSS, STAT_KEYS and MULTIPLE: fsdp_parity_helpers (shared with
# test_fsdp_pp / test_fsdp_tp / test_fsdp_ep). Why MULTIPLE holds here:
# The context ranks compute each query's attention over the same keys as one
# process, with an explicit mask (another attention path), and FSDP adds the
# ranks' partial gradients: rounding like a micro-batch split. A mask without
# the chunk's offset, labels shifted within a chunk, a loss counted once per
# context rank or gradients averaged instead of summed land far beyond it.
# With max_tokens_per_mb 20 the rows are up to 20 tokens: 2 chunks of up to
# 10, so most sequences cross the chunk boundary.
LAYOUTS = ["fsdp:c2", "fsdp:d2c2"]


@pytest.fixture(scope="module", params=LAYOUTS)
def trained(request, tiny_model_dir):
    from areal_fsdp.engine import FSDPTrainEngine

    cp = FSDPTrainEngine(CFG, allocation=request.param)
    cp.initialize(tiny_model_dir, 10)
    try:
        batches = step_batches()
        ref, history, floor = train_beside_references(cp, CFG, NOISE_CFG, tiny_model_dir, batches, LOSS, STAT_KEYS)
        yield request.param, cp, ref, history, floor
    finally:
        cp.destroy()


def test_layout_and_ranks(trained):
    alloc, cp, ref, history, _ = trained
    assert str(cp.layout) == {"fsdp:c2": "fsdp:d1c2", "fsdp:d2c2": "fsdp:d2c2"}[alloc]
    assert cp.data_parallel_size == cp.layout.dp and cp.world_size == cp.layout.dp * 2
    # FSDP shards every weight over all d*c ranks: each holds about 1/(d*c)
    # (shards are padded to equal sizes, so the sum may exceed the model a little).
    total = sum(p.numel() * p.element_size() for p in ref.model.parameters())
    assert sum(cp.rank_param_bytes) >= total
    assert all(b <= total / cp.world_size * 1.1 for b in cp.rank_param_bytes)
    print(f"\nparameter bytes per rank {cp.rank_param_bytes}, one process {total}")
    for a, _ in history:
        assert a["n_ranks"] == float(cp.world_size)


def test_steps_match_single_process(trained):
    _, _, _, history, floor = trained
    for a, b in history:
        assert a["skipped"] == b["skipped"] == 0.0
    for k in STAT_KEYS:
        print(assert_within_noise([a[k] for a, _ in history], [b[k] for _, b in history], floor[k], MULTIPLE))
    # The context ranks run plain packed rows (no prompt sharing), each
    # replica's answer counted once: every token once on the shared-prompt step.
    shared = history[1]
    assert shared[0]["n_model_tokens"] == shared[0]["n_tokens"] > shared[1]["n_model_tokens"]
    assert history[0][0]["n_model_tokens"] == history[0][1]["n_model_tokens"]
    # Clipping happened (the global norm over the shards decides the factor).
    assert max(b["grad_norm"] for _, b in history) > CFG["max_grad_norm"]


def test_scores_and_weights_match_after_the_steps(trained):
    _, cp, ref, _, floor = trained
    probe = random_batch([10, 7, 12], seed=99)
    lp_c, ent_c = cp.compute_logprobs_and_entropy(probe)
    lp_r, ent_r = ref.compute_logprobs_and_entropy(probe)
    assert [len(x) for x in lp_c] == [len(x) for x in ent_c] == [10, 7, 12]  # token-aligned, as one process
    print(assert_within_noise(lp_c, lp_r, floor["logprobs"], MULTIPLE))
    print(assert_within_noise(ent_c, ent_r, floor["token_entropy"], MULTIPLE))
    got = cp.full_weights()
    want = dict(ref.named_weights_for_transfer())
    assert set(got) == set(want)
    assert all(got[k].shape == want[k].shape for k in want)  # gathered to full HF tensors
    print(assert_within_noise(got, want, floor["weights"], MULTIPLE))
    init = load_file(os.path.join(cp.model_path, "model.safetensors"))
    assert any(not torch.equal(got[k], init[k]) for k in init)
    assert cp.step == ref.step == len(STEP_BATCHES)


@pytest.mark.parametrize("lengths", [[13], [2, 4, 3], [31], [5, 9, 3]])
def test_rows_of_any_length_score_as_one_process(trained, lengths):
    """Odd rows (padding in the last chunk), 2- and 3-token sequences, a sequence
    longer than the micro-batch budget (one row of 31: chunks of 16 and 15
    plus padding), only-loss-token scoring."""
    _, cp, ref, _, floor = trained
    probe = random_batch(lengths, seed=7)
    print(assert_within_noise(cp.compute_logprobs(probe), ref.compute_logprobs(probe), floor["logprobs"], MULTIPLE))
    only_c = cp.compute_logprobs(probe, only_loss_tokens=True)
    only_r = ref.compute_logprobs(probe, only_loss_tokens=True)
    print(assert_within_noise(only_c, only_r, floor["logprobs"], MULTIPLE))


def test_weight_check_fails_against_another_learning_rate(trained, tiny_model_dir):
    """Negative control: the comparison above can fail. A reference trained
    with lr 1.05x on the same batches differs from the context-parallel
    weights by far more than MULTIPLE x the floor."""
    _, cp, _, _, floor = trained
    assert_weight_check_fails_at_other_lr(cp, tiny_model_dir, floor["weights"])


def test_hf_export_equals_single_process(trained, tmp_path):
    _, cp, ref, _, floor = trained
    ref.save_hf(str(tmp_path / "ref"))
    cp.save_hf(str(tmp_path / "cp"), max_shard_bytes=40 << 10)
    got = {}
    for f in sorted(os.listdir(tmp_path / "cp")):
        if f.endswith(".safetensors"):
            got.update(load_file(str(tmp_path / "cp" / f)))
    want = load_file(str(tmp_path / "ref" / "model.safetensors"))
    assert set(got) == set(want) and "lm_head.weight" not in got  # tied alias dropped, as single-process
    print(assert_within_noise(got, want, floor["weights"], MULTIPLE, what="HF export weights"))
    # The export loads into the single-process engine and scores as the ranks do.
    again = TorchTrainEngine(CFG)
    again.initialize(str(tmp_path / "cp"), 10)
    probe = random_batch([9, 12, 7], seed=5)
    print(assert_within_noise(again.compute_logprobs(probe), cp.compute_logprobs(probe), floor["logprobs"], MULTIPLE))


def test_dcp_round_trip_continues_identically(trained, tmp_path):
    _, cp, _, _, _ = trained
    trip = state_round_trip(cp, str(tmp_path / "state"), LOSS)
    assert trip.loaded_step == len(STEP_BATCHES)
    trip.assert_continues_identically()


def test_a_sliding_window_model_is_refused():
    """The context attention computes full causal attention only: a model
    with sliding windows is one line naming the layout and what to use."""
    from types import SimpleNamespace

    from areal_fsdp.context_parallel import check_cp_model
    from areal_kernel.errors import ConfigError

    check_cp_model(SimpleNamespace(model_type="llama"), 2, "fsdp:d1c2")
    with pytest.raises(ConfigError, match=r"fsdp:d1c2 \(c2\): the model \('mistral'\) uses sliding-window .*'fsdp:d2'"):
        check_cp_model(SimpleNamespace(model_type="mistral", sliding_window=4096), 2, "fsdp:d1c2")


def test_a_chunk_sees_every_earlier_key_of_its_sequence():
    """The masks of the two chunks of a 6-token row ``[a a a | b b p]`` (``p``:
    padding, a sequence of its own): in the second chunk query 3 (b's first
    token) sees only itself, query 4 keys 3-4, the padding only itself; the
    first chunk is plain causal over a. A sequence crossing the boundary
    (``[a a | a a]``): the second chunk's queries see every earlier a."""
    from areal_fsdp.context_parallel import chunk_mask

    seq = torch.tensor([0, 0, 0, 1, 1, 2])
    second = chunk_mask(seq, 3, 3).int().tolist()
    assert second == [[0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]]
    first = chunk_mask(seq, 0, 3).int().tolist()
    assert first == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]]
    # A sequence crossing the boundary: [a a | a a] -> the second chunk sees all earlier a's.
    assert chunk_mask(torch.tensor([0, 0, 0, 0]), 2, 2).int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
