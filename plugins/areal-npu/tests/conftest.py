"""Fixtures of the areal-npu tests.

No NPU and no torch_npu exist here, so the tests use ``standin/torch_npu``: a
TEST-ONLY STAND-IN for torch_npu that computes on the host (see its
docstring). Importing it changes torch for the rest of the process, so it is
only ever imported in processes of its own: subprocesses get it through
``standin_env``; ``standin_suite.py`` runs in such a process
(``test_npu_platform.py::test_standin_suite_in_its_own_process``) and gets the
module from ``torch_npu_standin``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

STANDIN_DIR = Path(__file__).resolve().parent / "standin"
# Set for the pytest process that runs standin_suite.py.
STANDIN_PROCESS_ENV = "AREAL_NPU_STANDIN_PROCESS"


@pytest.fixture
def standin_env() -> dict[str, str]:
    """Environment for a subprocess whose ``import torch_npu`` finds the stand-in."""
    path = os.pathsep.join([str(STANDIN_DIR), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


@pytest.fixture
def torch_npu_standin(areal_env: Any) -> Iterator[Any]:
    """The stand-in module with its per-test state reset; the platform is
    resolved afresh (``AREAL_PLATFORM`` unset), so the npu probe sees it."""
    if os.environ.get(STANDIN_PROCESS_ENV) != "1":
        pytest.fail(
            "the torch_npu stand-in is only imported in its own process: run standin_suite.py through "
            "test_npu_platform.py::test_standin_suite_in_its_own_process"
        )
    import torch_npu

    torch_npu.npu.reset()
    torch_npu._C._distributed_c10d.created.clear()
    areal_env(AREAL_PLATFORM=None)
    yield torch_npu
