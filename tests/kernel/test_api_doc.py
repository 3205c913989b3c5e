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
    """The plugins of plugins/ and the example plugins of examples/ (the
    worked example of docs/plugin-authoring.md is written against the public API only)."""
    public = listed()
    unlisted = set()
    sources = [*(REPO / "plugins").glob("*/*/**/*.py"), *(REPO / "examples").glob("*_plugin/*/**/*.py")]
    assert any("rft_plugin" in str(p) for p in sources)
    for path in sources:
        if "tests" in path.relative_to(REPO).parts[2:]:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("areal_kernel"):
                for alias in node.names:
                    if not alias.name.startswith("_") and alias.name not in public.get(node.module, []):
                        unlisted.add(f"{node.module}:{alias.name} ({path.relative_to(REPO)})")
    assert not unlisted, "kernel names used by plugins but not listed in docs/api.md:\n" + "\n".join(sorted(unlisted))


def test_readme_links_the_api_page():
    assert "(docs/api.md)" in (REPO / "README.md").read_text(encoding="utf-8")


def _doc_references(text: str) -> set[str]:
    """Dotted kernel names a page tells its reader to use: `areal_kernel.x.y`
    in backticks and ``from areal_kernel.x import a, b`` in its code."""
    refs = set(re.findall(r"`(areal_kernel(?:\.\w+)+)", text))
    for m in re.finditer(r"from (areal_kernel(?:\.\w+)*) import (\([\w,\s]+\)|[\w, ]+)", text):
        refs |= {f"{m.group(1)}.{n}" for n in re.findall(r"\w+", m.group(2))}
    return refs


def _is_listed(ref: str, public: dict[str, list[str]]) -> bool:
    parts = ref.split(".")
    for i in range(len(parts), 0, -1):  # the longest prefix that is a module
        module = ".".join(parts[:i])
        try:
            importlib.import_module(module)
        except ImportError:
            continue
        rest = parts[i:]
        if not rest:  # a module: listed itself, or a listed module under it
            return any(m == module or m.startswith(module + ".") for m in public)
        return rest[0] in public.get(module, [])
    return False


def test_names_the_docs_use_are_listed():
    """A name the docs tell an author to use is a stable name: it is in the list."""
    public = listed()
    # Named in prose the scan below cannot parse; the plugin-authoring page uses each.
    assert {"sample_gconfig", "stop_at_eos"} <= set(public.get("areal_kernel.workflow.rlvr", []))
    assert "Record" in public.get("areal_kernel.data.contract", []) and "areal_kernel.testing.readback" in public
    unlisted = []
    for doc in sorted((REPO / "docs").glob("*.md")):
        if doc != DOC:
            unlisted += [f"{ref} ({doc.name})" for ref in sorted(_doc_references(doc.read_text(encoding="utf-8")))
                         if not _is_listed(ref, public)]  # fmt: skip
    assert not unlisted, "names the docs use but docs/api.md does not list:\n" + "\n".join(unlisted)
