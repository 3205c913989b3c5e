"""Name the plugin behind a failure.

A plugin's code runs inside the kernel's processes, so an exception it
raises arrives with a kernel traceback around it. Users need to know whose
code failed (to report it to the right project), not where in the kernel it
surfaced: ``blame(exc)`` finds the innermost traceback frame that belongs to
an external plugin's package and the registered name (``reward
'length_penalty'``) whose target lives there, and ``PluginCodeError`` turns
that into the CLI's one-line error. The full traceback is kept as the
error's ``__cause__`` (``areal --debug``) and written to the run's
``error.log``.

Only plain exceptions are blamed: an ``ArealError`` raised by a plugin is
already a message for the user and stays as it is.
"""

from __future__ import annotations

import os
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Iterator

from areal_kernel import hookspecs
from areal_kernel.errors import ArealError, PluginCodeError
from areal_kernel.plugins.registry import FactorySpec

ERROR_LOG = "error.log"
_BUILTIN = "builtin"
# An observer or override hook of the plugin's own module raised.
HOOK_NAMES = frozenset(n for n in vars(hookspecs) if n.startswith("areal_"))


@dataclass(frozen=True)
class Blame:
    plugin: str  # entry-point name
    distribution: str  # "areal-myreward 1.0.2"
    registered: str  # "reward 'length_penalty'", "hook areal_on_run_start" or ""
    where: str  # "areal_myreward/impl.py:12 in length_penalty"


def plugin_origin(plugin: str) -> str:
    """``plugin 'healthy' (areal-test-healthy 1.2.3)``: the plugin and its distribution."""
    return f"plugin '{plugin}' ({distribution_of(plugin)})"


def spec_origin(spec: FactorySpec) -> str:
    """``dataset 'mydata' of plugin 'healthy' (areal-test-healthy 1.2.3)``."""
    return f"{spec.kind} '{spec.name}' of {plugin_origin(spec.plugin)}"


def distribution_of(plugin: str) -> str:
    from areal_kernel.plugins.manager import get_plugin_manager

    rec = get_plugin_manager().ensure_loaded().records.get(plugin)
    if rec is None or not rec.dist:
        return "distribution unknown"
    return f"{rec.dist} {rec.version}" if rec.version else rec.dist


def _top(module: str) -> str:
    return module.split(".", 1)[0]


def _frames(tb: TracebackType | None) -> list[tuple[str, str, str, int]]:
    """(module, function qualname, file, line) of each frame, outermost first."""
    out = []
    while tb is not None:
        frame = tb.tb_frame
        code = frame.f_code
        out.append(
            (
                str(frame.f_globals.get("__name__", "")),
                getattr(code, "co_qualname", code.co_name),
                code.co_filename,
                tb.tb_lineno,
            )
        )
        tb = tb.tb_next
    return out


def _exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, then what it was raised from or during (innermost cause last)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or (None if cur.__suppress_context__ else cur.__context__)


def blame(exc: BaseException) -> Blame | None:
    """The external plugin whose code raised ``exc`` (or an exception it was
    raised from), or ``None`` when no frame belongs to one."""
    from areal_kernel.plugins.manager import get_plugin_manager

    pm = get_plugin_manager().ensure_loaded()
    specs_by_plugin: dict[str, list[FactorySpec]] = {}
    for spec in pm.registry.specs():
        specs_by_plugin.setdefault(spec.plugin, []).append(spec)
    # Top-level package -> plugin: the packages its distribution installs and
    # its entry-point module's. Not the packages its targets name: a target
    # may be a class of a shared library (torch), whose frames are nobody's.
    owners: dict[str, str] = {}
    for name, rec in pm.records.items():
        if name == _BUILTIN or rec.status != "loaded":
            continue
        for package in _packages_of(rec.dist):
            owners.setdefault(package, name)
        if rec.module:
            owners.setdefault(_top(rec.module.partition(":")[0]), name)
    owners.pop("areal_kernel", None)  # kernel frames are never a plugin's
    for err in _exception_chain(exc):
        for module, qualname, filename, lineno in reversed(_frames(err.__traceback__)):
            plugin = owners.get(_top(module))
            if plugin is None:
                continue
            where = f"{_short_path(filename, module)}:{lineno} in {qualname}"
            func = qualname.split(".")[-1]
            if func in HOOK_NAMES:
                registered = f"hook {func}"
            else:
                registered = _registered_name(specs_by_plugin.get(plugin, []), module, qualname)
            return Blame(plugin, distribution_of(plugin), registered, where)
    return None


