"""The plugin-authoring page documents every hook with its exact signature."""
import dataclasses
import re
import inspect
from pathlib import Path

from areal_kernel import hookspecs

DOC = Path(__file__).resolve().parents[2] / "docs" / "plugin-authoring.md"


def _hooks():
    return {
        name: fn
        for name, fn in vars(hookspecs).items()
        if name.startswith("areal_") and callable(fn) and getattr(fn, "areal_spec", None) is not None
    }


def test_every_hook_is_documented_with_its_signature():
    text = DOC.read_text(encoding="utf-8")
    hooks = _hooks()
    assert len(hooks) >= 20
    missing = []
    for name, fn in hooks.items():
        sig = f"def {name}{inspect.signature(fn)}".replace("'", "").replace('"', "")
        if sig not in text:
            missing.append(sig)
    assert missing == [], "undocumented hooks (add them to docs/plugin-authoring.md):\n" + "\n".join(missing)


def test_every_hook_has_a_docstring():
    for name, fn in _hooks().items():
        assert (fn.__doc__ or "").strip(), name


# -- the contract suites and fixtures of areal_kernel.testing ---------------------------------

# Fixtures every pytest run has; a suite asking for one needs no documentation of it.
_PYTEST_FIXTURES = {"request", "tmp_path", "tmp_path_factory", "monkeypatch", "capsys", "capfd", "caplog"}


def _testing_section() -> str:
    text = DOC.read_text(encoding="utf-8")
    start = text.index("## Testing your plugin")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def _suites() -> dict[str, type]:
    """Every class named ``*Contract`` defined in a module of areal_kernel.testing
    (the suites' package ``areal_kernel.testing.contracts`` included)."""
    import importlib
    import pkgutil

    import areal_kernel.testing as testing

    found = {}
    for mod in pkgutil.walk_packages(testing.__path__, prefix="areal_kernel.testing."):
        module = importlib.import_module(mod.name)
        for name, obj in vars(module).items():
            if isinstance(obj, type) and name.endswith("Contract") and obj.__module__ == module.__name__:
                found[name] = obj
    return found


def _plugin_fixtures() -> set[str]:
    from _pytest.fixtures import getfixturemarker

    from areal_kernel.testing import pytest_plugin

    return {n for n, obj in vars(pytest_plugin).items() if getfixturemarker(obj) is not None}


def _fixtures_of(suite: type) -> tuple[set[str], set[str]]:
    """(fixtures a subclass must provide, fixtures the suite defines and a subclass may override)."""
    from _pytest.fixtures import getfixturemarker

    defined = {n for n in dir(suite) if getfixturemarker(inspect.getattr_static(suite, n)) is not None}
    requested = set()
    for n in dir(suite):
        if n.startswith("test_") or n in defined:
            fn = getattr(suite, n)
            fn = getattr(fn, "__wrapped__", fn)
            fn = getattr(fn, "__func__", fn)  # a class-scoped fixture written over @classmethod
            requested |= set(inspect.signature(fn).parameters) - {"self", "cls"}
    required = requested - defined - _PYTEST_FIXTURES - _plugin_fixtures()
    return required, defined


def test_every_contract_suite_is_documented_with_its_fixtures():
    section = _testing_section()
    rows = {line.split("|")[1].strip().strip("`"): line for line in section.splitlines() if line.startswith("| `")}
    suites = _suites()
    assert {"DatasetContract", "MetricSinkContract", "AdvantageEstimatorContract", "LossContract",
            "WorkflowContract", "WeightTransportContract", "SchedulerContract", "RewardContract"} <= set(suites)  # fmt: skip
    problems = []
    for name, suite in sorted(suites.items()):
        row = rows.get(name)
        if row is None:
            problems.append(f"{name}: no row '| `{name}` | ...' in the 'Testing your plugin' table")
            continue
        required, optional = _fixtures_of(suite)
        for fixture in sorted(required | optional):
            if f"`{fixture}`" not in row:
                problems.append(f"{name}: fixture `{fixture}` is not in its row")
    assert problems == [], "docs/plugin-authoring.md, 'Testing your plugin':\n" + "\n".join(problems)


def test_every_suite_is_exported_from_areal_kernel_testing():
    import areal_kernel.testing as testing

    assert sorted(_suites()) == sorted(testing.__all__)
    for name in testing.__all__:
        assert getattr(testing, name) is _suites()[name]


def test_every_pytest_plugin_fixture_is_documented():
    section = _testing_section()
    fixtures = _plugin_fixtures()
    assert {"run_areal", "areal_env"} <= fixtures
    headings = [line for line in section.splitlines() if line.startswith("#### ")]
    missing = [f for f in sorted(fixtures) if not any(f"`{f}`" in h for h in headings)]
    assert missing == [], f"pytest plugin fixtures without a heading in 'Testing your plugin': {missing}"


# -- the scheduler contract (areal_kernel.api.scheduler) --------------------------------------


def _schedulers_section() -> str:
    text = DOC.read_text(encoding="utf-8")
    start = text.index("### Schedulers\n")
    return text[start : text.index("\n### ", start + 1)]


