"""The `areal` CLI in real subprocesses."""
import json
import os
import sys

import yaml


def test_validate_prints_resolved_yaml(run_areal, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("experiment_name: demo\ntrainer:\n  batch_size: 2\n")
    proc = run_areal("validate", str(cfg), "trainer.max_steps=3")
    assert proc.returncode == 0, proc.stderr
    data = yaml.safe_load(proc.stdout)
    assert data["experiment_name"] == "demo" and data["trainer"]["batch_size"] == 2 and data["trainer"]["max_steps"] == 3
    assert data["actor"]["torch"]["lr"] > 0  # the backend section, filled from its model's defaults
    assert "valid" in proc.stderr


def test_errors_are_one_clear_message_without_traceback(run_areal, tmp_path):
    proc = run_areal("validate", str(tmp_path / "missing.yaml"))
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"areal: error: {tmp_path / 'missing.yaml'}: config file not found"
    debug = run_areal("--debug", "validate", str(tmp_path / "missing.yaml"))
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_plan_reports_roles_and_fit(run_areal):
    proc = run_areal("plan", "/dev/null", "actor.backend=torch:d2", "rollout.backend=embedded:d2", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    roles = {r["role"]: r for r in plan["roles"]}
    assert roles["actor"]["processes"] == 2 and roles["rollout"]["processes"] == 2
    assert plan["devices_needed"] == 4 and plan["platform"] == "cpu"
    assert plan["available_devices"] == os.cpu_count()
    human = run_areal("plan", "/dev/null")
    assert "actor" in human.stdout and "fits: yes" in human.stdout
    sft = json.loads(run_areal("plan", "/dev/null", "algorithm.type=sft", "--json").stdout)
    assert [r["role"] for r in sft["roles"]] == ["actor"]  # offline: no inference servers


def test_doctor_reports_health(run_areal, plugin_env):
    proc = run_areal("doctor", "--json", env={**plugin_env, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["platform"]["name"] == "cpu" and report["torch"]
    assert report["plugins"]["builtin"] == "loaded" and report["plugins"]["broken"] == "failed"
    assert any("plugin 'broken' failed" in p for p in report["problems"])


def test_doctor_counts_what_plan_counts_in_plain_text(run_areal):
    plan = json.loads(run_areal("plan", "/dev/null", "--json").stdout)
    report = json.loads(run_areal("doctor", "--json").stdout)
    # What the schedulers place processes on (host cores here), the number plan uses, with its unit.
    assert report["platform"]["compute_units"] == plan["available_devices"]
    assert report["platform"]["compute_unit"] == plan["device_unit"]
    human = run_areal("doctor").stdout
    devices = next(line for line in human.splitlines() if line.startswith("devices "))
    assert f"{plan['available_devices']} {plan['device_unit']}" in devices and "areal plan" in devices, human
    assert "{" not in human and "': " not in human, human  # no raw Python dicts


def test_a_reader_that_closes_the_pipe_gets_no_traceback():
    """`areal schema | head -2`: the reader is gone before the output ends."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "areal_kernel.cli", "schema"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=dict(os.environ, OMP_NUM_THREADS="1"))  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.read(10)  # the output began (it is ~90 kB: more than a pipe holds)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    rc = proc.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert rc == 141, (rc, err)  # 128 + SIGPIPE, what a shell shows for a command a closed pipe ended


def test_no_command_prints_help(run_areal):
    proc = run_areal()
    assert proc.returncode == 2 and "usage: areal" in proc.stdout


def test_logs_follow_the_current_stderr(monkeypatch, capsys):
    """Logging set up while another stream was sys.stderr (a test's capture,
    an embedding application) writes to the stderr of the moment, not to the
    old stream, which may be closed by then."""
    import io
    import sys

    from areal_kernel.logging import get_logger, setup_logging

    old = io.StringIO()
    monkeypatch.setattr(sys, "stderr", old)
    setup_logging(level="info")
    monkeypatch.undo()
    old.close()
    get_logger("t").info("after the swap", k=2)
    assert "after the swap" in capsys.readouterr().err
    setup_logging()


def test_json_logging(tmp_path):
    import io

    from areal_kernel.logging import get_logger, setup_logging

    buf = io.StringIO()
    setup_logging(level="info", json_logs=True, stream=buf)
    get_logger("t").info("hello", step=3)
    row = json.loads(buf.getvalue().strip().splitlines()[-1])
    assert row["event"] == "hello" and row["step"] == 3 and row["level"] == "info"
    buf2 = io.StringIO()
    setup_logging(level="warning", json_logs=False, stream=buf2)
    get_logger("t").info("hidden")
    get_logger("t").warning("shown", k=1)
    text = buf2.getvalue()
    assert "hidden" not in text and "shown" in text and "k=1" in text
    setup_logging()


def test_the_kernels_deprecations_reach_the_terminal(tmp_path):
    """A 0.1-style config (an algorithm.sft section under algorithm.type grpo)
    gets its deprecation warning through `areal validate`; the same resolve
    in a plain Python process shows nothing (Python hides DeprecationWarning
    outside __main__), which is why the CLI turns the kernel's own on."""
    import subprocess

    cfg = tmp_path / "old.yaml"
    cfg.write_text("algorithm:\n  type: grpo\n  sft: {}\n")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONWARNINGS", None)
    cli = subprocess.run([sys.executable, "-m", "areal_kernel.cli", "validate", str(cfg)],
                         capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert "ArealDeprecationWarning: algorithm.sft: the settings of trainer 'sft'" in cli.stderr, cli.stderr[-3000:]
    plain = subprocess.run(
        [sys.executable, "-c", "from areal_kernel.config import load_config; from areal_kernel.plugins import "
         f"get_registry; load_config({str(cfg)!r}, [], registry=get_registry())"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert "DeprecationWarning" not in plain.stderr, plain.stderr[-3000:]
