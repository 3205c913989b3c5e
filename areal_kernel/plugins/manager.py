"""Discovers ``areal.plugins`` entry points and loads each one under a guard.

- Lazy: nothing is imported until the registry is first used.
- Idempotent and thread-safe: ``ensure_loaded`` runs once per process; every
  worker process (train rank, server) rebuilds its own registry the same way.
- Guarded: a plugin that fails to import or to register is recorded (its
  distribution, version and traceback) and only raised when a user selects one
  of its names, unless ``AREAL_STRICT_PLUGINS=1``.
- Filtered: ``AREAL_PLUGINS`` unset loads every plugin; empty loads none; a
  comma list loads those. The kernel's own ``builtin`` plugin always loads.
- Compatible: a plugin whose distribution requires an ``areal-kernel``
  version range that excludes this kernel is skipped before import.
"""

from __future__ import annotations

import importlib
import os
import threading
import traceback
from dataclasses import dataclass, field
from importlib import metadata
from typing import TYPE_CHECKING, Any

import pluggy

from areal_kernel import hookspecs
from areal_kernel.errors import PluginLoadError
from areal_kernel.plugins.registry import FactorySpec, Registry

if TYPE_CHECKING:
    from areal_kernel.platforms.base import Platform

ENTRY_POINT_GROUP = "areal.plugins"
BUILTIN = "builtin"
BUILTIN_MODULE = "areal_kernel.builtin"  # the value of the kernel's own areal.plugins entry point
KERNEL_DIST = "areal-kernel"


