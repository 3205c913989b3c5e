"""The example configs ship inside the package: `areal examples` lists them,
copies one out, and every config argument takes an example's name. Run as
real `areal` processes from a directory outside the repository; the last
test builds the kernel's wheel and trains from it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from areal_kernel import example_configs

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def outside(tmp_path, run_areal):
    """`areal ARGS` in an empty directory outside the repository, importing
    this checkout's kernel (run from elsewhere, `python -m` would find
    whatever copy the environment has installed)."""
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    assert not str(cwd).startswith(str(REPO))

    def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return run_areal(*args, cwd=str(cwd), env={"PYTHONPATH": str(REPO)}, timeout=timeout)

    run.cwd = cwd  # type: ignore[attr-defined]
    return run


def test_every_example_file_is_named_or_says_why_not():
    files = {p.name for p in (REPO / "examples").glob("*.yaml")}
    named = {e.file for e in example_configs.EXAMPLES}
    assert files == named | set(example_configs.NOT_NAMED), "name the new example or add it to NOT_NAMED"
    assert not named & set(example_configs.NOT_NAMED)
    # One copy of each file: the package's examples are the repository's.
    assert os.path.samefile(example_configs.examples_dir(), REPO / "examples")
    assert len(set(example_configs.names())) == len(example_configs.EXAMPLES)


def test_listing_names_and_describes_every_example(outside):
    proc = outside("examples")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for e in example_configs.EXAMPLES:
        assert any(line.split()[:1] == [e.name] and e.description in line for line in lines), e.name
    assert "areal examples copy NAME" in proc.stdout
    for e in example_configs.NOT_NAMED:
        assert e.removesuffix(".yaml").replace("_", "-") not in proc.stdout


def test_validate_by_name_outside_the_repository(outside):
    proc = outside("validate", "grpo-arithmetic", "trainer.max_steps=3")
    assert proc.returncode == 0, proc.stderr
    data = yaml.safe_load(proc.stdout)
    original = yaml.safe_load((REPO / "examples" / "grpo_arithmetic.yaml").read_text())
    assert data["experiment_name"] == original["experiment_name"] == "grpo-arithmetic"
    assert data["trainer"]["max_steps"] == 3 and data["trainer"]["batch_size"] == original["trainer"]["batch_size"]
    assert data["model"]["path"] == "smollm2-135m-instruct"
    assert proc.stderr.strip().endswith("grpo_arithmetic.yaml: valid")
    # The file's stem names the same example.
    assert outside("validate", "grpo_arithmetic", "trainer.max_steps=3").stdout == proc.stdout


def test_shipped_data_resolves_from_anywhere(outside, run_areal):
    for name, key in (("sft-chat", "sft_chat.jsonl"), ("rm-preferences", "preferences.jsonl")):
        proc = outside("validate", name, "--json")
        assert proc.returncode == 0, proc.stderr
        path = json.loads(proc.stdout)["dataset"]["path"]
        assert os.path.isabs(path) and os.path.samefile(path, REPO / "examples" / "data" / key)
    # From the repository root the written relative path exists and is kept.
    proc = run_areal("validate", "examples/sft_chat.yaml", "--json", cwd=str(REPO))
    assert json.loads(proc.stdout)["dataset"]["path"] == "examples/data/sft_chat.jsonl"
    # A config of one's own is never rewritten: its missing file stays missing.
    own = outside.cwd / "own.yaml"
    own.write_text("algorithm: {type: sft}\ndataset: {type: file, path: examples/data/sft_chat.jsonl}\n")
    proc = outside("validate", str(own), "--json")
    assert json.loads(proc.stdout)["dataset"]["path"] == "examples/data/sft_chat.jsonl"


def test_a_file_of_that_name_wins(outside):
    (outside.cwd / "grpo-arithmetic").write_text("experiment_name: mine\n")
    proc = outside("validate", "grpo-arithmetic")
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["experiment_name"] == "mine"


@pytest.mark.parametrize("command", ["validate", "train", "check", "plan"])
def test_unknown_name_is_one_line_listing_the_examples(outside, command):
    proc = outside(command, "grpo-arithmatic", "trainer.max_steps=1")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("areal: error: grpo-arithmatic: "), proc.stderr
    assert all(name in lines[0] for name in example_configs.names())
    assert "`areal examples`" in lines[0] and proc.stdout == ""


def test_a_missing_file_is_not_replaced_by_an_example(outside):
    # Something that looks like a file keeps the loader's message, even when
    # it is an example's file name.
    for missing in ("missing.yaml", "grpo_arithmetic.yaml", "sub/grpo-arithmetic"):
        proc = outside("validate", missing)
        assert proc.stderr.strip() == f"areal: error: {missing}: config file not found"


def test_copy_writes_a_runnable_file_and_never_overwrites(outside):
    proc = outside("examples", "copy", "sft-chat")
    assert proc.returncode == 0, proc.stderr
    copied = outside.cwd / "sft_chat.yaml"
    original = (REPO / "examples" / "sft_chat.yaml").read_text()
    text = copied.read_text()
    # Comments kept; only the shipped data's path changed, to an absolute one.
    changed = [(a, b) for a, b in zip(original.splitlines(), text.splitlines()) if a != b]
    assert len(text.splitlines()) == len(original.splitlines()) and len(changed) == 1, changed
    data_path = yaml.safe_load(text)["dataset"]["path"]
    assert os.path.samefile(data_path, REPO / "examples" / "data" / "sft_chat.jsonl")
    assert outside("validate", "sft_chat.yaml").returncode == 0

    copied.write_text("# edited\n" + text)
    again = outside("examples", "copy", "sft-chat")
    assert again.returncode == 2
    assert again.stderr.strip().splitlines() == [
        "areal: error: sft_chat.yaml exists; not overwriting it (give another DEST: areal examples copy sft-chat DEST)"
    ]
    assert copied.read_text().startswith("# edited\n")

    (outside.cwd / "mine").mkdir()
    assert outside("examples", "copy", "grpo-arithmetic", "mine").returncode == 0
    assert (outside.cwd / "mine" / "grpo_arithmetic.yaml").read_text() == (
        REPO / "examples" / "grpo_arithmetic.yaml"
    ).read_text()  # no shipped data referenced: byte for byte
    assert outside("examples", "copy", "grpo-arithmetic", "mine/g.yaml").returncode == 0
    bad = outside("examples", "copy", "nope")
    assert bad.returncode == 2 and "`areal examples`" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def _build_wheel(tmp_path: Path) -> Path:
    """The kernel's wheel, built from a copy of what the build reads (the
    checkout stays clean: setuptools writes build/ and *.egg-info)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "areal_kernel", src / "areal_kernel", symlinks=True, ignore=ignore)
    shutil.copytree(REPO / "examples", src / "examples", symlinks=True, ignore=ignore)
    out = tmp_path / "wheel"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (wheel,) = out.glob("areal_kernel-*.whl")
    return wheel


