"""Resolve the platform of a process from a plugin registry.

Order: ``AREAL_PLATFORM`` (a registered platform name) > out-of-tree probes
from the ``areal.platforms`` entry-point group > built-in ``cuda`` > ``cpu``.
An out-of-tree probe is a zero-argument callable returning a
``"pkg.mod:Class"`` string when its hardware is present, else ``None``; it
must not import heavy libraries unless it is about to answer yes. A platform
named by ``AREAL_PLATFORM`` must be available (``is_available()``); otherwise
resolution fails with its ``unavailable_reason()``.

Stateless: the registry is passed in. The process's platform is resolved
once, by the plugin manager that owns the process registry
(``areal_kernel.platforms.current_platform()``), so that the registry can
check factories against it without importing this layer (no import cycle).
"""

from __future__ import annotations

import os
from importlib import metadata
from typing import TYPE_CHECKING, Callable

from areal_kernel.errors import ArealError
from areal_kernel.platforms.base import Platform
from areal_kernel.plugins.registry import import_target

if TYPE_CHECKING:
    from areal_kernel.plugins.registry import Registry

PLATFORM_PROBE_GROUP = "areal.platforms"


def _platform_class(name: str, registry: "Registry") -> type[Platform]:
    # platform="" skips the registry's platform check, which would recurse here.
    spec = registry.get("platform", name, platform="")
    return spec.load()


def platform_from_registry(name: str, registry: "Registry") -> Platform:
    """The platform registered as ``name`` in ``registry``, built."""
    from areal_kernel.api.platform import PlatformContext

    # platform="" skips the registry's platform check, which would recurse here.
    return registry.build("platform", name, PlatformContext(name), platform="")


def _probe_out_of_tree() -> Platform | None:
    for ep in metadata.entry_points(group=PLATFORM_PROBE_GROUP):
        try:
            target = ep.load()()
        except Exception:  # a broken probe must not hide the cpu fallback
            continue
        if target:
            return import_target(target)()
    return None


def resolve_platform(registry: "Callable[[], Registry]") -> Platform:
    """The platform of this process (see the module docstring). ``registry``
    gives the plugin registry; it is called only for a platform named by
    ``AREAL_PLATFORM``, so that resolving without one loads no plugin."""
    name = os.environ.get("AREAL_PLATFORM", "").strip()
    if name:
        try:
            reg = registry()
            cls = _platform_class(name, reg)
            # Chosen by name, it must still be usable here: say why not now
            # instead of failing later inside a backend.
            if not cls.is_available():
                raise ArealError(cls.unavailable_reason())
            return platform_from_registry(name, reg)
        except ArealError as e:
            raise ArealError(f"AREAL_PLATFORM={name!r} is not usable: {e}") from None
    found = _probe_out_of_tree()
    if found is not None:
        return found
    from areal_kernel.platforms.base import CpuPlatform, CudaPlatform

    if CudaPlatform.is_available():
        return CudaPlatform()
    return CpuPlatform()
