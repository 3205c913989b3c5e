"""Shared fixtures for the kernel's tests."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_kernel.testing.packages import use_private_site

REPO = Path(__file__).resolve().parent.parent
PLUGIN_PACKAGES = REPO / "tests" / "plugin_packages"

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def test_plugins_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Install the small real third-party plugin packages (healthy, broken,
    incompatible) with pip into a private directory; tests put it on
    PYTHONPATH of the processes they start, so the main venv stays clean."""
    import shutil

    target = tmp_path_factory.mktemp("plugin-site")
    sources = tmp_path_factory.mktemp("plugin-src")
    pkgs = []
    for p in sorted(PLUGIN_PACKAGES.iterdir()):
        if (p / "pyproject.toml").exists():
            # Build from a copy: setuptools leaves build/ and egg-info behind.
            shutil.copytree(p, sources / p.name)
            pkgs.append(str(sources / p.name))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "--target", str(target), *pkgs],
        check=True,
        capture_output=True,
        text=True,
    )
    return target


@pytest.fixture
def plugin_env(test_plugins_site: Path) -> dict[str, str]:
    """Environment for a subprocess that sees the test plugins."""
    path = os.pathsep.join([str(test_plugins_site), str(REPO), os.environ.get("PYTHONPATH", "")])
    return {"PYTHONPATH": path.rstrip(os.pathsep)}


@pytest.fixture
def with_test_plugins(test_plugins_site: Path, monkeypatch: pytest.MonkeyPatch, areal_env):
    """Make the test plugins visible to this process (sys.path + fresh registry)."""
    return use_private_site(test_plugins_site, monkeypatch, areal_env)