@dataclass
class PluginRecord:
    """What happened to one plugin in this process."""

    name: str  # entry-point name
    module: str
    dist: str | None = None
    version: str | None = None
    status: str = "pending"  # loaded | failed | incompatible | disabled
    error: str | None = None
    registered: list[tuple[str, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "module": self.module,
            "distribution": self.dist,
            "version": self.version,
            "status": self.status,
            "error": self.error,
            "registers": [f"{k}:{n}" for k, n in self.registered],
        }


def _normalize(dist_name: str) -> str:
    return dist_name.lower().replace("_", "-").replace(".", "-")


def _kernel_version() -> str:
    from areal_kernel import __version__

    return __version__


def kernel_requirement_problem(dist: metadata.Distribution | None) -> str | None:
    """Why ``dist`` cannot run on this kernel, or ``None`` when it can."""
    if dist is None:
        return None
    from packaging.requirements import InvalidRequirement, Requirement

    for req_text in dist.requires or []:
        try:
            req = Requirement(req_text)
        except InvalidRequirement:
            continue
        if _normalize(req.name) != KERNEL_DIST or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        version = _kernel_version()
        if not req.specifier.contains(version, prereleases=True):
            return (
                f"{dist.metadata['Name']} {dist.version} requires {KERNEL_DIST}{req.specifier}, "
                f"but {KERNEL_DIST} {version} is installed; upgrade one of them"
            )
    return None


def _enabled_filter() -> set[str] | None:
    raw = os.environ.get("AREAL_PLUGINS")
    if raw is None:
        return None
    return {p.strip() for p in raw.split(",") if p.strip()}


def _strict() -> bool:
    return os.environ.get("AREAL_STRICT_PLUGINS", "").strip().lower() in {"1", "true", "yes", "on"}


class PluginManager:
    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        # The registry checks factories against this manager's platform (platform()).
        self.registry = Registry(platform_name=lambda: self.platform().name)
        self.records: dict[str, PluginRecord] = {}
        self._loaded = False
        self._lock = threading.RLock()
        self._platform: Platform | None = None

    @property
    def hook(self) -> Any:
        """Call hooks after loading: ``get_plugin_manager().hook.areal_on_train_step(...)``."""
        self.ensure_loaded()
        return self.pm.hook

    # -- the process's platform ----------------------------------------------
    def platform(self) -> "Platform":
        """The platform of this process, resolved once from this manager's
        registry (``areal_kernel.platforms.resolve``); ``current_platform()``
        is this. Held here, beside the registry, so that neither the registry
        nor the platform layer has to import the other."""
        if self._platform is None:
            with self._lock:
                if self._platform is None:
                    from areal_kernel.platforms.resolve import resolve_platform

                    self._platform = resolve_platform(lambda: self.ensure_loaded().registry)
        return self._platform

    def reset_platform(self) -> None:
        """Forget the resolved platform (tests; after changing AREAL_PLATFORM)."""
        with self._lock:
            self._platform = None

    # -- loading -------------------------------------------------------------
    def ensure_loaded(self) -> "PluginManager":
        if self._loaded:
            return self
        with self._lock:
            if not self._loaded:
                self._load_all()
                self._loaded = True
        return self

    def _load_all(self) -> None:
        # The builtin plugin is loaded by name, as every plugin is (its
        # areal.plugins entry point names the same module): the plugin layer
        # sits below the plugins it loads, the kernel's own included. It is
        # loaded first and without the entry-point metadata, so it is always there.
        builtin_module = importlib.import_module(BUILTIN_MODULE)
        self._register_module(
            PluginRecord(BUILTIN, builtin_module.__name__, KERNEL_DIST, _kernel_version()), builtin_module
        )
        wanted = _enabled_filter()
        for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            if ep.name == BUILTIN or ep.name in self.records:
                continue
            dist = getattr(ep, "dist", None)
            rec = PluginRecord(
                name=ep.name,
                module=ep.value,
                dist=dist.metadata["Name"] if dist else None,
                version=dist.version if dist else None,
            )
            self.records[ep.name] = rec
            if wanted is not None and ep.name not in wanted:
                rec.status = "disabled"
                rec.error = "not listed in AREAL_PLUGINS"
                self.registry.disabled_plugins.append(ep.name)
                continue
            problem = kernel_requirement_problem(dist)
            if problem:
                rec.status = "incompatible"
                rec.error = problem
                self._fail(rec, problem)
                continue
            try:
                module = ep.load()
            except Exception as e:
                rec.status = "failed"
                rec.error = f"import of {ep.value} failed: {type(e).__name__}: {e}\n{traceback.format_exc()}"
                self._fail(rec, rec.error, e)
                continue
            self._register_module(rec, module)
        if wanted:
            for missing in sorted(wanted - set(self.records)):
                self.records[missing] = PluginRecord(
                    missing, "", status="failed", error="listed in AREAL_PLUGINS but not installed"
                )

    def _fail(self, rec: PluginRecord, message: str, exc: BaseException | None = None) -> None:
        self.registry.failed_plugins[rec.name] = (f"{rec.dist} {rec.version}", message)
        if _strict():
            raise PluginLoadError(f"plugin '{rec.name}' ({rec.dist} {rec.version}): {message}") from exc

    def _register_module(self, rec: PluginRecord, module: Any) -> None:
        """Register ``module``'s hooks and run its registration hooks, guarded."""
        self.records[rec.name] = rec
        try:
            self.pm.register(module, name=rec.name)
            # A hookimpl whose name matches no spec (a typo) is an error now,
            # not a silently ignored function.
            self.pm.check_pending()
        except Exception as e:
            if self.pm.is_registered(module):
                self.pm.unregister(module)
            rec.status = "failed"
            rec.error = f"invalid hook implementation: {type(e).__name__}: {e}"
            self._fail(rec, rec.error, e)
            return
        try:
            for kind, hook_name in hookspecs.REGISTRATION_HOOKS.items():
                for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                    if impl.plugin_name == rec.name:
                        impl.function(register=self._make_register(rec, kind))
        except Exception as e:
            self.registry.remove_plugin(rec.name)
            self.pm.unregister(name=rec.name)
            rec.registered.clear()
            rec.status = "failed"
            rec.error = f"registration failed: {type(e).__name__}: {e}\n{traceback.format_exc()}"
            self._fail(rec, rec.error, e)
            return
        rec.status = "loaded"

    def _make_register(self, rec: PluginRecord, kind: str):
        def register(
            name: str,
            target: str,
            *,
            config_model: Any = None,
            platforms: list[str] | tuple[str, ...] | None = None,
            capabilities: list[str] | tuple[str, ...] = (),
            description: str = "",
            success_threshold: float | None = None,
            worker_preload: list[str] | tuple[str, ...] = (),
            settings_section: str | None = None,
        ) -> None:
            if not isinstance(name, str) or not name:
                raise ValueError(f"plugin '{rec.name}' registered a {kind} with an empty name")
            if not isinstance(target, str) or ":" not in target:
                raise ValueError(
                    f"plugin '{rec.name}' registered {kind} '{name}' with target {target!r}; "
                    "expected a lazy 'package.module:Attribute' string"
                )
            if success_threshold is not None:
                if kind != "reward":
                    raise ValueError(
                        f"plugin '{rec.name}' gave {kind} '{name}' a success_threshold; only rewards have one"
                    )
                if (
                    isinstance(success_threshold, bool)
                    or not isinstance(success_threshold, (int, float))
                    or success_threshold != success_threshold
                    or abs(success_threshold) == float("inf")
                ):
                    raise ValueError(
                        f"plugin '{rec.name}' registered reward '{name}' with success_threshold "
                        f"{success_threshold!r}; expected a finite number (the reward of a solved sample)"
                    )
                success_threshold = float(success_threshold)
            worker_preload = tuple(worker_preload)
            if worker_preload:
                if kind != "reward":
                    raise ValueError(
                        f"plugin '{rec.name}' gave {kind} '{name}' a worker_preload; only rewards run in workers"
                    )
                bad = [p for p in worker_preload if not isinstance(p, str) or not p.strip(":. ") or p.count(":") > 1]
                if bad:
                    raise ValueError(
                        f"plugin '{rec.name}' registered reward '{name}' with worker_preload entries {bad!r}; "
                        "expected 'package.module' (imported) or 'package.module:function' (called)"
                    )
            if settings_section is not None:
                if kind != "trainer":
                    raise ValueError(
                        f"plugin '{rec.name}' gave {kind} '{name}' a settings_section; only trainers share one"
                    )
                if not isinstance(settings_section, str) or not settings_section.isidentifier():
                    raise ValueError(
                        f"plugin '{rec.name}' registered trainer '{name}' with settings_section "
                        f"{settings_section!r}; expected a name (the key under algorithm:)"
                    )
                if config_model is None:
                    raise ValueError(
                        f"plugin '{rec.name}' registered trainer '{name}' with settings_section "
                        f"{settings_section!r} but no config_model; the section holds that model's settings"
                    )
            spec = FactorySpec(
                kind=kind,
                name=name,
                target=target,
                plugin=rec.name,
                config_model=config_model,
                platforms=tuple(platforms) if platforms is not None else None,
                capabilities=frozenset(capabilities),
                description=description,
                success_threshold=success_threshold,
                worker_preload=worker_preload,
                settings_section=settings_section,
            )
            self.registry.add(spec, builtin=rec.name == BUILTIN)
            rec.registered.append((kind, name))

        return register


_manager: PluginManager | None = None
_manager_lock = threading.Lock()


def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager (plugins load on first registry use)."""
    global _manager
    if _manager is None:
        with _manager_lock:
            if _manager is None:
                _manager = PluginManager()
    return _manager


def get_registry() -> Registry:
    """The process-wide registry, with every enabled plugin loaded (lazily, once)."""
    return get_plugin_manager().ensure_loaded().registry


def reset_plugin_manager() -> None:
    """Forget loaded plugins and the platform resolved with them (tests; after
    changing AREAL_PLUGINS or AREAL_PLATFORM)."""
    global _manager
    with _manager_lock:
        _manager = None
