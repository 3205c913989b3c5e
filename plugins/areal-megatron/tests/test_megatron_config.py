"""``actor.megatron`` validation, allocation strings, the light entry point and
the cpu redirects (no ranks started)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from areal_kernel.errors import ConfigError


def _cfg(actor):
    from areal_kernel.config.models import ExperimentConfig
    from areal_kernel.plugins import get_registry
    from areal_kernel.config import resolve

    return resolve(ExperimentConfig.model_validate({"actor": actor}), get_registry())


def test_section_is_validated_by_the_plugin_model():
    from areal_megatron.config import MegatronEngineConfig

    cfg = _cfg({"backend": "megatron:t2", "megatron": {"lr": 1e-4, "max_tokens_per_mb": 64}})
    assert isinstance(cfg.actor.plugin_config, MegatronEngineConfig)
    assert cfg.actor.plugin_config.lr == 1e-4 and cfg.actor.allocation.world_size == 2
    with pytest.raises(ConfigError, match=r"actor\.megatron\.lrr"):
        _cfg({"backend": "megatron", "megatron": {"lrr": 1}})
    with pytest.raises(ConfigError, match="share_prompts: true is not supported by the megatron engine"):
        _cfg({"backend": "megatron", "megatron": {"share_prompts": True}})
    with pytest.raises(ConfigError, match="LoRA adapters are not supported by the megatron engine"):
        _cfg({"backend": "megatron", "megatron": {"lora": {"rank": 4}}})


@pytest.mark.parametrize(
    "text,dp,tp,pp",
    [("megatron", 1, 1, 1), ("megatron:d2", 2, 1, 1), ("megatron:t2", 1, 2, 1), ("megatron:p2", 1, 1, 2),
     ("megatron:d2t2p1", 2, 2, 1)],
)  # fmt: skip
def test_allocation_strings(text, dp, tp, pp):
    from areal_megatron.engine import MegatronTrainEngine
    from areal_megatron.layout import layout_of

    lay = layout_of(text)
    assert (lay.dp, lay.tp, lay.pp, lay.world_size) == (dp, tp, pp, dp * tp * pp)
    assert MegatronTrainEngine({}, allocation=text).layout == lay


@pytest.mark.parametrize(
    "text,match",
    [
        ("megatron:d2c2", "context parallelism .*Transformer Engine"),
        ("megatron:t2e2", "expert parallelism .*no experts"),
        ("megatron:t2x2", "unknown dimension 'x'"),
        ("megatron:t0", "must be >= 1"),
        ("megatron:", "nothing after ':'"),
    ],
)
def test_bad_allocations_get_one_clear_error(text, match):
    from areal_megatron.engine import MegatronTrainEngine

    with pytest.raises(ConfigError, match=r"actor\.backend: .*" + match):
        MegatronTrainEngine({}, allocation=text)


def test_entry_point_module_imports_no_torch_or_megatron():
    code = (
        "import sys, areal_megatron.plugin, areal_megatron.config, areal_megatron.layout;"
        "bad=[m for m in ('torch','megatron') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cpu_redirects_name_real_functions_and_touch_nothing_elsewhere():
    import importlib

    from areal_megatron import cpu_redirect

    for r in cpu_redirect.REDIRECTS:
        mod, _, attr = r.target.partition(":")
        owner = importlib.import_module(mod)
        for part in attr.split("."):
            owner = getattr(owner, part)  # the replaced function exists in the installed release
    import megatron.core.transformer.utils as tu

    before = tu.get_default_causal_mask
    assert cpu_redirect.apply(host_memory=False) == []  # nothing patched on an accelerator (CUDA)
    assert tu.get_default_causal_mask is before


def test_areal_validate_refuses_dims_the_engine_cannot_run():
    """The kernel asks the section's model (``check_allocation``) while it validates ``actor.backend``."""
    with pytest.raises(ConfigError, match=r"^actor\.backend: megatron:t2e2 asks for expert parallelism"):
        _cfg({"backend": "megatron:t2e2"})
    assert _cfg({"backend": "megatron:d2t2p1"}).actor.allocation.world_size == 4
