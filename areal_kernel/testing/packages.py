"""Install a plugin package for a test only (into a private directory that a
test puts on the PYTHONPATH of the processes it starts)."""

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
