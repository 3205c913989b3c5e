"""Each offline trainer learns (trends, never times), in-process through
``run_training`` (the trainer registered as ``algorithm.type``) on a tiny
random Llama with SmolLM2's tokenizer and
chat template, with real files read through HF ``datasets``."""
import json
import os
import random

import pytest
from offline_paths import EXAMPLES

from areal_kernel.config import load_config
from areal_kernel.plugins import get_registry
from areal_kernel.trainer.common import run_training

pytestmark = pytest.mark.slow

TOPICS = [
    "apples", "rivers", "clocks", "tigers", "music", "bread", "stars", "trains", "paper", "glass",
    "wolves", "coffee", "bridges", "snow", "maps", "violins", "honey", "lamps", "islands", "boots",
    "clouds", "salt", "kites", "ferns", "dust", "ships", "chess", "wool", "caves", "owls",
]


GOOD = ["lovely", "wonderful", "delightful", "splendid", "charming", "marvellous"]
BAD = ["awful", "horrible", "dreadful", "tedious", "miserable", "appalling"]


def write_preferences(path, seed=0):
    """The same sentence with a kind word preferred to an unkind one (so
    length and layout say nothing). Each topic appears twice, with its own
    draw of words; the loader holds out a random 20% of the pairs, so a
    held-out pair is a new sentence but its topic and its words may also be in
    training: what is tested is ranking kind over unkind words in sentences
    not trained on, not transfer to unseen topics."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i, topic in enumerate(TOPICS * 2):
            f.write(json.dumps({
                "id": f"p{i}",
                "prompt": f"Describe {topic} in one sentence.",
                "chosen": f"I think {topic} are {rng.choice(GOOD)}.",
                "rejected": f"I think {topic} are {rng.choice(BAD)}.",
            }) + "\n")
    return str(path)


def run(example, model, run_dir, *overrides):
    cfg = load_config(
        os.path.join(EXAMPLES, example),
        [f"model.path={model}", f"run_dir={run_dir}", "logging.sinks=[jsonl]", *overrides], registry=get_registry(),
    )
    assert run_training(cfg) == 0
    with open(os.path.join(run_dir, "result.json")) as f:
        result = json.load(f)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    return result, metrics


def test_sft_held_out_loss_falls(tiny_chat_model, tmp_path):
    result, metrics = run(
        "sft_chat.yaml", tiny_chat_model, tmp_path / "sft", "trainer.max_steps=8", "trainer.batch_size=4",
        "actor.torch.lr=2e-3", "actor.torch.warmup_steps_proportion=0", "trainer.eval_every=4",
    )  # fmt: skip
    before, after = result["before"]["eval/loss"], result["after"]["eval/loss"]
    assert after < before - 0.5, (before, after)
    train = [m for m in metrics if "train/loss" in m]
    assert [m["step"] for m in train] == list(range(1, 9))
    assert train[-1]["train/loss"] < train[0]["train/loss"] - 0.5
    # The reported token-mean NLL is the loss under token_mean aggregation.
    assert all(m["train/nll"] == pytest.approx(m["train/loss"], rel=1e-5) for m in train)
    assert result["steps"] == 8 and result["examples"] == 32


@pytest.mark.parametrize("algo", ["dpo", "ipo"])
def test_preference_margin_and_accuracy_rise(algo, tiny_chat_model, tmp_path):
    data = write_preferences(tmp_path / "prefs.jsonl")
    yaml_path = tmp_path / "pref.yaml"
    yaml_path.write_text(
        f"algorithm: {{type: {algo}, dpo: {{beta: 0.1}}}}\n"
        f"dataset: {{type: file, path: {data}, eval_fraction: 0.2}}\n"
        "trainer: {max_steps: 10, batch_size: 4}\n"
        "actor: {backend: torch, torch: {lr: 1.0e-3}}\n"
    )
    result, metrics = run(str(yaml_path), tiny_chat_model, tmp_path / algo)
    before, after = result["before"], result["after"]
    # The policy starts as the reference: zero margin, no pair ranked right yet.
    assert before["eval/margin"] == pytest.approx(0.0, abs=1e-6) and before["eval/accuracy"] == 0.0
    # IPO scores answers by their mean token logprob: smaller margins.
    assert after["eval/margin"] > (0.2 if algo == "dpo" else 0.02)
    assert after["eval/accuracy"] >= 0.8
    assert after["eval/loss"] < before["eval/loss"]
    train = [m for m in metrics if "train/loss" in m]
    assert train[-1]["train/rewards/margin"] > train[0]["train/rewards/margin"]


def test_reward_model_beats_chance_on_held_out_pairs(tiny_chat_model, tmp_path):
    from transformers import AutoModelForSequenceClassification

    data = write_preferences(tmp_path / "prefs.jsonl")
    result, _ = run(
        "rm_preferences.yaml", tiny_chat_model, tmp_path / "rm", f"dataset.path={data}", "trainer.max_steps=10",
        "trainer.batch_size=4", "actor.torch.lr=1e-3", "trainer.eval_every=0",
    )  # fmt: skip
    before, after = result["before"]["eval/accuracy"], result["after"]["eval/accuracy"]
    assert after >= 0.8 and after > before, (before, after)
    assert result["after"]["eval/loss"] < result["before"]["eval/loss"]
    # The final checkpoint is a one-label HF sequence classifier.
    rm = AutoModelForSequenceClassification.from_pretrained(result["checkpoint"])
    assert rm.config.num_labels == 1 and type(rm).__name__ == "LlamaForSequenceClassification"
