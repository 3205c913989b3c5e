"""The trainer modules form no import cycle: each imports alone in a fresh
interpreter, and the offline trainers never import the RL loop
(``trainer/run.py``); what they share lives in ``trainer/common.py``."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

TRAINER_DIR = Path(__file__).resolve().parents[2] / "areal_kernel" / "trainer"
MODULES = sorted(f"areal_kernel.trainer.{p.stem}" for p in TRAINER_DIR.glob("*.py") if p.stem != "__init__")
OFFLINE = ["offline", "sft", "preference", "reward_model", "offline_data", "common"]


@pytest.mark.parametrize("module", MODULES)
def test_each_trainer_module_imports_alone(module):
    code = (
        "import importlib, sys\n"
        f"importlib.import_module({module!r})\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('areal_kernel.trainer.'))))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = set(proc.stdout.split())
    assert module in loaded
    if module.rsplit(".", 1)[1] in OFFLINE:
        assert "areal_kernel.trainer.run" not in loaded, f"{module} imported the RL loop: {sorted(loaded)}"


def _imported_modules(path: Path) -> set[str]:
    """Every module an import statement in ``path`` names (also inside functions)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


@pytest.mark.parametrize("stem", OFFLINE)
def test_offline_trainers_never_import_the_rl_loop(stem):
    imported = _imported_modules(TRAINER_DIR / f"{stem}.py")
    assert "areal_kernel.trainer.run" not in imported, stem


def test_common_imports_no_trainer():
    imported = _imported_modules(TRAINER_DIR / "common.py")
    bad = {m for m in imported if m.startswith("areal_kernel.trainer.") and m != "areal_kernel.trainer.common"}
    assert not bad, bad
