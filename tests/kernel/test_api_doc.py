"""docs/api.md lists the public API: every name listed there imports from the
module it is listed under, and every kernel name a plugin in this repository
imports is listed (private ``_names`` are another test's business)."""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "api.md"
LINE = re.compile(r"^- `(areal_kernel(?:\.\w+)*)`: (.+)$")


def listed() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    section = DOC.read_text(encoding="utf-8").split("## Stable names", 1)[1].split("\n## ", 1)[0]
    for line in section.splitlines():
        m = LINE.match(line.strip())
        if m:
            out.setdefault(m.group(1), []).extend(re.findall(r"`(\w+)`", m.group(2)))
    return out


def test_the_list_is_there():
    names = listed()
    assert len(names) >= 30 and sum(map(len, names.values())) >= 100, names
    assert "Trainer" in names["areal_kernel.api.trainer"] and "TrainerContext" in names["areal_kernel.api.trainer"]
    assert "RolloutExecutor" in names["areal_kernel.rollout.executor"]


@pytest.mark.parametrize("module", sorted(listed()))
def test_every_listed_name_imports(module):
    mod = importlib.import_module(module)
    missing = [n for n in listed()[module] if not hasattr(mod, n)]
    assert not missing, f"docs/api.md lists {module}: {missing}, which do not exist"
    assert not [n for n in listed()[module] if n.startswith("_") and n != "__version__"], module


def test_kernel_names_used_by_the_plugins_are_public():
    public = listed()
    unlisted = set()
    for path in (REPO / "plugins").glob("*/*/**/*.py"):
        if "tests" in path.relative_to(REPO / "plugins").parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("areal_kernel"):
                for alias in node.names:
                    if not alias.name.startswith("_") and alias.name not in public.get(node.module, []):
                        unlisted.add(f"{node.module}:{alias.name} ({path.relative_to(REPO)})")
    assert not unlisted, "kernel names used by plugins but not listed in docs/api.md:\n" + "\n".join(sorted(unlisted))


def test_readme_links_the_api_page():
    assert "(docs/api.md)" in (REPO / "README.md").read_text(encoding="utf-8")
