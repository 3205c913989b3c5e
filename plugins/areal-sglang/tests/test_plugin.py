"""Registration, light import and the validated `rollout.sglang` config section."""
from __future__ import annotations

import subprocess
import sys

import pytest

from areal_kernel.errors import ConfigError


def test_entry_point_module_imports_only_the_kernel():
    code = (
        "import sys, areal_sglang.plugin, areal_sglang.config, areal_sglang.protocol, areal_sglang.launcher, "
        "areal_sglang.backend\n"
        "heavy = sorted(m for m in ('torch', 'sglang', 'transformers') if m in sys.modules)\n"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_registered_as_inference_engine_with_disk_updates():
    from areal_kernel.plugins import get_registry

    spec = get_registry().get("inference_engine", "sglang")
    assert spec.target == "areal_sglang.backend:SGLangBackend"
    assert {"pause", "disk_update"} <= set(spec.capabilities)
    assert "broadcast_update" not in spec.capabilities


def _cfg(**sglang):
    from areal_kernel.config import validate_config

    return validate_config({"rollout": {"backend": "sglang:d2t2", "sglang": sglang}})


def test_section_is_validated_against_the_plugin_model():
    from areal_sglang.config import SGLangServerConfig

    cfg = _cfg(context_length=4096, mem_fraction_static=0.7, attention_backend="fa3", radix_cache=False, seed=3,
               extra_args=["--max-running-requests", "32"])
    sc = cfg.rollout.plugin_config
    assert isinstance(sc, SGLangServerConfig)
    assert (sc.context_length, sc.mem_fraction_static, sc.radix_cache, sc.extra_args[0]) == (4096, 0.7, False, "--max-running-requests")


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


def test_auto_weight_transport_is_disk():
    from areal_kernel.plugins import get_plugin_manager

    hook = get_plugin_manager().hook
    assert hook.areal_select_weight_transport(train_backend="torch", inference_backend="sglang", platform="cpu", mode="auto") == "disk"


def test_broadcast_weight_updates_are_refused_up_front():
    from areal_kernel.config import validate_config
    from areal_sglang.backend import SGLangBackend

    cfg = validate_config({"rollout": {"backend": "sglang"}, "weight_update": {"mode": "broadcast"}})
    with pytest.raises(ConfigError, match="weight_update.mode: 'broadcast' is not supported"):
        SGLangBackend(cfg)
    ok = SGLangBackend(validate_config({"rollout": {"backend": "sglang"}, "model": {"dtype": "bfloat16"}}))
    assert ok.server_config.dtype is None  # follows model.dtype at launch
