"""The contracts a third-party author relies on (docs/plugin-authoring.md,
"What the kernel calls, and with what"), checked with a real plugin package
written to the docs (tests/kernel/plugin_packages/areal-test-contract,
pip-installed into a private directory), the real config loader, real
reward worker processes and the real ``areal`` CLI in fresh processes.

- Rewards: the validated ``reward.<name>`` section arrives as keyword
  arguments, as JSON data, in the worker process.
- Datasets: ``source(config, seed, required)`` may return a plain list (the
  kernel splits it) or ``(train, eval)``; any other shape is one clear line.
- Records are checked at load, before any server: required fields, unique
  ids (generated when absent), one line naming dataset, plugin and index.
- A plain exception from plugin code is one line naming the plugin, its
  distribution and the registered name; the traceback goes to
  ``<run_dir>/error.log`` and, with ``--debug``, to the terminal.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from areal_kernel.errors import ConfigError, DataError
from areal_kernel.testing.packages import private_plugin_fixtures

HERE = Path(__file__).resolve().parent
ORIGIN = "of plugin 'contract' (areal-test-contract 0.3.0)"


contract_site, with_contract_plugin = private_plugin_fixtures(HERE / "plugin_packages" / "areal-test-contract", "contract_site")


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory) -> str:
    """A tiny random Llama with SmolLM2's real tokenizer and chat template."""
    from areal_kernel.testing.models import make_tiny_chat_llama

    return make_tiny_chat_llama(tmp_path_factory.mktemp("contract-tiny"))


@pytest.fixture
def contract_env(contract_site) -> dict[str, str]:
    path = os.pathsep.join([str(contract_site), os.environ.get("PYTHONPATH", "")])
    return {"PYTHONPATH": path.rstrip(os.pathsep)}


def _config(*overrides: str):
    from areal_kernel.config.loader import load_config
    from areal_kernel.plugins import get_registry

    return load_config("/dev/null", list(overrides), registry=get_registry())


def _fake_model(tmp_path: Path) -> str:
    """Passes the model-path check (config.json only): enough for `areal check`
    to reach the dataset, which it loads before the tokenizer."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}\n")
    return str(tmp_path / "model")


def _check_error_line(run_areal, contract_env, tmp_path: Path, mode: str) -> str:
    """`areal check` with the contract dataset in ``mode``; the one error line it must end with."""
    proc = run_areal(
        "check", "/dev/null", f"model.path={_fake_model(tmp_path)}", "dataset.type=contract_data",
        f"dataset.contract_data.mode={mode}", env=contract_env, cwd=str(tmp_path),
    )  # fmt: skip
    return _one_error_line(proc)


def _one_error_line(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("areal: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


# -- 1. reward settings -----------------------------------------------------------


def test_reward_settings_reach_the_reward_in_its_worker(with_contract_plugin):
    """The docs' example: `reward.length_penalty: {per_token: ...}` changes the score."""
    from areal_kernel.plugins import get_registry
    from areal_kernel.trainer.components import make_reward_pool

    target = get_registry().get("reward", "length_penalty").target
    for overrides, expected in (
        (["reward.length_penalty.per_token=0.5"], 1.0 - 0.5 * 3),
        ([], 1.0 - 0.01 * 3),
    ):
        cfg = _config("reward.type=length_penalty", *overrides)
        with make_reward_pool(cfg) as pool:
            result = pool.score(target, "x y z", "x y z")
        assert result.ok, result.error
        assert result.score == pytest.approx(expected)


def test_reward_settings_arrive_as_json_values(with_contract_plugin):
    from areal_kernel.plugins import get_registry
    from areal_kernel.reward.pool import RewardPool
    from areal_kernel.trainer.components import make_reward_pool, reward_settings

    cfg = _config("reward.type=echo_value", "reward.echo_value.value=0.25", "reward.echo_value.tags=[x, y]")
    assert reward_settings(cfg) == {"value": 0.25, "tags": ["x", "y"]}  # the tuple field, as JSON carries it
    target = get_registry().get("reward", "echo_value").target
    with make_reward_pool(cfg) as pool:
        result = pool.score(target, "anything", "1")
    assert result.ok, result.error  # echo_value raises unless tags arrived as a list of str
    assert result.score == 0.25
    # No reward.echo_value section: the config model's defaults arrive, not the function's.
    defaults = _config("reward.type=echo_value")
    assert reward_settings(defaults) == {"value": 0.5, "tags": ["a"]}
    with make_reward_pool(defaults) as pool:
        assert pool.score(target, "anything", "1").score == 0.5
    with pytest.raises(ConfigError, match="'value' of reward .* is not plain JSON data"):
        RewardPool(n_workers=1, preload=(), settings={target: {"value": object()}})


