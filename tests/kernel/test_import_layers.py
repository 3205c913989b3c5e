"""The kernel's import layers: a module imports only from its own layer or
the layers below it, and the import graph has no cycle.

Why: a cycle means no part of it can be understood, tested or replaced
without the rest (the config could not be validated without loading every
plugin; the scheduler API imported the inference launcher that imported
it). Layers say where new code goes: a helper two layers need lives in the
lower one.

Every import counts, including one inside a function (a lazy import is
still a dependency; it only moves the cost). Imports under ``if
TYPE_CHECKING:`` are not followed: they never run, and annotating with a
type from above is not a dependency of the running code. An
``importlib.import_module("areal_kernel...")`` or ``__import__`` with a
literal name counts as an import. Registry targets (``"pkg.mod:Attr"``
strings handed to the registry) are not imports: they are how plugins are
named, and the plugin layer loads them by name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNEL = "areal_kernel"

# The layer order, bottom first, written down once: a module of layer i may
# import from layers 0..i. Entries are module paths below areal_kernel; a
# module belongs to the longest entry that is a prefix of it ("" is the
# package's own __init__: version and hookimpl).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "logging", "utils", "example_configs"),  # no kernel imports beyond each other
    ("config",),  # the config's shape and its resolution against a registry it is given
    ("hookspecs", ""),  # the plugin hooks; the package root re-exports hookimpl
    ("platforms.base",),  # the Platform interface and the built-in cpu/cuda platforms
    ("api",),  # the contracts of the plugin kinds and the data passed between them
    ("plugins.registry", "plugins.known"),  # the name registry (told the current platform by its owner)
    ("platforms.resolve",),  # resolving a process's platform from a registry it is given
    ("plugins",),  # discovery and loading plugins by name; the process registry and its platform
    ("platforms",),  # current_platform(): the plugin manager's platform
    # Implementations of the kinds and the libraries they share.
    (
        "data", "algo", "reward", "models", "metrics", "checkpoint", "weights", "tools", "monitor", "report",
        "environments",
    ),  # fmt: skip
    ("engine", "inference", "rollout", "scheduling"),
    ("workflow", "agent"),
    ("trainer",),  # the run: builds every part through the registry
    ("services",),  # long-running services built on the trainer's parts
    ("builtin", "testing"),  # the builtin plugin's registrations; test helpers and contract suites
    ("cli",),
)

# (importing module, imported module) -> why the upward import is allowed.
# Every entry needs a reason; an entry that no longer matches an import fails
# test_allow_list_entries_still_exist.
ALLOWED: dict[tuple[str, str], str] = {
    ("areal_kernel.api.scheduler", "areal_kernel.platforms"): (
        "the Scheduler base class is part implementation: its constructor takes the process's platform "
        "(current_platform()). To go: the platform arrives in the scheduler's build context"
    ),
}

# Strongly connected components of the module graph that exist today, with
# why; any other cycle fails, and so does one of these that grew or is gone
# (then delete the entry). None today: the last one (registry -> current
# platform -> process registry) went when the plugin manager began to hold
# the platform and to hand the registry a callable for its name.
KNOWN_CYCLES: dict[frozenset[str], str] = {}


def _module_name(path: Path, base: Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _kernel_files() -> dict[str, Path]:
    return {_module_name(p, ROOT): p for p in sorted((ROOT / KERNEL).rglob("*.py"))}


def _plugin_packages() -> dict[str, dict[str, Path]]:
    """Plugin distribution folder -> its modules (tests left out)."""
    out: dict[str, dict[str, Path]] = {}
    for dist in sorted(p for p in (ROOT / "plugins").iterdir() if p.is_dir()):
        files = {
            _module_name(p, dist): p
            for p in dist.glob("*/**/*.py")
            if "tests" not in p.relative_to(dist).parts and not p.name.startswith("test_")
        }
        if files:
            out[dist.name] = files
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, list[str], int]]:
    """Every import of ``module``: ``(source, names, line)``. ``import a.b``
    gives ``("a.b", [], line)``; ``from a import b, c`` gives ``("a", ["a.b",
    "a.c"], line)`` (the caller keeps the names that are modules)."""
    found: list[tuple[str, list[str], int]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((a.name, [], node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            found.append((source, [f"{source}.{a.name}" for a in node.names], node.lineno))
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                or (isinstance(node.func, ast.Name) and node.func.id in ("__import__", "import_module"))
            )
        ):
            found.append((node.args[0].value, [], node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


Graph = dict[str, dict[str, int]]  # module -> {imported module: line of the first such import}


def import_graph(files: dict[str, Path]) -> Graph:
    """Module -> the modules among ``files`` it imports, with the line.

    ``from a import b`` is an edge to ``a.b`` when that is a module, else to
    ``a``; a name outside ``files`` is cut to its longest part that is one."""
    graph: Graph = {m: {} for m in files}
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for source, names, line in _imports(tree, module, path.name == "__init__.py"):
            submodules = [n for n in names if n in files]
            targets = submodules if names and len(submodules) == len(names) else [*submodules, source]
            for name in targets:
                while name and name not in files:
                    name = name.rpartition(".")[0]
                if name and name != module:
                    graph[module].setdefault(name, line)
    return graph


def layer_of(module: str) -> int:
    rel = module[len(KERNEL) + 1 :] if module != KERNEL else ""
    best, best_len = None, -1
    for i, entries in enumerate(LAYERS):
        for entry in entries:
            matches = rel == entry or (entry and rel.startswith(entry + ".")) or (entry == "" and rel == "")
            if matches and len(entry) > best_len:
                best, best_len = i, len(entry)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add its subpackage to LAYERS")
    return best


def upward_imports(graph: Graph) -> list[tuple[str, str, int]]:
    return sorted((a, b, line) for a, out in graph.items() for b, line in out.items() if layer_of(b) > layer_of(a))


def cycles(graph: Graph) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer():
    # layer_of raises for a module no entry covers (a new subpackage).
    layers = {m: layer_of(m) for m in _kernel_files()}
    assert {m for m, i in layers.items() if i == 0} >= {"areal_kernel.errors", "areal_kernel.utils.procs"}
    assert layers["areal_kernel.platforms.base"] < layers["areal_kernel.plugins.registry"] < layers[
        "areal_kernel.platforms.resolve"
    ]  # fmt: skip
    for entries in LAYERS:
        for entry in entries:
            assert any(m == f"{KERNEL}.{entry}".rstrip(".") or m.startswith(f"{KERNEL}.{entry}.") for m in layers), (
                f"LAYERS names {entry!r}, which is no module"
            )


def test_the_scan_sees_what_it_forbids(tmp_path):
    # The detector itself: each import shape is an edge, a TYPE_CHECKING one is not.
    pkg = tmp_path / "areal_kernel"
    (pkg / "config").mkdir(parents=True)
    (pkg / "trainer").mkdir()
    for f in ("__init__.py", "config/__init__.py", "trainer/__init__.py", "trainer/run.py", "trainer/other.py"):
        (pkg / f).write_text("", encoding="utf-8")
    (pkg / "config" / "models.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from areal_kernel.trainer import other\n"
        "def f():\n"
        "    from areal_kernel.trainer.run import x\n"
        "class C:\n"
        "    def g(self):\n"
        "        import importlib\n"
        "        return importlib.import_module('areal_kernel.trainer')\n"
        "from ..trainer import run\n",
        encoding="utf-8",
    )
    files = {_module_name(p, tmp_path): p for p in pkg.rglob("*.py")}
    graph = import_graph(files)
    assert set(graph["areal_kernel.config.models"]) == {"areal_kernel.trainer.run", "areal_kernel.trainer"}
    ups = upward_imports(graph)
    assert [(a, b) for a, b, _ in ups] == [
        ("areal_kernel.config.models", "areal_kernel.trainer"),
        ("areal_kernel.config.models", "areal_kernel.trainer.run"),
    ]
    # A cycle is found whatever the layers say.
    graph["areal_kernel.trainer.run"]["areal_kernel.config.models"] = 1
    assert cycles(graph) == [frozenset({"areal_kernel.config.models", "areal_kernel.trainer.run"})]


def test_no_upward_import():
    graph = import_graph(_kernel_files())
    bad = [
        f"{a} (layer {layer_of(a)}, line {line}) imports {b} (layer {layer_of(b)})"
        for a, b, line in upward_imports(graph)
        if (a, b) not in ALLOWED
    ]
    assert not bad, (
        "an import reaches up the layers (tests/kernel/test_import_layers.py, LAYERS); move the code it needs "
        "down to the layer it belongs to:\n" + "\n".join(bad)
    )


def test_the_kernel_import_graph_has_no_cycle():
    found = cycles(import_graph(_kernel_files()))
    unknown = [sorted(c) for c in found if c not in KNOWN_CYCLES]
    assert not unknown, f"import cycle(s) in the kernel (imports inside functions count): {unknown}"
    gone = [sorted(c) for c in KNOWN_CYCLES if c not in found]
    assert not gone, f"these known cycles are gone or changed: remove or update their KNOWN_CYCLES entry: {gone}"


@pytest.mark.parametrize("dist", sorted(_plugin_packages()))
def test_no_cycle_in_a_plugin_package(dist):
    found = cycles(import_graph(_plugin_packages()[dist]))
    assert not found, f"import cycle(s) in plugins/{dist}: {[sorted(c) for c in found]}"


def test_allow_list_entries_still_exist():
    # A stale entry would silently allow a future reintroduction.
    graph = import_graph(_kernel_files())
    stale = [(a, b) for a, b in ALLOWED if b not in graph.get(a, {}) or layer_of(b) <= layer_of(a)]
    assert not stale, f"ALLOWED entries that are no upward import any more: {stale}"
    assert all(reason.strip() for reason in [*ALLOWED.values(), *KNOWN_CYCLES.values()])


if __name__ == "__main__":
    # `python tests/kernel/test_import_layers.py`: the cycles and upward imports of this checkout.
    kernel = import_graph(_kernel_files())
    print("kernel import cycles:", [sorted(c) for c in cycles(kernel)] or "none")
    for dist, files in _plugin_packages().items():
        found = cycles(import_graph(files))
        if found:
            print(f"plugins/{dist} import cycles:", [sorted(c) for c in found])
    for a, b, line in upward_imports(kernel):
        print(f"upward: {a}:{line} -> {b}" + ("" if (a, b) in ALLOWED else "  (not allowed)"))
