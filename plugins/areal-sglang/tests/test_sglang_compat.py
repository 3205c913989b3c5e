"""Compatibility with SGLang's OWN code (the pinned release, imported for real
in a separate process; see sglang_oracle.py): our launch command is accepted by
SGLang's server-argument parser with the intended values, and every request
body our protocol builds is accepted by the request class that SGLang's route
declares. Negative controls show the oracle does reject what SGLang rejects."""

from __future__ import annotations

import pytest

from areal_kernel.api.io import GenerationConfig
from areal_sglang import SGLANG_VERSION
from areal_sglang.config import SGLangServerConfig
from areal_sglang.launcher import build_command
from areal_sglang.protocol import SGLangProtocol


def test_oracle_runs_the_pinned_release(oracle_url):
    import json
    import urllib.request

    with urllib.request.urlopen(oracle_url, timeout=30) as r:
        assert json.loads(r.read())["sglang_version"] == SGLANG_VERSION


def _argv(cfg: SGLangServerConfig, **kw) -> list[str]:
    cmd = build_command(cfg, "/models/qwen", 31234, **{"dtype": "bfloat16", "tp_size": 1, "seed": 0, **kw})
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    return cmd[3:]


def test_full_launch_command_is_parsed_by_sglang_as_intended(sglang_oracle):
    cfg = SGLangServerConfig(
        context_length=8192,
        mem_fraction_static=0.75,
        attention_backend="flashinfer",
        radix_cache=False,
        enable_memory_saver=True,
        skip_server_warmup=True,
        api_key="k",
        log_level="warning",
        extra_args=["--max-running-requests", "64", "--chunked-prefill-size=4096"],
    )
    res = sglang_oracle.argv(_argv(cfg, tp_size=4, seed=11, weight_version=3))
    assert res["ok"], res["error"]
    assert res["fields"] == {
        "model_path": "/models/qwen",
        "host": "127.0.0.1",
        "port": 31234,
        "dtype": "bfloat16",
        "tp_size": 4,
        "random_seed": 11,
        "weight_version": "3",
        "context_length": 8192,
        "mem_fraction_static": 0.75,
        "attention_backend": "flashinfer",
        "device": None,
        "disable_radix_cache": True,
        "enable_memory_saver": True,
        "skip_server_warmup": True,
        "api_key": "k",
        "log_level": "warning",
    }


def test_lora_launch_flags_are_parsed_by_sglang(sglang_oracle):
    from areal_sglang.config import SGLangLoraSettings

    lora = SGLangLoraSettings(max_rank=8, target_modules=["q_proj", "v_proj", "down_proj"], max_loras_per_batch=3)
    fields = ("enable_lora", "max_lora_rank", "lora_target_modules", "max_loras_per_batch")
    res = sglang_oracle.argv(_argv(SGLangServerConfig(lora=lora)), fields)
    assert res["ok"], res["error"]
    got = {k: res["fields"][k] for k in fields}
    assert got == {
        "enable_lora": True,
        "max_lora_rank": 8,
        "lora_target_modules": ["q_proj", "v_proj", "down_proj"],
        "max_loras_per_batch": 3,
    }


def test_default_launch_command_is_parsed(sglang_oracle):
    res = sglang_oracle.argv(_argv(SGLangServerConfig(), dtype="float32"))
    assert res["ok"], res["error"]
    f = res["fields"]
    assert (f["dtype"], f["disable_radix_cache"], f["context_length"], f["weight_version"]) == (
        "float32",
        False,
        None,
        "0",
    )


@pytest.mark.parametrize(
    "extra, needle",
    [(["--no-such-flag"], "unrecognized arguments"), (["--attention-backend-typo", "x"], "unrecognized arguments")],
)
def test_sglang_parser_rejects_what_it_does_not_know(sglang_oracle, extra, needle):
    res = sglang_oracle.argv(_argv(SGLangServerConfig(extra_args=extra)))
    assert not res["ok"] and needle in res["error"]


def test_unknown_attention_backend_is_rejected_by_sglang(sglang_oracle):
    res = sglang_oracle.argv(_argv(SGLangServerConfig(attention_backend="warp-drive")))
    assert not res["ok"] and "invalid choice" in res["error"]


