"""areal-npu without NPUs: the probe and ``AREAL_PLATFORM=npu`` without
torch_npu, ``areal plugins`` and ``areal doctor``, and the tests that need the
TEST-ONLY torch_npu STAND-IN (host compute; nothing here ran on an Ascend
NPU), which run in a pytest process of their own (``standin_suite.py``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# What standin_suite.py holds; a run that collects fewer (or skips any) fails.
STANDIN_SUITE_TESTS = 14


def test_standin_suite_in_its_own_process(standin_env):
    """The kernel's PlatformContract against NPUPlatform and the NPU variant of
    every piece, with the torch_npu stand-in importable (see standin_suite.py)."""
    env = {**os.environ, **standin_env, "AREAL_NPU_STANDIN_PROCESS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(HERE / "standin_suite.py"), "-q", "-p", "no:cacheprovider", "-rA"],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=str(HERE.parent.parent.parent),
    )
    tail = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    summary = re.search(r"^=* ?(\d+) passed(.*) in [\d.]+s", proc.stdout, re.MULTILINE)
    assert summary is not None, tail
    assert int(summary.group(1)) == STANDIN_SUITE_TESTS and not summary.group(2).strip(), tail


def test_probe_absent_selects_nothing_and_imports_nothing():
    """Without torch_npu: the probe answers None, the platform is cpu, and
    neither torch, torch_npu nor the platform module was imported."""
    code = (
        "import json, sys\n"
        "from areal_npu.plugin import probe\n"
        "from areal_kernel.platforms import current_platform\n"
        "answer = probe()\n"
        "name = current_platform().name\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torch_npu') or m == 'areal_npu.platform')\n"
        "print(json.dumps([answer, name, heavy]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [None, "cpu", []]


def test_areal_platform_npu_without_torch_npu_is_one_clear_line(run_areal, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("rollout:\n  backend: vllm:d1t2\n", encoding="utf-8")
    proc = run_areal("plan", str(cfg), env={"AREAL_PLATFORM": "npu"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("areal: error: AREAL_PLATFORM='npu' is not usable: torch_npu is not installed")
    assert "docs/npu.md" in lines[0]


def test_areal_plugins_lists_npu(run_areal):
    proc = run_areal("plugins", "--json")
    assert proc.returncode == 0, proc.stderr
    rec = next(r for r in json.loads(proc.stdout)["plugins"] if r["name"] == "npu")
    assert rec["distribution"] == "areal-npu" and rec["status"] == "loaded", rec
    assert "platform:npu" in rec["registers"], rec


def test_doctor_reports_cann_torch_npu_and_driver_versions_from_standin(run_areal, standin_env, tmp_path):
    """CANN from the toolkit's install record (the stand-in's get_cann_version
    answers "" for it, like torch_npu before CANN 8.1), the driver from
    torch_npu, torch_npu's own version; all three from the stand-in setup."""
    info = tmp_path / "toolkit" / "aarch64-linux" / "ascend_toolkit_install.info"
    info.parent.mkdir(parents=True)
    info.write_text("package_name=Ascend-cann-toolkit\nversion=8.1.RC1\n", encoding="utf-8")
    env = {
        **standin_env,
        "ASCEND_TOOLKIT_HOME": str(tmp_path / "toolkit"),
        "AREAL_NPU_STANDIN_DRIVER_VERSION": "24.1.rc3",
    }
    proc = run_areal("doctor", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["platform"]["name"] == "npu" and report["platform"]["device_count"] == 8
    assert report["device_software"] == {"torch_npu": "2.13.0+areal.standin", "cann": "8.1.RC1", "driver": "24.1.rc3"}
    assert report["problems"] == []


def test_ascend_version_records_are_read(tmp_path):
    from areal_npu.platform import read_info_field

    f = tmp_path / "version.info"
    f.write_text("Version=24.1.rc2\nascendhal_version=7.35.19\n", encoding="utf-8")
    assert read_info_field(str(f), "version") == "24.1.rc2"
    assert read_info_field(str(f), "missing") is None
    assert read_info_field(str(tmp_path / "nope"), "version") is None
