"""Every RL example config is valid through `areal validate` (the real CLI and
config loader), and the PPO one runs real `areal train` steps on CPU with a
tiny random Llama that has SmolLM2's tokenizer."""
from __future__ import annotations

import json
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RL_EXAMPLES = {
    "grpo_arithmetic.yaml": ("grpo", "ppo"),
    "dr_grpo_arithmetic.yaml": ("dr_grpo", "ppo"),
    "dapo_arithmetic.yaml": ("grpo", "ppo"),
    "rloo_arithmetic.yaml": ("rloo", "ppo"),
    "reinforce_pp_arithmetic.yaml": ("reinforce_pp", "ppo"),
    "gspo_arithmetic.yaml": ("grpo", "ppo"),
    "ppo_arithmetic.yaml": ("gae", "ppo"),
    "grpo_multi_turn.yaml": ("grpo", "ppo"),
    "grpo_lora.yaml": ("grpo", "ppo"),
    "two_tasks_arithmetic.yaml": ("grpo", "ppo"),
}


@pytest.mark.parametrize("name", sorted(RL_EXAMPLES))
def test_example_validates(run_areal, name):
    path = os.path.join(REPO, "examples", name)
    proc = run_areal("validate", path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"{path}: valid" in proc.stderr
    from areal_kernel.config.loader import load_config
    from areal_kernel.plugins import get_registry

    a = load_config(path, registry=get_registry()).algorithm
    assert (a.advantage, a.loss) == RL_EXAMPLES[name]


def test_example_knobs_are_the_documented_ones():
    from areal_kernel.config.loader import load_config
    from areal_kernel.plugins import get_registry

    ex = lambda n: load_config(os.path.join(REPO, "examples", n), registry=get_registry()).algorithm  # noqa: E731
    assert ex("dapo_arithmetic.yaml").eps_clip_high == 0.28 and ex("dapo_arithmetic.yaml").overlong_buffer_len == 4
    assert ex("gspo_arithmetic.yaml").ratio_level == "sequence"
    assert ex("dr_grpo_arithmetic.yaml").loss_agg == "seq-mean-token-sum"
    assert ex("reinforce_pp_arithmetic.yaml").kl_in == "reward"
    assert ex("ppo_arithmetic.yaml").prox_interpolate and ex("ppo_arithmetic.yaml").ppo_n_minibatches == 2
    mt = load_config(os.path.join(REPO, "examples", "grpo_multi_turn.yaml"), registry=get_registry()).workflow
    assert mt.type == "multi_turn" and (mt.plugin_config.max_turns, mt.plugin_config.turn_discount) == (2, 0.5)
    lora = load_config(os.path.join(REPO, "examples", "grpo_lora.yaml"), registry=get_registry()).actor.plugin_config.lora
    lora_fields = lambda c: c.model_dump(include={"rank", "alpha", "dropout", "target_modules"})  # noqa: E731
    assert (lora.rank, lora.alpha, lora.name, lora.export) == (16, 32, "policy", "adapter")
    assert len(lora.target_modules) == 7
    two = load_config(os.path.join(REPO, "examples", "two_tasks_arithmetic.yaml"), registry=get_registry())
    # Each policy is grpo_lora.yaml's adapter for its own task.
    assert {n: p.lora for n, p in two.policies.items()} == {"add": lora_fields(lora), "sub": lora_fields(lora)}
    assert two.policies["sub"].dataset == {"arithmetic": {"ops": ["-"]}} and two.dataset.arithmetic.ops == ["+"]


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory):
    from areal_kernel.testing.models import make_tiny_chat_llama

    return make_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat-algo"))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ppo_arithmetic.yaml"])
def test_example_trains_a_few_steps(run_areal, tiny_chat_model, tmp_path, name):
    """PPO exercises what the GRPO e2e tests do not: the critic, two
    minibatches per batch and the interpolated proximal policy in `areal train`."""
    run_dir = str(tmp_path / "run")
    proc = run_areal(
        "train", os.path.join(REPO, "examples", name),
        f"model.path={tiny_chat_model}", f"run_dir={run_dir}", "trainer.max_steps=2", "trainer.batch_size=2",
        "trainer.eval_size=2", "rollout.gconfig.n_samples=4", "rollout.gconfig.max_new_tokens=6",
        "weight_update.mode=disk", "logging.sinks=[jsonl]",
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if "perf/step_s" in r]
    assert [r["version"] for r in steps] == [1, 2]
    for r in steps:
        assert r["train/skipped"] == 0.0
        if name.startswith("ppo"):
            assert "train/critic_value_loss" in r and r["train/critic_skipped"] == 0.0
        else:
            assert "train/kl" in r  # the reference model scored the batch
