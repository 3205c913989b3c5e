"""Stand-in Python environments for tests of environment resolution
(``areal_kernel.environments``): a venv without pip whose site-packages
holds only installed-distribution metadata. The kernel's probe reads
metadata, so such a venv answers it as an environment holding those
versions would, without the packages themselves (which may not install or
run on the test machine: SGLang, a second torch). Its interpreter runs;
importing the named packages there fails. Name it a stand-in where a test
uses it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys


def metadata_venv(path: str, versions: dict[str, str], copy_dist_info: tuple[str, ...] = ()) -> str:
    """Create a venv at ``path`` (no pip) whose site-packages holds a
    ``*.dist-info`` with ``METADATA`` for each ``name: version`` of
    ``versions``, plus copies of the real ``*.dist-info`` directories in
    ``copy_dist_info``. Returns its interpreter."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", path], check=True)
    python = os.path.join(path, "bin", "python")
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    for name, version in versions.items():
        info = os.path.join(site, f"{name.replace('-', '_')}-{version}.dist-info")
        os.makedirs(info)
        with open(os.path.join(info, "METADATA"), "w", encoding="utf-8") as f:
            f.write(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    for src in copy_dist_info:
        shutil.copytree(src, os.path.join(site, os.path.basename(src.rstrip(os.sep))))
    return python
