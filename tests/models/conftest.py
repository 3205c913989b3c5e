"""One real SmolLM2 conversion per module that asks for it (only
``test_smollm2.py``), into a temporary AREAL_CACHE_DIR removed when the
module ends (260 MB that would otherwise wait for the end of the session).

Two processes ask for the model at the same time: the file lock must make
exactly one of them convert, and both must get the same finished directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")
from areal_kernel.models.smollm2 import ensure_smollm2
print(ensure_smollm2())
"""


@dataclass
class Conversion:
    cache_root: Path
    model_dir: Path
    outputs: list[str]  # stdout of each process (the returned path)
    logs: list[str]  # stderr of each process


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Conversion]:
    cache = tmp_path_factory.mktemp("areal_cache")
    env = dict(os.environ, AREAL_CACHE_DIR=str(cache), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _SCRIPT], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs, logs = [], []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        outs.append(out.strip().splitlines()[-1])
        logs.append(err)
    yield Conversion(cache_root=cache, model_dir=Path(outs[0]), outputs=outs, logs=logs)
    shutil.rmtree(cache, ignore_errors=True)
