"""Code outside the platform layer asks the ``Platform`` object and the
registry's declarations; it never branches on a device string, a registry
target or another factory's name.

Why: a third-party platform (an NPU plugin) or a third-party reward, sink,
estimator or engine can only get the behaviour the built-ins get if the
decision is made from something it can declare. A ``== "cpu"`` or
``target.startswith("areal_kernel.reward.math")`` is a decision nobody else
can opt into without editing the kernel.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEVICE_KINDS = frozenset({"cpu", "cuda", "npu", "xpu", "mps", "hpu"})
# Registry kinds whose choice must come from declarations (capabilities,
# register keywords, platform properties), never from their names. Datasets,
# weight transports, losses, schedulers and model sources are left out: the
# kernel does not special-case their names today, and their strings collide
# with unrelated values (WeightUpdateMeta.kind is "disk"/"broadcast").
NAMED_KINDS = ("metric_sink", "reward", "advantage_estimator", "train_engine", "inference_engine", "platform")
_BRANCH_OPS = (ast.Eq, ast.NotEq, ast.In, ast.NotIn)

# (path relative to the repo root, the offending source text) -> why it is not a
# device or name branch. Every entry needs a reason.
ALLOWED: dict[tuple[str, str], str] = {
    # A plugin checking its *own* registered name: the hook is called for every
    # inference backend and answers only for its own.
    ("plugins/areal-sglang/areal_sglang/plugin.py", "inference_backend != 'sglang'"): "own name",
}


def _sources() -> list[Path]:
    kernel = [p for p in (ROOT / "areal_kernel").rglob("*.py") if "platforms" not in p.relative_to(ROOT).parts[1:2]]
    plugins = [
        p
        for p in (ROOT / "plugins").glob("*/*/**/*.py")
        if "tests" not in p.relative_to(ROOT / "plugins").parts and not p.name.startswith("test_")
    ]
    return sorted(kernel + plugins)


def _registered_names() -> frozenset[str]:
    from areal_kernel.plugins import get_registry

    reg = get_registry()
    return frozenset(spec.name for kind in NAMED_KINDS for spec in reg.specs(kind))


def _literals(node: ast.AST) -> list[str]:
    """String constants of a comparison operand (a tuple/list/set counts for ``in``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for e in node.elts for s in _literals(e)]
    return []


def _is_target(node: ast.AST) -> bool:
    """``spec.target``, ``target``, ``reward_target``: a registry import path."""
    if isinstance(node, ast.Attribute):
        return node.attr == "target" or node.attr.endswith("_target")
    if isinstance(node, ast.Name):
        return node.id == "target" or node.id.endswith("_target")
    return False


def find_branching(path: Path, names: frozenset[str], rel: str | None = None) -> list[str]:
    rel = rel or path.relative_to(ROOT).as_posix()
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=rel)):
        why = None
        if isinstance(node, ast.Compare) and any(isinstance(op, _BRANCH_OPS) for op in node.ops):
            operands = [node.left, *node.comparators]
            lits = {s for o in operands for s in _literals(o)}
            if lits & DEVICE_KINDS:
                why = "compares a device kind"
            elif lits & names:
                why = f"compares the registered name(s) {sorted(lits & names)}"
            elif any(_is_target(o) for o in operands) and any("." in s for s in lits):
                # A dotted literal is a module path: branching on where a
                # factory lives (validation such as "':' in target" is not).
                why = "compares a registry target"
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("startswith", "endswith")
            and _is_target(node.func.value)
        ):
            why = f"{node.func.attr}() on a registry target"
        if why is None:
            continue
        text = ast.unparse(node)
        if (rel, text) not in ALLOWED:
            found.append(f"{rel}:{node.lineno}: {why}: {text}")
    return found


def test_the_scan_sees_every_package():
    files = _sources()
    top = {p.relative_to(ROOT).parts[0] for p in files}
    assert top == {"areal_kernel", "plugins"}
    plugin_pkgs = {p.relative_to(ROOT / "plugins").parts[0] for p in files if p.parts[len(ROOT.parts)] == "plugins"}
    assert {"areal-fsdp", "areal-vllm", "areal-sglang", "areal-npu"} <= plugin_pkgs
    # The platform layer is the one place allowed to know device kinds.
    assert not any(p.is_relative_to(ROOT / "areal_kernel" / "platforms") for p in files)
    assert not any(p.name.startswith("test_") or "tests" in p.parts for p in files)


def test_the_scan_catches_what_it_forbids(tmp_path):
    # The detector itself: each forbidden shape is found, each allowed one not.
    bad = tmp_path / "probe.py"
    src = (
        "def f(plat, spec, name, t, backend):\n"
        "    a = plat.device_type == 'cpu'\n"
        "    b = t.device.type != 'cuda'\n"
        "    c = plat.device_type in ('npu', 'xpu')\n"
        "    d = spec.target.startswith('areal_kernel.reward.math')\n"
        "    e = name == 'console'\n"
        "    f = backend != 'torch'\n"
        "    ok = plat.host_memory or name == 'something-else'\n"
    )
    bad.write_text(src, encoding="utf-8")
    hits = find_branching(bad, frozenset({"console", "torch"}), rel="probe.py")
    assert len(hits) == 6, hits


@pytest.mark.parametrize("path", _sources(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_device_or_name_branching(path):
    hits = find_branching(path, _registered_names())
    assert hits == [], (
        "decide through the Platform object (areal_kernel.platforms) or a registered "
        "capability/keyword instead:\n" + "\n".join(hits)
    )


def test_allow_list_entries_still_exist():
    # A stale entry would silently allow a future reintroduction elsewhere.
    names = _registered_names()
    seen = set()
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Compare, ast.Call)) and (rel, ast.unparse(node)) in ALLOWED:
                seen.add((rel, ast.unparse(node)))
    assert seen == set(ALLOWED), set(ALLOWED) - seen
    assert names  # the registry answered
