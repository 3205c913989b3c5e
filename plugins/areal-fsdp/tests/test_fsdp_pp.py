"""Pipeline parallelism in the fsdp engine (``fsdp:p2``: 2 stages over gloo,
``torch.distributed.pipelining``) against the kernel's single-process torch
engine on a tiny Llama with 4 decoder layers and tied embeddings, for both
schedules (``1f1b``: layers 0-1 | 2-3; ``interleaved_1f1b``: one layer per
stage, stages 0, 2 on rank 0 and 1, 3 on rank 1): the same 4 steps give the
same losses, grad norms, logprobs, entropies and weights within a noise
floor measured here (the torch engine against itself with another
micro-batch split); the HF export equals the single-process one; a DCP
checkpoint resumes identically. On the conftest's 2-layer model, the
in-memory broadcast from the two stages reaches an embedded server and
``fsdp:p2`` passes the kernel's train-engine contract. Negative control: the
weight check fails against a reference trained with lr 1.05x."""

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
from areal_kernel.testing.contracts import TrainEngineContract, engine_maker
from areal_kernel.testing.noise import assert_within_noise
from areal_kernel.testing.rank_engines import (
    RankEngineWeightUpdateSuite,
    make_spread_tiny_llama,
    random_batch,
    state_round_trip,
    train_beside_references,
)

pytestmark = pytest.mark.slow

# CFG, NOISE_CFG, STEP_BATCHES, LOSS, STAT_KEYS and MULTIPLE: fsdp_parity_helpers (shared with
# test_fsdp_pp / test_fsdp_tp / test_fsdp_ep). Why MULTIPLE holds here:
# The stages compute what one process computes, with rows padded at their
# end (another attention mask path) and the tied matrix's two gradient parts
# added by an all-reduce: rounding like a micro-batch split. The multiple is
# test_fsdp_parity's / test_fsdp_tp's. A grad norm that counted the tied
# matrix twice, or missed a stage, is off by far more than that.
SCHEDULES = ["1f1b", "interleaved_1f1b"]


@pytest.fixture(scope="module")
def four_layer_model(tmp_path_factory) -> str:
    """The conftest's tiny Llama with 4 decoder layers (2 stages per rank for the interleaved schedule)."""
    return make_spread_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama-4")), layers=4)


@pytest.fixture(scope="module", params=SCHEDULES)
def trained(request, four_layer_model):
    from areal_fsdp.engine import FSDPTrainEngine

    pp = FSDPTrainEngine({**CFG, "pipeline_schedule": request.param}, allocation="fsdp:p2")
    pp.initialize(four_layer_model, 10)
    try:
        batches = step_batches()
        ref, history, floor = train_beside_references(pp, CFG, NOISE_CFG, four_layer_model, batches, LOSS, STAT_KEYS)
        yield request.param, pp, ref, history, floor
    finally:
        pp.destroy()


def test_layout_stages_and_memory(trained):
    """Each rank runs its layers (split by count), holds only its stages'
    parameters (the tied matrix once per rank: embedding on rank 0, head on rank 1)."""
    schedule, pp, ref, history, _ = trained
    assert str(pp.layout) == "fsdp:d1p2" and pp.world_size == 2 and pp.data_parallel_size == 1
    assert [pp.layout.rank_coords(r) for r in range(2)] == [{"d": 0, "p": 0}, {"d": 0, "p": 1}]
    want = {
        "1f1b": [[[0, 0, 2]], [[1, 2, 4]]],
        "interleaved_1f1b": [[[0, 0, 1], [2, 2, 3]], [[1, 1, 2], [3, 3, 4]]],
    }[schedule]
    assert pp.rank_stages == want
    total = sum(p.numel() * p.element_size() for p in ref.model.parameters())  # the tied matrix counted once
    embed = ref.model.get_input_embeddings().weight
    tied_bytes = embed.numel() * embed.element_size()
    # Every weight on exactly one rank, plus the tied matrix's second copy.
    assert sum(pp.rank_param_bytes) == total + tied_bytes
    assert all(b < total for b in pp.rank_param_bytes)
    print(f"\nparameter bytes per rank {pp.rank_param_bytes}, one process {total}")
    for a, _ in history:
        assert a["n_ranks"] == 2.0


def test_steps_match_single_process(trained):
    _, _, _, history, floor = trained
    for a, b in history:
        assert a["skipped"] == b["skipped"] == 0.0
    for k in STAT_KEYS:
        print(assert_within_noise([a[k] for a, _ in history], [b[k] for _, b in history], floor[k], MULTIPLE))
    # The stages run every sequence whole (no prompt sharing): more model
    # tokens than the single process on the shared-prompt step, equal elsewhere.
    shared = history[1]
    assert shared[0]["n_model_tokens"] == shared[0]["n_tokens"] > shared[1]["n_model_tokens"]
    assert history[0][0]["n_model_tokens"] == history[0][1]["n_model_tokens"]
    # Clipping happened: the global norm over both stages decides the factor.
    assert max(b["grad_norm"] for _, b in history) > CFG["max_grad_norm"]


