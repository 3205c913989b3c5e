"""The root conftest's rule: under ``CI=true`` a skip without a hardware
reason is a failure. Run through real pytest subprocesses on a scratch
project holding a copy of the root conftest.py."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

TESTS = '''
import pytest

def test_plain_skip():
    pytest.skip("a library is missing")

@pytest.mark.skipif(True, reason="a condition")
def test_skipif():
    pass

@pytest.mark.needs_hardware("cuda", reason="no GPU on this machine")
def test_cuda_skip():
    pytest.skip("no GPU")

@pytest.mark.needs_hardware("npu", "sglang", reason="no NPU")
@pytest.mark.skipif(True, reason="no NPU")
def test_npu_skipif():
    pass

@pytest.fixture
def needs_thing():
    pytest.skip("the thing is not installed")

def test_skip_in_fixture(needs_thing):
    pass

@pytest.mark.xfail(reason="known", strict=True)
def test_xfail():
    assert False

def test_passes():
    pass
'''


def _run(project: Path, ci: str | None, *args: str) -> tuple[dict[str, str], str]:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "-p", "no:xdist", *args],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    # -rA's short summary: "PASSED test_x.py::test_y", "SKIPPED [1] test_x.py:3: reason", ...
    outcomes = {}
    for m in re.finditer(r"^(PASSED|FAILED|SKIPPED|XFAIL|ERROR) (?:\[\d+\] )?\S*?::?(test_\w+)", out, re.M):
        outcomes[m.group(2)] = m.group(1)
    return outcomes, out


@pytest.fixture
def project(tmp_path: Path) -> Path:
    shutil.copy(REPO / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_x.py").write_text(TESTS)
    return tmp_path


def test_under_ci_a_skip_without_hardware_reason_fails(project: Path):
    outcomes, out = _run(project, "true")
    assert outcomes.get("test_plain_skip") == "FAILED", out
    # A skip in the setup phase (skipif, a fixture) fails there: pytest calls that an error.
    assert outcomes.get("test_skipif") == "ERROR", out
    assert outcomes.get("test_skip_in_fixture") == "ERROR", out
    assert "CI=true: this test skipped without a hardware reason: a library is missing" in out
    assert outcomes.get("test_passes") == "PASSED", out
    assert outcomes.get("test_xfail") == "XFAIL", out


def test_under_ci_a_hardware_marked_skip_stays_a_skip(project: Path):
    out = _run(project, "true", "-k", "cuda or npu or passes")[1]
    # The SKIPPED summary lines name the file and line, not the test: count them.
    assert re.search(r"\b1 passed, 2 skipped\b", out), out
    assert "FAILED" not in out and "ERROR" not in out, out


def test_without_ci_every_skip_stays_a_skip(project: Path):
    for ci in (None, "false", ""):
        out = _run(project, ci)[1]
        assert re.search(r"\b1 passed, 5 skipped, 1 xfailed\b", out), (ci, out)


def test_under_ci_a_module_level_skip_fails_collection(project: Path):
    (project / "test_x.py").write_text("import pytest\npytest.importorskip('no_such_module_areal')\n\ndef test_a():\n    pass\n")
    proc_out = _run(project, "true")[1]
    assert "CI=true: test_x.py skipped while being collected" in proc_out, proc_out
    assert re.search(r"\b1 error\b", proc_out), proc_out
    assert re.search(r"\b1 skipped\b", _run(project, None)[1])


def test_a_marker_without_a_known_kind_or_reason_is_refused(project: Path):
    (project / "test_x.py").write_text(
        "import pytest\n\n@pytest.mark.needs_hardware('tpu', reason='x')\ndef test_a():\n    pytest.skip('no tpu')\n"
    )
    out = _run(project, "true")[1]
    assert "needs_hardware takes one or more of ['cuda', 'npu', 'sglang']" in out, out
