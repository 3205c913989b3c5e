"""The built-in workflows and the agent proxy stop at the tokenizer's EOS id
without touching the run's shared generation config."""

from types import SimpleNamespace

from areal_kernel.api.io import GenerationConfig
from areal_kernel.workflow.rlvr import stop_at_eos


def test_eos_is_added_to_a_copy_and_only_once():
    shared = GenerationConfig(stop_token_ids=[7])
    got = stop_at_eos(shared, SimpleNamespace(eos_token_id=2))
    assert got.stop_token_ids == [7, 2]
    assert shared.stop_token_ids == [7]
    assert stop_at_eos(got, SimpleNamespace(eos_token_id=2)).stop_token_ids == [7, 2]


def test_a_tokenizer_without_eos_leaves_the_config_as_it_is():
    shared = GenerationConfig(stop_token_ids=[7])
    assert stop_at_eos(shared, SimpleNamespace(eos_token_id=None)).stop_token_ids == [7]
    assert stop_at_eos(shared, object()).stop_token_ids == [7]