def test_npu_variant_launch_command_is_parsed_by_sglang(sglang_oracle, sglang_env_python, monkeypatch, tmp_path):
    """On the npu platform (areal-npu's NPUPlatform, whose launch answers need
    no torch_npu) the command carries SGLang's NPU build flags, --device npu
    and its ascend attention backend, as SGLang's own parser reads them; each
    server sees its NPUs through ASCEND_RT_VISIBLE_DEVICES. Not run on NPUs."""
    import areal_kernel.platforms as platforms
    from areal_kernel.config.loader import validate_config
    from areal_kernel.plugins import get_registry
    from areal_npu.platform import NPUPlatform
    from areal_sglang.backend import SGLangBackend

    monkeypatch.setattr(platforms, "current_platform", lambda: NPUPlatform())
    launcher = SGLangBackend(
        validate_config(
            {"rollout": {"backend": "sglang:d2t2", "sglang": {"python": sglang_env_python}}}, registry=get_registry()
        )
    ).make_launcher(str(tmp_path))
    launcher.check_launch("/models/qwen", 2, 2)
    cmd = launcher.command("/models/qwen", 31234, 1, [2, 3])
    # The resolved interpreter of rollout.sglang.python (a stand-in SGLang environment).
    assert cmd[:3] == [sglang_env_python, "-m", "sglang.launch_server"]
    assert launcher.environment(1, 2, [2, 3])["ASCEND_RT_VISIBLE_DEVICES"] == "2,3"
    res = sglang_oracle.argv(cmd[3:])
    assert res["ok"], res["error"]
    f = res["fields"]
    assert (f["device"], f["attention_backend"], f["tp_size"]) == ("npu", "ascend", 2)


def _calls():
    p = SGLangProtocol()
    g = GenerationConfig
    return [
        p.generate("rid-1", [1, 2, 3], g(max_new_tokens=8, greedy=True), 8),
        p.generate("rid-2", [5], g(max_new_tokens=8, temperature=0.7, top_p=0.9, top_k=20, stop_token_ids=[2, 7]), 3),
        p.generate("rid-3", [5, 6], g(top_k=0), 1),  # top_k 0 (kernel: disabled) must become SGLang's -1
        p.generate("rid-4", [5, 6], g(stop=["</tool_call>", "\n\n"]), 4),  # stop strings (multi-turn tool calls)
        p.generate("rid-5", [5, 6], g(adapter="task-a"), 4),  # a request naming its LoRA adapter
        *p.load_adapter("task-a", "/runs/x/weights/task-a-v3", 3, replace=True),  # unload, load, version
        p.unload_adapter("task-a"),
        p.pause(),
        SGLangProtocol("retract").pause(),
        SGLangProtocol("in_place").pause(),
        p.resume(),
        p.update_weights_from_disk("/ckpt/v3", 3),
        p.init_weight_group("10.0.0.1", 29500, 5, 3, "areal_weights", "nccl"),
        p.init_weight_group("10.0.0.1", 29500, 5, 3, "areal_weights", "hccl"),  # the npu platform's backend
        p.update_weights_from_distributed(
            [
                {"name": "model.embed_tokens.weight", "dtype": "bfloat16", "shape": [8, 4]},
                {"name": "lm_head.weight", "dtype": "float32", "shape": [8, 4]},
            ],
            4,
            1 << 20,
            "areal_weights",
        ),
        p.update_weights_bucket(
            ["model.embed_tokens.weight", "model.norm.weight"],
            ["float32", "bfloat16"],
            [[8, 4], [4]],
            "areal_weights",
            None,
        ),
        p.update_weights_bucket(["lm_head.weight"], ["bfloat16"], [[8, 4]], "areal_weights", 4),
        p.begin_weight_update(),
        p.end_weight_update(),
        p.destroy_weight_group("areal_weights"),
        p.set_version(5),
        p.abort_request("rid-1"),
        p.abort_request(None),
        p.release_memory(["weights", "kv_cache"]),
        p.release_memory(None),
        p.resume_memory(["weights"]),
    ]


@pytest.mark.parametrize("call", _calls(), ids=lambda c: c.path + ":" + ",".join(sorted(c.json or {}))[:40])
def test_request_bodies_are_accepted_by_sglang_request_classes(sglang_oracle, call):
    res = sglang_oracle.request(call.path, call.json)
    assert res["ok"], res["error"]
    assert res["class"].startswith("sglang.srt.managers.io_struct.")


@pytest.mark.parametrize(
    "route, body, needle",
    [
        ("/update_weights_from_disk", {"model_path": "/x", "weight_version": 3}, "valid string"),
        ("/update_weights_from_disk", {"path": "/x"}, "no field(s) ['path']"),
        ("/pause_generation", {"mode": "keep"}, "rejected"),
        ("/init_weights_update_group", {"master_addr": "h", "master_port": 1, "rank": 1, "world_size": 2}, "no field"),
        ("/generate", {"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k"),
        ("/generate", {"input_ids": [1], "sampling_params": {"greedy": True}}, "greedy"),
        ("/load_lora_adapter", {"name": "a", "path": "/x"}, "no field"),
        ("/unload_lora_adapter", {}, "lora_name"),
    ],
)
def test_sglang_rejects_bodies_it_does_not_accept(sglang_oracle, route, body, needle):
    res = sglang_oracle.request(route, body)
    assert not res["ok"] and needle in res["error"], res
