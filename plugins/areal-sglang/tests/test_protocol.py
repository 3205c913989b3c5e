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


def _models(*adapters: tuple[str, str]) -> bytes:
    """A ``/v1/models`` answer: the base model's card, then one per adapter (name, root)."""
    import json

    cards = [{"id": "/m", "object": "model", "root": "/m", "parent": None}]
    cards += [{"id": n, "object": "model", "root": r, "parent": "/m"} for n, r in adapters]
    return json.dumps({"object": "list", "data": cards}).encode()


def test_adapter_fingerprint_maps_the_served_directory_to_its_version():
    """An adapter is checked through ``GET /v1/models``: the directory the
    server lists for it, mapped through the client's ``adapter_dirs``, is
    the version the kernel's ``compare`` checks (``version_only``)."""
    from areal_kernel.monitor.weights import FingerprintSpec, compare

    spec = {"version": 2, "adapter": "policy", "tensors": [], "adapter_dirs": {"/w/policy-v1": 1, "/w/policy-v2": 2}}
    (call,) = SGLangProtocol(dtype="float32").weight_fingerprint(spec)
    assert (call.method, call.path) == ("GET", "/v1/models")
    kspec = FingerprintSpec(version=2, positions={"base_model.model.x.lora_A.weight": [0]}, adapter="policy")

    def check(raw: bytes):
        return compare({}, {}, kspec, "s:1", call.parse_reply(raw))

    # Served from version 2's directory (a trailing slash is the same directory): one comparison, equal.
    assert check(_models(("policy", "/w/policy-v2/"))) == (1, [])
    # Version 1's directory: named with its version and the directory.
    n, bad = check(_models(("policy", "/w/policy-v1")))
    assert n == 1 and [(m.server, m.tensor, m.version) for m in bad] == [("s:1", "*", 2)]
    assert "serving weight version 1 (it serves adapter 'policy' from '/w/policy-v1'" in bad[0].detail
    # A directory the client never sent, and no adapter of that name (another one is loaded): mismatches.
    for raw, said in [
        (_models(("policy", "/elsewhere")), "from '/elsewhere'"),
        (_models(("other", "/w/policy-v2")), "it serves no adapter 'policy'"),
    ]:
        n, bad = check(raw)
        assert n == 1 and len(bad) == 1 and "does not report serving version 2" in bad[0].detail, bad
        assert said in bad[0].detail and "cannot read an adapter's weights back" in bad[0].detail
    with pytest.raises(ValueError, match="'data' list"):
        call.parse_reply(b'{"object": "list"}')


def test_adapter_without_a_directory_is_not_checked():
    # In memory SGLang lists every adapter's root as "__tensor__": no version to map.
    with pytest.raises(NotImplementedError, match="was not loaded from one"):
        SGLangProtocol(dtype="float32").weight_fingerprint({"version": 1, "adapter": "policy", "tensors": []})


def test_client_passes_the_directories_it_loaded_an_adapter_from():
    """The kernel's client adds ``adapter_dirs`` (its last 16 loads of the
    adapter, path -> version) to the check's spec; an unload forgets them."""
    from areal_kernel.inference.client import ADAPTER_DIRS_KEPT
    from areal_sglang.backend import SGLangInferenceEngine

    eng = SGLangInferenceEngine(["127.0.0.1:9"], SGLangProtocol(dtype="float32"))
    eng.control_all = lambda op, **kw: []  # no server behind this client: the loads are only recorded
    sent = []
    eng.control = lambda address, op: sent.append(op) or {}
    for v in range(20):
        eng.load_adapter("policy", f"/w/policy-v{v}", v)
    eng.load_adapter("policy", "/w/policy-v3", 21)  # a directory loaded again counts as its newest version
    eng.weight_fingerprints({"version": 21, "adapter": "policy", "tensors": []})
    dirs = sent[-1][0].parse.dirs
    assert len(dirs) == ADAPTER_DIRS_KEPT == 16 and list(dirs.items())[-1] == ("/w/policy-v3", 21)
    assert "/w/policy-v4" not in dirs and dirs["/w/policy-v19"] == 19
    eng.unload_adapter("policy")
    with pytest.raises(NotImplementedError):
        eng.weight_fingerprints({"version": 22, "adapter": "policy", "tensors": []})
    eng.destroy()
