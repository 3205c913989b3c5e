"""The root conftest's units of work for the two-worker run name real files."""

from __future__ import annotations

import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_big_memory_file_exists_and_is_one_unit():
    spec = importlib.util.spec_from_file_location("areal_root_conftest", os.path.join(REPO, "conftest.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    missing = [p for p in mod.BIG_MEMORY_FILES if not os.path.isfile(os.path.join(REPO, p))]
    assert not missing, f"conftest.py BIG_MEMORY_FILES names files that do not exist: {missing}"
    units = {mod.unit_of(f"{p}::test_x") for p in mod.BIG_MEMORY_FILES}
    assert units == {mod.BIG_MEMORY_UNIT}
    assert mod.unit_of("tests/kernel/test_cli.py::test_x[a]") == "tests/kernel/test_cli.py"
