"""Registration, light import and the validated `rollout.sglang` config section."""

from __future__ import annotations

import subprocess
import sys

import pytest

from areal_kernel.errors import ConfigError


def test_entry_point_module_imports_only_the_kernel():
    code = (
        "import sys, areal_sglang.plugin, areal_sglang.config, areal_sglang.protocol, areal_sglang.launcher, "
        "areal_sglang.backend, areal_sglang.weights\n"
        "heavy = sorted(m for m in ('torch', 'sglang', 'transformers') if m in sys.modules)\n"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_registered_as_inference_engine_with_disk_and_broadcast_updates():
    from areal_kernel.plugins import get_registry

    spec = get_registry().get("inference_engine", "sglang")
    assert spec.target == "areal_sglang.backend:SGLangBackend"
    assert {"pause", "disk_update", "broadcast_update"} <= set(spec.capabilities)
    t = get_registry().get("weight_transport", "sglang_broadcast")
    assert t.target == "areal_sglang.weights:SGLangBroadcastTransport"


def _cfg(**sglang):
    from areal_kernel.config import validate_config
    from areal_kernel.plugins import get_registry

    return validate_config({"rollout": {"backend": "sglang:d2t2", "sglang": sglang}}, registry=get_registry())


def test_section_is_validated_against_the_plugin_model():
    from areal_sglang.config import SGLangServerConfig

    cfg = _cfg(
        context_length=4096,
        mem_fraction_static=0.7,
        attention_backend="fa3",
        radix_cache=False,
        seed=3,
        extra_args=["--max-running-requests", "32"],
    )
    sc = cfg.rollout.plugin_config
    assert isinstance(sc, SGLangServerConfig)
    assert (sc.context_length, sc.mem_fraction_static, sc.radix_cache, sc.extra_args[0]) == (
        4096,
        0.7,
        False,
        "--max-running-requests",
    )


@pytest.mark.parametrize(
    "bad, needle",
    [
        ({"mem_fraction": 0.5}, "rollout.sglang.mem_fraction: unknown key; did you mean 'mem_fraction_static'?"),
        ({"mem_fraction_static": 1.5}, "rollout.sglang.mem_fraction_static"),
        ({"tp_size": 0}, "rollout.sglang.tp_size"),
        ({"pause_mode": "freeze"}, "rollout.sglang.pause_mode"),
        ({"extra_args": ["--port", "1"]}, "--port is set by the launcher"),
        ({"extra_args": ["--tp-size=2"]}, "--tp-size is set by the launcher"),
    ],
)
def test_bad_settings_name_the_field(bad, needle):
    with pytest.raises(ConfigError) as e:
        _cfg(**bad)
    assert needle in str(e.value)


def _select(train="torch", infer="sglang", platform="cpu", mode="auto"):
    from areal_kernel.plugins import get_plugin_manager

    return get_plugin_manager().hook.areal_select_weight_transport(
        train_backend=train, inference_backend=infer, platform=platform, mode=mode
    )


def test_transport_selection():
    # SGLang: broadcast always means SGLang's own protocol; auto picks it off CPU for in-process weights.
    assert _select(mode="broadcast") == "sglang_broadcast"
    assert _select(mode="broadcast", platform="cuda") == "sglang_broadcast"
    assert _select(mode="auto", platform="cuda") == "sglang_broadcast"
    assert _select(mode="auto", platform="cpu") == "disk"
    assert _select(mode="auto", platform="cuda", train="fsdp") == "disk"  # fsdp keeps weights in its ranks
    assert _select(mode="disk", platform="cuda") == "disk"
    # Other backends: the kernel's default is unchanged.
    assert _select(infer="embedded", mode="broadcast") == "broadcast"
    assert _select(infer="embedded", mode="auto", platform="cuda") == "broadcast"
    assert _select(infer="embedded", mode="auto", platform="cpu") == "disk"


def test_broadcast_config_validates_and_selects_the_sglang_transport():
    from areal_kernel.config import validate_config
    from areal_kernel.plugins import get_registry
    from areal_sglang.backend import SGLangBackend
    from areal_sglang.weights import SGLangBroadcastTransport

    cfg = validate_config(
        {"rollout": {"backend": "sglang"}, "weight_update": {"mode": "broadcast", "bucket_mb": 8}},
        registry=get_registry(),
    )
    SGLangBackend(cfg)  # no longer refused
    name = _select(
        train=cfg.actor.allocation.backend,
        infer=cfg.rollout.allocation.backend,
        platform="cuda",
        mode=cfg.weight_update.mode,
    )
    assert get_registry().get("weight_transport", name).load() is SGLangBroadcastTransport
    ok = SGLangBackend(
        validate_config({"rollout": {"backend": "sglang"}, "model": {"dtype": "bfloat16"}}, registry=get_registry())
    )
    assert ok.server_config.dtype is None  # follows model.dtype at launch


def test_transport_refuses_what_it_cannot_serve():
    import torch

    from areal_sglang.backend import SGLangInferenceEngine
    from areal_sglang.weights import SGLangBroadcastTransport

    class Engine:
        def named_weights_for_transfer(self):
            return [("w", torch.empty(2, 2, device="meta"))]

    with pytest.raises(ConfigError, match="needs SGLang servers"):
        SGLangBroadcastTransport(Engine(), object(), "/tmp")
    infer = SGLangInferenceEngine(["127.0.0.1:1"])
    with pytest.raises(ConfigError, match="use weight_update.mode: disk"):
        SGLangBroadcastTransport(Engine(), infer, "/tmp").setup()
    infer.destroy()


def test_tp_aware_ranks_in_init_group_bodies():
    from areal_sglang.backend import SGLangInferenceEngine

    engine = SGLangInferenceEngine(["127.0.0.1:1", "127.0.0.1:2"], tp_size=2)
    seen = []
    engine.control = lambda address, op: seen.append((address, op.json)) or {"success": True}
    for f in engine.init_weight_group_async("127.0.0.1", 29555, "areal_weights", "nccl"):
        f.result(10)
    # The trainer is rank 0; server i owns ranks 1+2i and 2+2i of 5.
    got = sorted((a, b["rank_offset"], b["world_size"], b["backend"]) for a, b in seen)
    assert got == [("127.0.0.1:1", 1, 5, "nccl"), ("127.0.0.1:2", 3, 5, "nccl")]
    assert engine.weight_group_world_size == 5
    engine.destroy()
