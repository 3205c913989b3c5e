"""Trainers are registered parts: ``algorithm.type`` is any registered
trainer's name. A real third-party plugin package
(tests/kernel/plugin_packages/areal-test-trainer, pip-installed into a
private directory) registers ``count_up`` with its own settings, and the real
``areal`` CLI runs it in a fresh process under the contract of
``areal_kernel.api.trainer`` (docs/plugin-authoring.md, Trainers)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from areal_kernel.testing.packages import pip_install_private, use_private_site

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


@pytest.fixture(scope="module")
def trainer_site(tmp_path_factory) -> Path:
    return pip_install_private(HERE / "plugin_packages" / "areal-test-trainer", tmp_path_factory.mktemp("trainer"))


@pytest.fixture
def trainer_env(trainer_site) -> dict[str, str]:
    path = os.pathsep.join([str(trainer_site), os.environ.get("PYTHONPATH", "")])
    return {"PYTHONPATH": path.rstrip(os.pathsep)}


def _one_error_line(proc) -> str:
    """The CLI's error: one ``areal: error:`` line (a config error adds the
    field's line below it), no traceback, exit code 2."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("areal: error:")]
    assert len(starts) == 1, proc.stderr[-3000:]
    rest = lines[starts[0]:]
    assert len(rest) <= 2, proc.stderr[-3000:]
    return " ".join(rest)


def test_areal_train_runs_a_plugin_trainer_with_its_settings(run_areal, trainer_env, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_areal(
        "train", "/dev/null", "algorithm.type=count_up", "algorithm.count_up={steps: 4, start: 10, increment: 0.5}",
        f"run_dir={run_dir}", "logging.sinks=[jsonl]", env=trainer_env, cwd=str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((run_dir / "result.json").read_text())
    # The settings arrived validated (the plugin's model; "10" became 10.0) and the loop ran to the end.
    assert result == {"trainer": "count_up", "steps": 4, "value": 12.0, "settings_type": "CountUpSettings"}
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert [m["train/value"] for m in metrics] == [10.5, 11.0, 11.5, 12.0]
    closed = [json.loads(line) for line in (run_dir / "closed.json").read_text().splitlines()]
    assert closed == [{"status": "completed"}]
    saved = (run_dir / "config.yaml").read_text()
    assert "type: count_up" in saved and "increment: 0.5" in saved  # the section is kept in config.yaml


def test_plugin_trainer_defaults_and_listing(run_areal, trainer_env, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_areal(
        "train", "/dev/null", "algorithm.type=count_up", f"run_dir={run_dir}", "logging.sinks=[jsonl]",
        env=trainer_env, cwd=str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    # No algorithm.count_up section: the config model's defaults (3 steps of 1.0 from 0).
    assert json.loads((run_dir / "result.json").read_text())["value"] == 3.0
    schema = json.loads(run_areal("schema", env=trainer_env).stdout)
    assert "steps" in schema["$defs"]["AlgorithmConfig"]["properties"]["count_up"]["properties"]  # for editors
    listed = json.loads(run_areal("plugins", "--json", env=trainer_env).stdout)
    rec = next(p for p in listed["plugins"] if p["name"] == "testtrainer")
    assert rec["registers"] == ["trainer:count_up"], rec


def test_bad_plugin_trainer_settings_are_one_error_naming_the_field(run_areal, trainer_env, tmp_path):
    proc = run_areal(
        "train", "/dev/null", "algorithm.type=count_up", "algorithm.count_up={increment: -1}",
        f"run_dir={tmp_path / 'run'}", env=trainer_env, cwd=str(tmp_path),
    )  # fmt: skip
    line = _one_error_line(proc)
    assert "algorithm.count_up.increment" in line and "greater than 0" in line, line
    assert not (tmp_path / "run").exists()  # refused before anything was written
    typo = _one_error_line(run_areal(
        "validate", "/dev/null", "algorithm.type=count_up", "algorithm.count_up={stepz: 2}", env=trainer_env,
    ))  # fmt: skip
    assert "algorithm.count_up.stepz" in typo and "did you mean 'steps'" in typo, typo


def test_unknown_trainer_lists_the_registered_ones(run_areal, trainer_env):
    line = _one_error_line(run_areal("validate", "/dev/null", "algorithm.type=count_down", env=trainer_env))
    assert "algorithm.type" in line and "no trainer named 'count_down'" in line, line
    assert "Available: count_up, dpo, grpo, ipo, rm, sft." in line, line
    assert "Did you mean 'count_up'?" in line, line
    # Without the plugin the name is unknown, and the message says what is there.
    alone = _one_error_line(run_areal("validate", "/dev/null", "algorithm.type=count_up"))
    assert "Available: dpo, grpo, ipo, rm, sft." in alone, alone


def test_an_rl_part_named_as_trainer_says_where_it_goes(run_areal):
    line = _one_error_line(run_areal("validate", "/dev/null", "algorithm.type=gae"))
    assert "'gae' is a registered advantage_estimator: select it with algorithm.advantage: gae" in line, line


def test_plugin_trainer_crash_names_the_plugin(run_areal, trainer_env, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_areal(
        "train", "/dev/null", "algorithm.type=count_up", "algorithm.count_up={fail_at: 2}", f"run_dir={run_dir}",
        "logging.sinks=[jsonl]", env=trainer_env, cwd=str(tmp_path),
    )  # fmt: skip
    line = _one_error_line(proc)
    assert "trainer 'count_up' of plugin 'testtrainer' (areal-test-trainer 0.1.0)" in line, line
    assert "count_up broke at step 2" in line, line
    assert "count_up broke at step 2" in (run_dir / "error.log").read_text()
    closed = [json.loads(line) for line in (run_dir / "closed.json").read_text().splitlines()]
    assert closed == [{"status": "failed"}]
    assert not (run_dir / "result.json").exists()


def test_trainer_without_rollout_is_offline_for_check_and_plan(run_areal, trainer_env):
    plan = json.loads(run_areal("plan", "/dev/null", "algorithm.type=count_up", "--json", env=trainer_env).stdout)
    assert [r["role"] for r in plan["roles"]] == ["actor"]
    line = _one_error_line(run_areal("check", "/dev/null", "algorithm.type=count_up", env=trainer_env))
    assert "algorithm.type 'count_up' trains offline" in line, line


def test_builtin_trainers_are_registered_like_a_plugins(areal_env, trainer_site, monkeypatch):
    use_private_site(trainer_site, monkeypatch, areal_env)
    from areal_kernel.api.trainer import Trainer
    from areal_kernel.plugins import get_registry

    reg = get_registry()
    specs = {s.name: s for s in reg.specs("trainer")}
    assert set(specs) == {"count_up", "grpo", "sft", "dpo", "ipo", "rm"}
    assert {n for n, s in specs.items() if s.plugin == "builtin"} == {"grpo", "sft", "dpo", "ipo", "rm"}
    assert {n for n, s in specs.items() if "rollout" in s.capabilities} == {"grpo"}
    for spec in specs.values():
        assert issubclass(spec.load(), Trainer), spec.name
