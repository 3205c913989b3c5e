"""SGLangProtocol in isolation: bodies and answer parsing (no server)."""

from __future__ import annotations

import pytest

from areal_kernel.api.io import GenerationConfig, StopReason
from areal_kernel.errors import ServerError
from areal_sglang.protocol import SGLangProtocol, parse_version


def answer(ids, reason, version="3", lps=None):
    lps = lps if lps is not None else [-0.5] * len(ids)
    return {
        "text": "",
        "output_ids": ids,
        "meta_info": {
            "finish_reason": reason,
            "weight_version": version,
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)],
        },
    }


def test_generate_body_maps_greedy_and_disabled_top_k():
    call = SGLangProtocol().generate("r", [1, 2], GenerationConfig(greedy=True, top_k=-1, stop_token_ids=[7]), 5)
    sp = call.json["sampling_params"]
    assert call.path == "/generate" and call.json["return_logprob"] is True and call.json["input_ids"] == [1, 2]
    assert sp["temperature"] == 0.0 and sp["top_k"] == -1 and sp["max_new_tokens"] == 5 and sp["stop_token_ids"] == [7]


@pytest.mark.parametrize(
    "reason, expected",
    [
        ({"type": "stop", "matched": 2}, StopReason.STOP),
        ({"type": "length", "length": 2}, StopReason.LENGTH),
        ({"type": "abort", "message": "Aborted"}, StopReason.ABORT),
    ],
)
def test_parse_finish_reasons_logprobs_and_version(reason, expected):
    chunk = SGLangProtocol().parse_generate(answer([5, 2], reason, lps=[-0.1, -0.2]))
    assert chunk.output_ids == [5, 2] and chunk.output_logprobs == [-0.1, -0.2]
    assert chunk.stop_reason == expected and chunk.version == 3


def test_stop_strings_travel_and_come_back_as_matched_stop():
    p = SGLangProtocol()
    assert "stop" not in p.generate("r", [1], GenerationConfig(), 3).json["sampling_params"]
    assert p.generate("r", [1], GenerationConfig(stop=["</tool_call>"]), 3).json["sampling_params"]["stop"] == [
        "</tool_call>"
    ]
    chunk = p.parse_generate(answer([5, 2], {"type": "stop", "matched": "</tool_call>"}))
    assert chunk.stop_reason == StopReason.STOP and chunk.matched_stop == "</tool_call>"
    assert p.parse_generate(answer([5, 2], {"type": "stop", "matched": 2})).matched_stop is None


def test_parse_rejects_misaligned_or_missing_logprobs():
    bad = answer([5, 2], {"type": "stop"})
    bad["meta_info"]["output_token_logprobs"] = bad["meta_info"]["output_token_logprobs"][:1]
    with pytest.raises(ServerError, match="do not match output_ids"):
        SGLangProtocol().parse_generate(bad)
    with pytest.raises(ServerError, match="unexpected body"):
        SGLangProtocol().parse_generate({"text": "hi"})


def test_versions_travel_as_strings():
    p = SGLangProtocol()
    assert p.update_weights_from_disk("/w", 4).json["weight_version"] == "4"
    assert p.set_version(5).json == {"new_version": "5", "abort_all_requests": False}
    assert parse_version("default") is None and parse_version("12") == 12


def test_pause_mode_comes_from_config_and_is_checked():
    assert SGLangProtocol().pause().json == {"mode": "abort"}
    assert SGLangProtocol("retract").pause("abort").json == {"mode": "retract"}
    assert SGLangProtocol().pause("in_place").json == {"mode": "in_place"}
    with pytest.raises(ServerError, match="not one of SGLang's"):
        SGLangProtocol("keep")
