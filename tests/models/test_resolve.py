"""resolve_model_path: local dirs, known names (with dtype suffix), errors."""

from __future__ import annotations

import pytest

from areal_kernel.errors import ArealError, ConfigError
from areal_kernel.models.resolve import known_model_names, lookup_known_model, resolve_model_path


def test_local_dir_with_config_is_returned(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)


def test_dir_without_config_json_is_rejected(tmp_path):
    (tmp_path / "weights.bin").write_text("x")
    with pytest.raises(ArealError, match="no config.json") as err:
        resolve_model_path(str(tmp_path))
    assert str(tmp_path) in str(err.value) and "weights.bin" in str(err.value)


def test_file_is_rejected(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_text("x")
    with pytest.raises(ArealError, match="is a file"):
        resolve_model_path(str(f))


def test_missing_path_names_it_and_lists_known_models(tmp_path):
    missing = str(tmp_path / "nope" / "model")
    with pytest.raises(ArealError) as err:
        resolve_model_path(missing)
    msg = str(err.value)
    assert missing in msg
    assert "smollm2-135m-instruct" in msg and "HuggingFaceTB/SmolLM2-135M-Instruct" in msg


def test_unknown_hub_id_not_in_cache_is_an_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ArealError, match="not-a-real-owner/not-a-model"):
        resolve_model_path("not-a-real-owner/not-a-model")


def test_empty_name_is_a_config_error():
    with pytest.raises(ConfigError, match="non-empty"):
        resolve_model_path("")


def test_known_names_aliases_and_dtype_suffixes():
    names = known_model_names()
    assert {"smollm2-135m-instruct", "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"} <= set(names)
    model, dtype = lookup_known_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert (model.name, dtype) == ("smollm2-135m-instruct", "bfloat16")
    assert lookup_known_model("smollm2-135m-instruct@float32")[1] == "float32"
    assert lookup_known_model("SmolLM2-135M-Instruct@fp16")[1] == "float16"
    assert lookup_known_model("llama-7b") is None
    with pytest.raises(ConfigError, match="@int4.*@bfloat16"):
        lookup_known_model("smollm2-135m-instruct@int4")


# test_known_name_resolves_to_the_built_model is in test_smollm2.py: it reads
# the conversion that module makes (the ``smollm2`` fixture is module-scoped;
# here it converted SmolLM2 a second time, ~28 s).


def test_the_log_says_what_the_weights_are_stored_in_and_run_as(capsys):
    """``smollm2-135m-instruct`` resolves to ``...-bfloat16``: its safetensors
    hold bfloat16 tensors, while ``model.dtype: float32`` (the default) runs
    them as float32. Both are said, each named for what it is."""
    import os

    from safetensors import safe_open

    from areal_kernel.config.loader import load_config
    from areal_kernel.plugins import get_registry
    from areal_kernel.trainer.components import log_model_precision, resolve_model_dir, stored_dtype

    cfg = load_config(None, ["model.path=smollm2-135m-instruct"], registry=get_registry())
    assert cfg.model.dtype == "float32"
    path = resolve_model_dir(cfg)
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        held = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert held == {"BF16"} and stored_dtype(path) == "bfloat16" and path.endswith("-bfloat16")
    log_model_precision(cfg, path)  # what `areal train` logs once its input checks passed
    err = capsys.readouterr().err
    assert "weights_stored_as=bfloat16" in err and "float32 (model.dtype)" in err, err
    assert "the weights are bfloat16 values, loaded as float32" in err and "@float32" in err, err
