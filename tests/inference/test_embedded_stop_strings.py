"""Stop strings on the embedded server's side: matched on the decoded tail
of the output with SmolLM2's real tokenizer (also when the completing token
carries more text), validated in requests, and refused with a clear error
by a server without a tokenizer."""
from __future__ import annotations

import pytest

from areal_kernel.inference.embedded.protocol import RequestError, parse_sampling
from areal_kernel.inference.embedded.stopstr import StopStrings


@pytest.fixture(scope="module")
def tok(areal_tiny_chat_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(areal_tiny_chat_model_dir)


def _first_match(tok, stops, text):
    """Feed ``text``'s tokens one by one; (tokens fed, match) at the first match."""
    ids = tok(text, add_special_tokens=False)["input_ids"]
    s = StopStrings(stops, lambda x: tok.decode(x, skip_special_tokens=False))
    for n in range(1, len(ids) + 1):
        m = s.match(ids[:n])
        if m is not None:
            return n, m, ids
    return None, None, ids


def test_stops_at_the_token_that_completes_the_string(tok):
    text = 'x <tool_call>{"a": 1}</tool_call> and more after'
    n, m, ids = _first_match(tok, ["</tool_call>"], text)
    assert m == "</tool_call>"
    assert "</tool_call>" in tok.decode(ids[:n]) and "</tool_call>" not in tok.decode(ids[: n - 1])
    assert n < len(ids)


def test_a_string_inside_a_longer_token_and_the_earliest_of_several(tok):
    # "ello" ends inside the token "hello": the stop comes after that token.
    n, m, ids = _first_match(tok, ["ello", "world"], "hello world")
    assert m == "ello" and "ello" in tok.decode(ids[:n]) and "world" not in tok.decode(ids[:n])
    n2, m2, _ = _first_match(tok, ["<|im_end|>"], "done<|im_end|>")  # a special token as a stop string
    assert m2 == "<|im_end|>"
    assert _first_match(tok, ["zzz"], "no stop here")[1] is None


def test_stop_is_validated():
    assert parse_sampling({"stop": ["</tool_call>", "\n\n"]}).stop == ["</tool_call>", "\n\n"]
    assert parse_sampling({"stop": None}).stop == []
    for bad in ("</tool_call>", [""], [3], {"a": 1}):
        with pytest.raises(RequestError, match="sampling_params.stop must be a list of non-empty strings"):
            parse_sampling({"stop": bad})


def test_a_server_without_tokenizer_refuses_stop_strings(areal_tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from areal_kernel.inference.embedded.engine import GenerationEngine
    from areal_kernel.inference.embedded.protocol import parse_generate

    model = AutoModelForCausalLM.from_pretrained(areal_tiny_model_dir)
    engine = GenerationEngine(model, max_batch_size=2, eos_ids=[0], max_positions=64, vocab_size=256,
                              device=torch.device("cpu"))  # fmt: skip
    body = parse_generate({"rid": "r", "input_ids": [1, 2], "sampling_params": {"stop": ["x"]}}, 256, 64)
    with pytest.raises(RequestError, match="no tokenizer"):
        engine.submit(body)
