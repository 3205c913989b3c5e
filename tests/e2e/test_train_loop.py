"""`areal train` and `areal check` end to end in real processes, on a tiny
random model with SmolLM2's tokenizer: the loop's mechanics (servers,
executor, staleness bound, both weight transports, checkpoints, metrics)."""
import json
import os

import pytest
from e2e_paths import EXAMPLE


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("transport, staleness", [("broadcast", 1), ("disk", 0)])
def test_train_runs_the_async_loop(run_areal, tiny_chat_model, tmp_path, transport, staleness):
    run_dir = str(tmp_path / "run")
    proc = run_areal(
        "train", EXAMPLE,
        f"model.path={tiny_chat_model}", f"run_dir={run_dir}", "trainer.max_steps=3", "trainer.batch_size=2",
        "trainer.eval_size=4", "rollout.gconfig.n_samples=4", "rollout.gconfig.max_new_tokens=6",
        f"rollout.max_staleness={staleness}", f"weight_update.mode={transport}", "algorithm.dynamic_filter=false",
        "logging.sinks=[console, jsonl, tensorboard]",
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "held-out greedy accuracy before training" in proc.stdout
    assert "held-out greedy accuracy: before" in proc.stdout
    assert "step 3/3" in proc.stdout  # console progress
    evals = [r for r in read_metrics(run_dir) if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 3]  # before and after training
    # Both, kept apart: the fraction solved and the mean reward (0/1 here: equal).
    assert all(0.0 <= r["eval/accuracy"] <= 1.0 and r["eval/reward"] == r["eval/accuracy"] for r in evals)
    steps = [r for r in read_metrics(run_dir) if "perf/step_s" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["version"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["rollout/staleness_max"] <= staleness
        assert r["batch/sequences"] == 8
        assert r["train/skipped"] == 0.0
        assert r["weights/mb"] > 1
    result = json.load(open(os.path.join(run_dir, "result.json")))
    assert result["steps"] == 3 and result["samples"] == 24
    final = result["checkpoint"]
    assert os.path.isfile(os.path.join(final, "config.json"))
    assert any(f.endswith(".safetensors") for f in os.listdir(final))
    assert os.path.isfile(os.path.join(final, "tokenizer_config.json"))
    assert os.listdir(os.path.join(run_dir, "tensorboard"))
    assert os.path.isfile(os.path.join(run_dir, "config.yaml"))
    # The transport's files went with it (close()): the checkpoints hold the weights.
    assert not os.path.exists(os.path.join(run_dir, "weights")), os.listdir(os.path.join(run_dir, "weights"))


def test_check_prints_scored_trajectories(run_areal, tiny_chat_model, tmp_path):
    proc = run_areal(
        "check", EXAMPLE, "-n", "2", f"model.path={tiny_chat_model}", f"run_dir={tmp_path / 'run'}",
        "rollout.gconfig.n_samples=2", "rollout.gconfig.max_new_tokens=4",
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.count("-> reward") == 4
    assert "prompt (as the model sees it)" in out and "What is" in out and "<|im_start|>assistant" in out
    assert "versions [0]" in out
    assert "samples scored above 0" in out