@pytest.mark.slow
def test_areal_check_scores_with_the_configured_reward_settings(run_areal, contract_env, tmp_path, tiny_chat_model):
    """End to end: a reward with settings, through a real inference server
    and reward worker (the dataset returns (train, eval), as before)."""
    proc = run_areal(
        "check", "/dev/null", f"model.path={tiny_chat_model}", f"run_dir={tmp_path / 'run'}",
        "dataset.type=contract_data", "dataset.contract_data.mode=tuple", "reward.type=echo_value",
        "reward.echo_value.value=0.25", "rollout.gconfig.n_samples=2", "rollout.gconfig.max_new_tokens=2", "-n", "1",
        env=contract_env, timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("-> reward 0.25") == 2, proc.stdout[-3000:]


# -- 2. the dataset return value ----------------------------------------------------


def test_dataset_returning_a_plain_list_is_split_by_the_kernel(with_contract_plugin):
    from areal_kernel.trainer.components import load_data

    cfg = _config("dataset.type=contract_data", "dataset.eval_fraction=0.25", "seed=3")
    train, evals = load_data(cfg, ("prompt", "answer"))
    assert (len(train), len(evals)) == (6, 2)
    assert {r["id"] for r in train}.isdisjoint(r["id"] for r in evals)
    assert [r["id"] for r in load_data(cfg, ("prompt", "answer"))[1]] == [r["id"] for r in evals]  # seeded
    no_eval = _config("dataset.type=contract_data", "dataset.eval_fraction=0")
    assert [len(part) for part in load_data(no_eval, ("prompt",))] == [8, 0]


@pytest.mark.parametrize(
    "mode, shape",
    [("wrong_shape", "returned a dict;"), ("three", "returned a tuple of 3 (list, list, list);")],
)
def test_dataset_with_the_wrong_return_shape_is_one_clear_line(run_areal, contract_env, tmp_path, mode, shape):
    line = _check_error_line(run_areal, contract_env, tmp_path, mode)
    assert f"dataset 'contract_data' {ORIGIN} {shape}" in line
    assert "list of record dicts or a (train, eval) tuple" in line


# -- 3. records -------------------------------------------------------------------


def test_record_without_the_workflows_field_fails_before_any_server(run_areal, contract_env, tmp_path):
    line = _check_error_line(run_areal, contract_env, tmp_path, "no_answer")
    assert f"dataset 'contract_data' {ORIGIN}: train record 2 has no 'answer' field, which workflow 'rlvr' needs" in line
    assert not list(tmp_path.rglob("server-*.log"))  # found before anything started


def test_records_without_ids_get_documented_unique_ids(with_contract_plugin):
    from areal_kernel.trainer.components import load_data

    cfg = _config("dataset.type=contract_data", "dataset.contract_data.mode=no_id", "dataset.contract_data.n=3")
    train, evals = load_data(cfg, ("prompt", "answer"))
    assert [r["id"] for r in train] == ["contract_data:train:0", "contract_data:train:1", "contract_data:train:2"]
    assert evals == []
    # A plain list: ids are positions in the list the source returned, split afterwards.
    cfg = _config("dataset.type=contract_data", "dataset.contract_data.mode=list_no_id", "dataset.eval_fraction=0.25")
    train, evals = load_data(cfg, ("prompt", "answer"))
    ids = sorted(r["id"] for r in train + evals)
    assert ids == sorted(f"contract_data:{i}" for i in range(8)) and len(evals) == 2
    assert all(r["answer"] == str(int(r["id"].rsplit(":", 1)[1]) + 1) for r in train + evals)


@pytest.mark.parametrize(
    "mode, message",
    [
        ("dup_id", "train records 1 and 4 both have id 'q1'; ids must be unique"),
        ("not_dict", "train record 3 is a str, expected a dict of fields"),
    ],
)
def test_bad_records_name_dataset_plugin_and_index(with_contract_plugin, mode, message):
    from areal_kernel.trainer.components import load_data

    cfg = _config("dataset.type=contract_data", f"dataset.contract_data.mode={mode}")
    with pytest.raises(DataError) as info:
        load_data(cfg, ("prompt", "answer"))
    text = str(info.value)
    assert text.startswith(f"dataset 'contract_data' {ORIGIN}: ") and message in text
    assert "\n" not in text


# -- 4. exceptions from plugin code -----------------------------------------------


@pytest.mark.slow
def test_plain_exception_from_plugin_code_is_one_line_naming_the_plugin(run_areal, contract_env, tmp_path, tiny_chat_model):
    run_dir = tmp_path / "run"
    args = ["train", "/dev/null", f"model.path={tiny_chat_model}", f"run_dir={run_dir}",
            "dataset.type=contract_data", "dataset.contract_data.mode=raise"]  # fmt: skip
    proc = run_areal(*args, env=contract_env, timeout=400)
    line = _one_error_line(proc)
    assert (
        f"areal: error: dataset 'contract_data' {ORIGIN} failed: ValueError: boom from the dataset (seed 1) "
        f"(at areal_test_contract/impl.py:"
    ) in line, line
    assert f"full traceback in {run_dir / 'error.log'}" in line
    logged = (run_dir / "error.log").read_text()
    assert "Traceback (most recent call last)" in logged and "ValueError: boom from the dataset" in logged
    assert "areal_test_contract/impl.py" in logged
    debug = run_areal("--debug", *args, env=contract_env, timeout=400)
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "boom from the dataset" in debug.stderr


def test_plugin_workflow_crash_leaves_the_executor_naming_the_workflow(with_contract_plugin):
    """Episodes run in the executor's thread: past the failure budget, the
    plugin's own exception (with its traceback) reaches the controller, which
    names the plugin (`areal train` turns it into the one line above)."""
    from areal_kernel.plugins import get_registry
    from areal_kernel.plugins.blame import as_plugin_error
    from areal_kernel.rollout.executor import RolloutExecutor

    workflow = get_registry().get("workflow", "crashy").load()()
    it = iter(range(100))
    ex = RolloutExecutor(None, workflow, lambda: next(it, None), batch_size=2, max_staleness=0, max_concurrent=2,
                         max_failures=2)  # fmt: skip
    ex.start()
    try:
        with pytest.raises(KeyError) as info:
            ex.get_batch(2, timeout=30)
    finally:
        ex.stop()
    message = str(as_plugin_error(info.value))
    assert message.startswith(
        f"workflow 'crashy' {ORIGIN} failed: KeyError: 'answer' (at areal_test_contract/impl.py:"
    ), message
    assert "in CrashyWorkflow.arun_episode; rerun with --debug for the traceback)" in message


def test_areal_error_from_a_plugin_stays_its_own_line(run_areal, contract_env, tmp_path):
    line = _check_error_line(run_areal, contract_env, tmp_path, "areal_error")
    assert line == "areal: error: contract_data: the record server is down; set dataset.contract_data.mode=list"
    assert not list(tmp_path.rglob("error.log"))  # a reported user error is not a crash


# -- 5. areal check with only the documented workflow members --------------------------------


def test_check_runs_a_workflow_with_only_the_documented_members(run_areal, contract_env, tiny_chat_model, tmp_path):
    """`minimal` keeps the ``Workflow`` base's ``encode_prompt`` (it raises) and puts no ``metadata["completion"]``
    on its trajectories (both optional): `areal check` shows the prompt the
    engine continued and the decoded generated tokens instead."""
    proc = run_areal(
        "check", "/dev/null", "-n", "2", f"model.path={tiny_chat_model}", f"run_dir={tmp_path / 'run'}",
        "workflow.type=minimal", "rollout.gconfig.n_samples=2", "rollout.gconfig.max_new_tokens=6",
        env=contract_env, cwd=str(tmp_path), timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "prompt (as the model sees it)" in out and "<|im_start|>assistant" in out and "What is" in out, out
    lines = [line for line in out.splitlines() if "-> reward" in line]
    assert len(lines) == 4, out
    # Six random tokens of a 49k vocabulary decode to text; an empty one means the fallback is missing.
    assert all("completion ''" not in line for line in lines), lines