def _packages_of(dist: str | None) -> set[str]:
    """Top-level importable names a distribution installs (empty when unknown)."""
    if not dist:
        return set()
    from importlib import metadata

    try:
        files = metadata.distribution(dist).files or []
    except metadata.PackageNotFoundError:
        return set()
    out = set()
    for f in files:
        first = f.parts[0] if f.parts else ""
        if not first or first.endswith((".dist-info", ".egg-info", ".data")) or first in ("..", "__pycache__"):
            continue
        out.add(first[:-3] if first.endswith(".py") else first)
    return out


def _registered_name(specs: list[FactorySpec], module: str, qualname: str) -> str:
    """The registered name whose target best matches a frame: same module and
    attribute first, then same module, then same package; among equals the
    one this process actually loaded."""
    from areal_kernel.plugins.registry import loaded_specs

    loaded = loaded_specs()
    head = qualname.split(".")[0]

    def score(spec: FactorySpec) -> tuple[int, int]:
        target_module, _, attr = spec.target.partition(":")
        match = 0
        if target_module == module:
            match = 3 if attr.split(".")[0] == head else 2
        elif _top(target_module) == _top(module):
            match = 1
        return match, int((spec.kind, spec.name) in loaded)

    ranked = sorted(specs, key=score, reverse=True)
    if not ranked or score(ranked[0])[0] == 0:
        return ""
    return f"{ranked[0].kind} '{ranked[0].name}'"


def _short_path(filename: str, module: str) -> str:
    """``pkg/mod.py`` rather than a site-packages path that differs per machine."""
    parts = module.split(".")
    tail = os.path.join(*parts[:-1], os.path.basename(filename)) if len(parts) > 1 else os.path.basename(filename)
    return tail


def as_plugin_error(exc: BaseException, traceback_file: str | None = None) -> PluginCodeError | None:
    """A one-line ``PluginCodeError`` for ``exc`` when plugin code raised it
    (``None`` for ``ArealError``s and for failures in the kernel itself)."""
    if isinstance(exc, ArealError) or not isinstance(exc, Exception):
        return None
    b = blame(exc)
    if b is None:
        return None
    what = f"{b.registered} of plugin '{b.plugin}'" if b.registered else f"plugin '{b.plugin}'"
    detail = " ".join(f"{type(exc).__name__}: {exc}".split())  # one line, whatever the plugin wrote
    if len(detail) > 300:
        detail = detail[:297] + "..."
    where = f"full traceback in {traceback_file}" if traceback_file else "rerun with --debug for the traceback"
    msg = f"{what} ({b.distribution}) failed: {detail} (at {b.where}; {where})"
    return PluginCodeError(msg, plugin=b.plugin, distribution=b.distribution, registered=b.registered)


def write_traceback(exc: BaseException, run_dir: str) -> str | None:
    """Append ``exc``'s full traceback to ``<run_dir>/error.log``; its path,
    or ``None`` when the directory cannot be written."""
    path = os.path.join(run_dir, ERROR_LOG)
    try:
        os.makedirs(run_dir, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write("".join(traceback.format_exception(exc)))
            f.write("\n")
    except OSError:
        return None
    return path


@contextmanager
def plugin_failures_reported(run_dir: str) -> Iterator[None]:
    """Around a run: a plain exception from plugin code leaves as a one-line
    ``PluginCodeError`` (raised from the original, which ``--debug`` shows),
    with the full traceback appended to ``<run_dir>/error.log``. Everything
    else (``ArealError``s, kernel bugs, interrupts) passes unchanged."""
    try:
        yield
    except Exception as exc:
        if isinstance(exc, ArealError) or blame(exc) is None:
            raise
        err = as_plugin_error(exc, write_traceback(exc, run_dir))
        if err is None:
            raise
        raise err from exc