def test_every_scheduler_contract_method_is_documented():
    from areal_kernel.api import scheduler as api

    section = _schedulers_section()
    missing = []
    for cls in (api.Scheduler, api.ProcessHandle):
        for name, member in vars(cls).items():
            if name.startswith("_") or not callable(member):
                continue
            if f"`{name}(" not in section:
                missing.append(f"{cls.__name__}.{name}")
    for name in [f.name for f in dataclasses.fields(api.Placement)] + ["NODE_LOST", "ProcessStatus", "spawn_local"]:
        if name not in section:
            missing.append(name)
    assert missing == [], "undocumented in docs/plugin-authoring.md, 'Schedulers': " + ", ".join(missing)


def test_abstract_scheduler_methods_are_the_documented_ones():
    from areal_kernel.api.scheduler import Scheduler

    # The table "What a scheduler writes" lists exactly these; adding one is a contract change.
    assert Scheduler.__abstractmethods__ == {"plan", "spawn", "free_port", "release"}


README = DOC.parents[1] / "README.md"


def _support_rows() -> list[list[str]]:
    text = README.read_text(encoding="utf-8")
    table = text[text.index("## Support table") : text.index("\nStand-ins:")]
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| part |"), rows[0]
    return [[c.strip() for c in line.strip("|").split(" | ")] for line in rows[1:]]


def test_support_table_names_existing_test_files_for_every_row():
    """Each row's "how it is tested" cell names the test files behind it (or
    says "not run"), and every path the table names exists."""
    import re

    repo = README.parent
    rows = _support_rows()
    assert len(rows) >= 30
    missing, untested = [], []
    for part, _status, how in rows:
        assert how, part
        paths = re.findall(r"`((?:tests|plugins|bench|examples|docs)/[^`\s]+)`", how)
        missing += [p for p in paths if not (repo / p).exists()]
        named = [p for p in paths if re.search(r"(^|/)tests/(.*/)?test_[^/]+\.py$", p)]
        if not named and how != "not run":
            untested.append(part[:60])
    assert missing == [], f"README support table names paths that do not exist: {missing}"
    assert untested == [], f"README support table rows that name no test file (nor say 'not run'): {untested}"


# -- the kinds table ("Every kind in one place") ------------------------------------------------


def _table_cells(heading: str) -> list[list[str]]:
    """The rows of the first table after ``heading``, split into cells (``\\|`` stays in its cell)."""
    text = DOC.read_text(encoding="utf-8")
    start = text.index(heading)
    lines = text[start:].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[first + 2 :]:  # after the header and its |---| line
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        rows.append(cells)
    return rows


def test_kinds_table_is_the_kernel_kind_table():
    """Cell for cell what ``areal_kernel.api.kinds.KIND_DOCS`` says, one row per registry kind (the
    same list ``KIND_MODULES``, and so ``Registry.build``, comes from)."""
    from areal_kernel.api.kinds import KIND_DOCS, KIND_MODULES, kind_contract
    from areal_kernel.plugins.registry import KINDS

    import areal_kernel.testing as testing

    assert sorted(d.kind for d in KIND_DOCS) == sorted(KINDS), "KIND_DOCS must hold every registry kind once"
    assert KIND_MODULES == {d.kind: d.module for d in KIND_DOCS}
    assert all(kind_contract(d.kind).kind == d.kind for d in KIND_DOCS)  # each row's module holds its KIND
    for d in KIND_DOCS:
        assert d.suite.startswith("none") or d.suite in testing.__all__, f"{d.kind}: no suite {d.suite}"
    rows = _table_cells("### Every kind in one place")
    want = [d.cells() for d in KIND_DOCS]
    assert [len(r) for r in rows] == [5] * len(rows), [r for r in rows if len(r) != 5]
    assert rows == want, "docs/plugin-authoring.md 'Every kind in one place' differs from KIND_DOCS:\n" + "\n".join(
        f"row {i}: {a} != {b}" for i, (a, b) in enumerate(zip(rows, want)) if a != b
    )
    # Every link in a cell points at a heading of the page.
    text = DOC.read_text(encoding="utf-8")
    anchors = {
        re.sub(r"[^\w\- ]", "", h.lstrip("#").strip().lower()).replace(" ", "-")
        for h in text.splitlines()
        if h.startswith("#")
    }
    links = {a for d in KIND_DOCS for a in re.findall(r"\]\(#([\w-]+)\)", d.target)}
    assert links - anchors == set(), links - anchors


def test_each_suite_lives_in_the_module_named_after_its_kind():
    """Tests shaped like the code: the suite of the kind whose contract is
    ``areal_kernel.api.<m>`` is defined in ``areal_kernel.testing.contracts.<m>``,
    and so are the suites of that kind's capabilities."""
    from areal_kernel.api.kinds import CAPABILITY_SUITES, KIND_DOCS, KIND_MODULES

    import areal_kernel.testing as testing

    suites = [d for d in KIND_DOCS if not d.suite.startswith("none")]
    home = {d.suite: d.module for d in suites}
    home.update({suite: KIND_MODULES[kind] for suite, (kind, _) in CAPABILITY_SUITES.items()})
    assert sorted(home) == sorted(testing.__all__), [d.kind for d in suites]
    wrong = {
        suite: getattr(testing, suite).__module__
        for suite, module in home.items()
        if getattr(testing, suite).__module__ != "areal_kernel.testing.contracts." + module.rpartition(".")[2]
    }
    assert not wrong, f"suites outside the contracts module named after their kind's api module: {wrong}"