@pytest.mark.slow
def test_the_built_wheel_ships_the_examples_and_trains_one_by_name(tmp_path, areal_tiny_chat_model_dir):
    wheel = _build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    for e in example_configs.EXAMPLES:
        assert f"areal_kernel/examples/{e.file}" in names, e.file
    for data in (REPO / "examples" / "data").glob("*.jsonl"):
        assert f"areal_kernel/examples/data/{data.name}" in names
    # Configs and data only: the repository's scripts and example plugin stay out.
    assert not [n for n in names if n.startswith("areal_kernel/examples/") and not n.endswith((".yaml", ".jsonl"))]

    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    run_dir = cwd / "run"
    # One process: where its kernel came from, then the run. The environment's
    # other packages (torch, transformers, plugins) come from the venv.
    script = (
        "import sys, areal_kernel; print('kernel:', areal_kernel.__file__, flush=True); "
        "from areal_kernel.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    args = [
        "train", "grpo-arithmetic", f"model.path={areal_tiny_chat_model_dir}", f"run_dir={run_dir}",
        "trainer.max_steps=1", "trainer.batch_size=2", "trainer.eval_size=0", "rollout.gconfig.n_samples=4",
        "rollout.gconfig.max_new_tokens=6", "weight_update.mode=disk", "logging.sinks=[jsonl]",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=600, cwd=str(cwd), env=env
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    kernel = proc.stdout.split("kernel: ", 1)[1].split("\n", 1)[0]
    assert Path(kernel).resolve().is_relative_to(site.resolve()), kernel
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["version"] for r in rows if "perf/step_s" in r] == [1]
    # The config the run saved is the shipped example's, with the overrides.
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["experiment_name"] == "grpo-arithmetic" and saved["trainer"]["max_steps"] == 1
