"""The kernel calls nothing on a train engine that ``TrainEngine`` does not declare.

A static scan of every module of ``areal_kernel``: each value the kernel
types as a train engine (a parameter, a local or a ``self`` attribute
annotated with ``TrainEngine``, a loop over such values, a method returning
them) is followed, and every attribute read or called on it (directly, or by
``getattr``/``hasattr`` with a constant name) must be a public member of
``areal_kernel.api.engine.TrainEngine``. A method the trainer starts calling
without declaring it in the contract fails here, naming file and line.

``self`` attributes are resolved through the class hierarchy at runtime
(``OfflineTrainer`` declares ``self.engine: TrainEngine``; ``SFTTrainer``
uses it), so a subclass in another module is covered too.
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import areal_kernel
from areal_kernel.api.engine import TrainEngine

ROOT = Path(areal_kernel.__file__).resolve().parent
DECLARED = {n for n in dir(TrainEngine) if not n.startswith("_")}
# What the trainers call today: if the scan stops seeing one of these, the
# annotations it follows were lost and the test would pass vacuously.
MUST_SEE = {
    "initialize", "compute_logprobs", "train_batch", "save_hf", "send_weights", "save_state", "load_state",
    "init_weight_group", "named_weights_for_transfer", "set_version", "get_version", "destroy", "temperature",
}  # fmt: skip


def _mentions_engine(ann: ast.AST | None) -> bool:
    if ann is None:
        return False
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
        try:
            ann = ast.parse(ann.value, mode="eval").body
        except SyntaxError:
            return False
    return any(
        (isinstance(n, ast.Name) and n.id == "TrainEngine") or (isinstance(n, ast.Attribute) and n.attr == "TrainEngine")
        for n in ast.walk(ann)
    )


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _class_declarations(tree: ast.Module) -> dict[str, tuple[set[str], set[str]]]:
    """Per class of the module: (``self`` attributes annotated as engines,
    methods whose return annotation mentions engines)."""
    out: dict[str, tuple[set[str], set[str]]] = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        attrs: set[str] = set()
        methods: set[str] = set()
        for fn in (n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            if _mentions_engine(fn.returns):
                methods.add(fn.name)
            for n in ast.walk(fn):
                if (
                    isinstance(n, ast.AnnAssign)
                    and isinstance(n.target, ast.Attribute)
                    and isinstance(n.target.value, ast.Name)
                    and n.target.value.id == "self"
                    and _mentions_engine(n.annotation)
                ):
                    attrs.add(n.target.attr)
        out[cls.name] = (attrs, methods)
    return out


class _Scanner(ast.NodeVisitor):
    """Collects ``(attribute, line)`` uses on engine-typed expressions."""

    def __init__(self, attrs: set[str], methods: set[str], functions: set[str]) -> None:
        self.attrs, self.methods, self.functions = attrs, methods, functions
        self.scopes: list[set[str]] = [set()]
        self.uses: list[tuple[str, int]] = []

    def tracked(self, e: ast.AST) -> bool:
        if isinstance(e, ast.Name):
            return e.id in self.scopes[-1]
        if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
            return e.attr in self.attrs
        if isinstance(e, ast.Call):
            f = e.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self":
                return f.attr in self.methods
            if isinstance(f, ast.Name):
                return f.id in self.functions
        if isinstance(e, (ast.Tuple, ast.List)):
            return any(self.tracked(x) for x in e.elts)
        return False

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        scope = set(self.scopes[-1])  # closures see the enclosing function's engines
        a = node.args
        for arg in a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]:
            if _mentions_engine(arg.annotation):
                scope.add(arg.arg)
            else:
                scope.discard(arg.arg)
        self.scopes.append(scope)
        self.generic_visit(node)
        self.scopes.pop()

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if isinstance(node.target, ast.Name) and _mentions_engine(node.annotation):
            self.scopes[-1].add(node.target.id)
        self.generic_visit(node)

    def visit_For(self, node: ast.For) -> None:
        if isinstance(node.target, ast.Name) and self.tracked(node.iter):
            self.scopes[-1].add(node.target.id)
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if self.tracked(node.value) and not isinstance(node.value, (ast.Tuple, ast.List)):
            self.uses.append((node.attr, node.lineno))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        if (
            isinstance(f, ast.Name)
            and f.id in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and self.tracked(node.args[0])
            and isinstance(node.args[1], ast.Constant)
        ):
            self.uses.append((str(node.args[1].value), node.lineno))
        self.generic_visit(node)


def scan_source(source: str, module: str | None = None) -> list[tuple[str, int]]:
    """``(attribute, line)`` used on train engines in ``source``; ``module``
    (importable) resolves ``self`` attributes through the class hierarchy."""
    tree = ast.parse(source)
    functions = {
        n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and _mentions_engine(n.returns)
    } | _ENGINE_FUNCTIONS
    local = _class_declarations(tree)
    uses: list[tuple[str, int]] = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            attrs, methods = set(local[node.name][0]), set(local[node.name][1])
            if module is not None:
                cls = getattr(importlib.import_module(module), node.name, None)
                for base in getattr(cls, "__mro__", ())[1:]:
                    a, m = _DECLS.get((base.__module__, base.__qualname__), (set(), set()))
                    attrs |= a
                    methods |= m
            s = _Scanner(attrs, methods, functions)
        else:
            s = _Scanner(set(), set(), functions)
        s.visit(node)
        uses.extend(s.uses)
    return uses


def _all_modules() -> list[tuple[Path, str, str]]:
    return [(p, _module_name(p), p.read_text(encoding="utf-8")) for p in sorted(ROOT.rglob("*.py"))]


_DECLS: dict[tuple[str, str], tuple[set[str], set[str]]] = {}
_ENGINE_FUNCTIONS: set[str] = set()
for _path, _mod, _src in _all_modules():
    _tree = ast.parse(_src)
    for _name, _decl in _class_declarations(_tree).items():
        _DECLS[(_mod, _name)] = _decl
    _ENGINE_FUNCTIONS |= {
        n.name for n in _tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and _mentions_engine(n.returns)
    }


def test_kernel_uses_only_declared_train_engine_members():
    seen: set[str] = set()
    undeclared = []
    for path, mod, src in _all_modules():
        for attr, line in scan_source(src, mod):
            seen.add(attr)
            if attr not in DECLARED:
                undeclared.append(f"{path.relative_to(ROOT.parent)}:{line}: .{attr}")
    assert undeclared == [], (
        "the kernel uses train-engine members that areal_kernel.api.engine.TrainEngine does not declare "
        "(declare them there, with when/where they are called, and document them in docs/plugin-authoring.md):\n"
        + "\n".join(undeclared)
    )
    assert MUST_SEE <= seen, f"the scan no longer sees {sorted(MUST_SEE - seen)}: were TrainEngine annotations dropped?"


def test_the_scan_catches_an_undeclared_call():
    src = '''
from areal_kernel.api.engine import TrainEngine

def step(engine: TrainEngine, other) -> None:
    engine.train_batch(None, None)
    engine.compute_values(None)
    other.compute_values(None)
    getattr(engine, "shard_count", 1)

class T:
    def __init__(self, e: "TrainEngine | None") -> None:
        self.train_engine: TrainEngine | None = e
        self.engine = None

    def engines(self) -> list[TrainEngine]:
        return [self.train_engine]

    def close(self) -> None:
        self.train_engine.flush_caches()
        self.engine.whatever()
        for e in self.engines():
            e.destroy()
            e.release()
        def later() -> None:
            self.train_engine._private_state
        later()
'''
    uses = scan_source(src)
    assert sorted(a for a, _ in uses if a not in DECLARED) == [
        "_private_state", "compute_values", "flush_caches", "release", "shard_count",
    ]  # fmt: skip
    assert {"train_batch", "destroy"} <= {a for a, _ in uses}


def test_every_declared_member_is_documented():
    doc = (ROOT.parent / "docs" / "plugin-authoring.md").read_text(encoding="utf-8")
    section = doc[doc.index("### Train engines"):]
    missing = [n for n in sorted(DECLARED) if f"`{n}" not in section]
    assert missing == [], f"TrainEngine members missing from docs/plugin-authoring.md, Train engines: {missing}"
