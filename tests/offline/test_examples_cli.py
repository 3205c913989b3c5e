"""The SFT / DPO / RM example configs: validated by the real config loader and
run for a few steps by ``areal train`` in a real subprocess (tiny random Llama
with SmolLM2's tokenizer in place of SmolLM2, to keep CI short); bad input
ends in one clear error."""
import json
import os

import pytest
from offline_paths import EXAMPLES, REPO

from areal_kernel.config import load_config
from areal_kernel.plugins import get_registry
from areal_kernel.errors import DataError

OFFLINE_EXAMPLES = {
    "sft_chat.yaml": ("sft", "file"),
    "dpo_arithmetic.yaml": ("dpo", "arithmetic"),
    "rm_preferences.yaml": ("rm", "file"),
}


@pytest.mark.parametrize("name", sorted(OFFLINE_EXAMPLES))
def test_example_validates(name):
    cfg = load_config(os.path.join(EXAMPLES, name), [], registry=get_registry())
    algo, dataset = OFFLINE_EXAMPLES[name]
    assert cfg.algorithm.type == algo and cfg.dataset.type == dataset
    assert cfg.model.path == "smollm2-135m-instruct"
    if dataset == "file":  # paths are relative to the repository root
        assert os.path.isfile(os.path.join(REPO, cfg.dataset.path)), cfg.dataset.path


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(OFFLINE_EXAMPLES))
def test_example_trains_a_few_steps(name, run_areal, tiny_chat_model, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_areal(
        "train", os.path.join(EXAMPLES, name), f"model.path={tiny_chat_model}", f"run_dir={run_dir}",
        "trainer.max_steps=2", "trainer.batch_size=2", "trainer.eval_size=4", "trainer.eval_every=1",
        "checkpoint.save_hf_every=1", "checkpoint.keep_last=1", cwd=REPO, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "step 2/2" in proc.stdout and "final HF checkpoint" in proc.stdout
    assert "before" in proc.stdout and "-> after" in proc.stdout
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    steps = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["train/skipped"] == 0.0 and r["train/grad_norm"] > 0 for r in steps)
    assert any("eval/loss" in r and r["step"] == 0 for r in rows)  # evaluated before training
    result = json.load(open(run_dir / "result.json"))
    assert result["algorithm"] == OFFLINE_EXAMPLES[name][0] and result["steps"] == 2
    final = result["checkpoint"]
    assert os.path.isfile(os.path.join(final, "config.json"))
    assert os.path.isfile(os.path.join(final, "tokenizer_config.json"))
    assert any(f.endswith(".safetensors") for f in os.listdir(final))
    # save_hf_every=1 with keep_last=1: only the newest intermediate checkpoint stays.
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["final", "step1"]
    assert (run_dir / "config.yaml").is_file()


def test_preference_file_without_chosen_rejected_is_one_clear_error(tiny_chat_model, tmp_path, capsys, monkeypatch):
    """Through the CLI's own ``main`` in this process (the failure comes before
    any model is loaded, so a subprocess would only add start-up time)."""
    from areal_kernel.cli import main

    monkeypatch.chdir(REPO)
    bad = tmp_path / "prefs.jsonl"
    bad.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": "a"}) + "\n" for i in range(8)))
    rc = main([
        "train", os.path.join(EXAMPLES, "rm_preferences.yaml"), f"model.path={tiny_chat_model}",
        f"run_dir={tmp_path / 'run'}", f"dataset.path={bad}", "logging.sinks=[jsonl]",
    ])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("areal: error:"), err
    assert str(bad) in err[0] and "'chosen'" in err[0] and "'rejected'" in err[0] and "field_map" in err[0]


def test_pair_and_sft_record_checks_name_the_source_and_fields(tiny_chat_model):
    from transformers import AutoTokenizer

    from areal_kernel.config.offline import SFTConfig
    from areal_kernel.trainer.offline_data import ChatEncoder, check_pair_fields, encode_sft_record

    with pytest.raises(DataError, match=r"data\.jsonl.*record 1 .*\['rejected'\].*\['prompt', 'chosen', 'rejected'\]"):
        check_pair_fields([{"prompt": "p", "chosen": "a", "rejected": "b"}, {"prompt": "p", "chosen": "a"}], "data.jsonl")
    enc = ChatEncoder(AutoTokenizer.from_pretrained(tiny_chat_model), SFTConfig(), "dataset 'chat.jsonl'")
    with pytest.raises(DataError, match=r"chat\.jsonl.*neither 'messages' nor 'prompt'.*\['id', 'text'\]"):
        encode_sft_record(enc, {"id": "r0", "text": "hello"}, "assistant")
    with pytest.raises(DataError, match="no assistant turn"):
        encode_sft_record(enc, {"id": "r1", "messages": [{"role": "user", "content": "hi"}]}, "assistant")


def test_offline_config_mistakes_name_the_field(capsys):
    from areal_kernel.cli import main
    from areal_kernel.errors import ConfigError

    dpo = os.path.join(EXAMPLES, "dpo_arithmetic.yaml")
    with pytest.raises(ConfigError, match=r"algorithm\.dpo\.bta: unknown key; did you mean 'beta'"):
        load_config(dpo, ["algorithm.dpo.bta=0.2"], registry=get_registry())
    with pytest.raises(ConfigError, match=r"algorithm\.dpo\.label_smoothing"):
        load_config(dpo, ["algorithm.dpo.label_smoothing=0.7"], registry=get_registry())
    with pytest.raises(ConfigError, match=r"algorithm\.sft\.loss_aggregation"):
        sft = os.path.join(EXAMPLES, "sft_chat.yaml")
        load_config(sft, ["algorithm.sft.loss_aggregation=sum"], registry=get_registry())
    # ipo reads the dpo section (its registered settings_section); its own name is no section.
    ipo = load_config(dpo, ["algorithm.type=ipo", "algorithm.dpo.beta=0.25"], registry=get_registry())
    assert ipo.algorithm.trainer_settings.beta == 0.25
    with pytest.raises(ConfigError, match=r"algorithm\.ipo: unknown key.*whose settings are algorithm\.dpo"):
        load_config(dpo, ["algorithm.type=ipo", "algorithm.ipo.beta=0.2"], registry=get_registry())
    # sft/dpo/rm were AlgorithmConfig fields (an old run's config.yaml holds all three): a
    # section of one that algorithm.type does not select is still validated, then ignored
    # with a DeprecationWarning, until the next minor release.
    with pytest.raises(ConfigError, match=r"algorithm\.sft\.loss_aggregation"):
        load_config(dpo, ["algorithm.sft.loss_aggregation=sum"], registry=get_registry())
    with pytest.warns(DeprecationWarning, match=r"algorithm\.sft: the settings of trainer 'sft'.*does not read"):
        old = load_config(dpo, ["algorithm.sft.loss_aggregation=seq_mean"], registry=get_registry())
    assert old.algorithm.trainer_settings.beta == 0.1 and "sft" not in (old.algorithm.model_extra or {})
    # `areal check` dry-runs a rollout, which offline algorithms do not have.
    assert main(["check", os.path.join(EXAMPLES, "sft_chat.yaml")]) == 2
    assert "trains offline" in capsys.readouterr().err
