"""Install a plugin package for a test only (into a private directory that a
test puts on the PYTHONPATH of the processes it starts)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


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
