"""``install-slurm.sh`` (run by ``make install``): where Slurm is missing and
cannot be installed it warns and exits 0, except under ``CI=true``, where
it exits 1 (CI has root and apt, so a missing Slurm is a broken set-up)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "install-slurm.sh"


@pytest.fixture
def bare_path(tmp_path: Path) -> str:
    """A PATH with only what the script needs to run, none of Slurm's
    programs nor apt-get (the script adds /usr/sbin and /sbin itself, where
    slurmctld may live, but sbatch is in /usr/bin: still incomplete)."""
    for tool in ("bash", "tr", "id"):
        found = shutil.which(tool)
        assert found is not None, tool
        (tmp_path / tool).symlink_to(found)
    return str(tmp_path)


def _run(path: str, ci: str | None) -> subprocess.CompletedProcess:
    env = {"PATH": path}
    if ci is not None:
        env["CI"] = ci
    bash = os.path.join(path, "bash")
    return subprocess.run([bash, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)


def test_without_slurm_or_apt_it_warns_and_exits_0(bare_path: str):
    for ci in (None, "false"):
        proc = _run(bare_path, ci)
        assert proc.returncode == 0, proc.stderr
        assert "the Slurm tests will be skipped" in proc.stderr


def test_under_ci_it_exits_1_when_it_cannot_install(bare_path: str):
    for ci in ("true", "TRUE"):
        proc = _run(bare_path, ci)
        assert proc.returncode == 1, (proc.returncode, proc.stderr)
        assert "error: CI=true and Slurm (slurm-wlm, munge) is not installed" in proc.stderr