def test_scores_and_weights_match_after_the_steps(trained):
    _, pp, ref, _, floor = trained
    probe = random_batch([10, 7, 12], seed=99)
    lp_p, ent_p = pp.compute_logprobs_and_entropy(probe)
    lp_r, ent_r = ref.compute_logprobs_and_entropy(probe)
    print(assert_within_noise(lp_p, lp_r, floor["logprobs"], MULTIPLE))
    print(assert_within_noise(ent_p, ent_r, floor["token_entropy"], MULTIPLE))
    got = pp.full_weights()
    want = dict(ref.named_weights_for_transfer())
    assert set(got) == set(want) and "lm_head.weight" not in got
    assert all(got[k].shape == want[k].shape for k in want)
    print(assert_within_noise(got, want, floor["weights"], MULTIPLE))
    init = load_file(os.path.join(pp.model_path, "model.safetensors"))
    assert any(not torch.equal(got[k], init[k]) for k in init)
    assert pp.step == ref.step == len(STEP_BATCHES)


def test_weight_check_fails_against_another_learning_rate(trained):
    """Negative control: the comparison above can fail. A reference trained
    with lr 1.05x on the same batches differs from the stages' weights by far
    more than MULTIPLE x the floor."""
    _, pp, _, _, floor = trained
    assert_weight_check_fails_at_other_lr(pp, pp.model_path, floor["weights"])


def test_hf_export_equals_single_process(trained, tmp_path):
    _, pp, ref, _, floor = trained
    ref.save_hf(str(tmp_path / "ref"))
    pp.save_hf(str(tmp_path / "pp"), max_shard_bytes=40 << 10)  # several files, each mixing both ranks' weights
    got = {}
    files = [f for f in sorted(os.listdir(tmp_path / "pp")) if f.endswith(".safetensors")]
    assert len(files) > 1
    for f in files:
        got.update(load_file(str(tmp_path / "pp" / f)))
    want = load_file(str(tmp_path / "ref" / "model.safetensors"))
    assert set(got) == set(want) and "lm_head.weight" not in got  # tied alias dropped, as single-process
    print(assert_within_noise(got, want, floor["weights"], MULTIPLE, what="HF export weights"))
    again = TorchTrainEngine(CFG)
    again.initialize(str(tmp_path / "pp"), 10)
    probe = random_batch([9, 12, 7], seed=5)
    print(assert_within_noise(again.compute_logprobs(probe), pp.compute_logprobs(probe), floor["logprobs"], MULTIPLE))


def test_dcp_round_trip_continues_identically(trained, tmp_path):
    _, pp, _, _, _ = trained
    trip = state_round_trip(pp, str(tmp_path / "state"), LOSS)
    assert trip.loaded_step == len(STEP_BATCHES)
    trip.assert_continues_identically()
    # Each stage's optimizer state under its rank's key; the model under the HF names.
    assert os.path.isdir(os.path.join(trip.ckpt, "dcp"))


@pytest.fixture(scope="module")
def p2_engine(tiny_model_dir):
    """One fsdp:p2 engine (1F1B, one layer per stage) shared by the kernel's suites below."""
    from areal_fsdp.engine import FSDPTrainEngine

    e = FSDPTrainEngine(P2_SETTINGS, allocation="fsdp:p2")
    e.initialize(tiny_model_dir, 20)
    yield e
    e.destroy()


P2_SETTINGS = {"lr": 1e-3, "max_tokens_per_mb": 8}


class TestPipelineWeightUpdate(RankEngineWeightUpdateSuite):
    """The in-memory broadcast from 2 pipeline stages into a real embedded
    server (the kernel's suite): rank 1 sends its layers to rank 0, which
    sends them on; the server then computes what the stages hold."""

    ENGINE_NAME = "fsdp"

    @pytest.fixture
    def update_engine(self, p2_engine):
        return p2_engine


class TestPipelineEngineContract(TrainEngineContract):
    """The kernel's train-engine contract on fsdp:p2 ranks."""

    @pytest.fixture
    def contract_model_dir(self, tiny_model_dir):
        return tiny_model_dir

    @pytest.fixture
    def train_engine(self, p2_engine):
        return p2_engine

    @pytest.fixture
    def make_train_engine(self, contract_model_dir):
        from areal_fsdp.engine import FSDPTrainEngine

        return engine_maker(lambda: FSDPTrainEngine(P2_SETTINGS, allocation="fsdp:p2"), contract_model_dir, 20)


def test_a_model_with_too_few_layers_is_refused_by_the_ranks(tiny_model_dir):
    """The interleaved schedule needs 2 stages per rank: 4 layers for p2; the
    2-layer model is refused while loading, with one line naming the
    allocation, the setting and the counts, and no ranks are left."""
    from areal_fsdp.engine import FSDPTrainEngine
    from areal_kernel.errors import ConfigError

    e = FSDPTrainEngine({**P2_SETTINGS, "pipeline_schedule": "interleaved_1f1b"}, allocation="fsdp:p2")
    with pytest.raises(ConfigError, match=r"fsdp:d1p2 with actor.fsdp.pipeline_schedule='interleaved_1f1b' needs at "
                       r"least 4 decoder layers .* the model has 2"):  # fmt: skip
        e.initialize(tiny_model_dir, 10)
    assert e.ranks is None
