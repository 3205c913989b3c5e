"""Install a plugin package for a test only (into a private directory that a
test puts on the PYTHONPATH of the processes it starts), and the pair of
fixtures a test module declares for one (``private_plugin_fixtures``)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable


def pip_install_private(src: str | Path, workdir: str | Path) -> Path:
    """``pip install --target`` the package at ``src`` into ``<workdir>/site``
    (built from a copy: setuptools leaves build/ and egg-info beside the
    sources). Returns the site directory."""
    src, workdir = Path(src), Path(workdir)
    copy = workdir / "src" / src.name
    target = workdir / "site"
    shutil.copytree(src, copy)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "--target", str(target), str(copy)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return target


def use_private_site(site: str | Path, monkeypatch: Any, areal_env: Callable[..., Any]) -> Path:
    """Make a private site (``pip_install_private``) visible to this test's
    own process: first on ``sys.path``, import caches dropped, and the
    kernel's plugin state reset through the ``areal_env`` fixture so the next
    registry use discovers its plugins."""
    import importlib

    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    areal_env()
    return Path(site)


def private_plugin_fixtures(src: str | Path, site_fixture: str) -> tuple[Any, Any]:
    """Two pytest fixtures for the plugin package at ``src``, to assign in a
    test module as ``<site_fixture>, <enable> = private_plugin_fixtures(src,
    "<site_fixture>")`` (pytest names a fixture after the module attribute):
    the first installs it once per module (``pip_install_private``) and gives
    the site, for the environment of the processes a test starts; the second
    makes it visible to the test's own process (``use_private_site``)."""
    import pytest

    @pytest.fixture(scope="module")
    def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
        return pip_install_private(src, tmp_path_factory.mktemp(Path(src).name))

    @pytest.fixture
    def enable(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, areal_env: Any) -> Path:
        return use_private_site(request.getfixturevalue(site_fixture), monkeypatch, areal_env)

    return site, enable
