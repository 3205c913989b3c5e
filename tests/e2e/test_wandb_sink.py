"""The built-in ``wandb`` metric sink in offline mode through a real
``areal train``: the metrics are read back from the offline run directory
with wandb's own record format (protobuf ``Record`` messages in its
LevelDB-style log), not from anything the sink reports about itself."""
import glob
import json
import os

import pytest
import wandb  # noqa: F401  a test dependency (requirements-test.txt): missing is an error, not a skip
from e2e_paths import EXAMPLE

from areal_kernel.testing.readback import wandb_history



def test_wandb_offline_run_holds_the_logged_metrics(run_areal, tiny_chat_model, tmp_path):
    run_dir = tmp_path / "run"
    wandb_dir = tmp_path / "wandb-files"
    wandb_dir.mkdir()
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true"}
    proc = run_areal(
        "train", EXAMPLE,
        f"model.path={tiny_chat_model}", f"run_dir={run_dir}", "trainer.max_steps=2", "trainer.batch_size=2",
        "trainer.eval_size=2", "rollout.gconfig.n_samples=2", "rollout.gconfig.max_new_tokens=4",
        "algorithm.dynamic_filter=false", "checkpoint.save_every=0",
        "logging.sinks=[jsonl, wandb]", "logging.wandb={project: areal-test, mode: offline, tags: [e2e]}",
        env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = glob.glob(str(wandb_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1, sorted(os.listdir(wandb_dir))
    history = wandb_history(runs[0])
    jsonl: dict[int, dict] = {}
    with open(run_dir / "metrics.jsonl") as f:
        for row in map(json.loads, f):  # a step's train row and eval row are separate lines
            jsonl.setdefault(row["step"], {}).update(row)
    assert sorted(history) == sorted(jsonl) == [0, 1, 2]  # eval at 0, train steps 1 and 2 (+ final eval at 2)
    for step in (1, 2):
        for key in ("reward/mean", "train/loss", "perf/step_s"):
            assert history[step][key] == pytest.approx(jsonl[step][key]), (step, key)
    assert history[2]["eval/accuracy"] == pytest.approx(jsonl[2]["eval/accuracy"])
