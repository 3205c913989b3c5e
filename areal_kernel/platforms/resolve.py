"""Resolve the platform of this process, lazily and once.

Order: ``AREAL_PLATFORM`` (a registered platform name) > out-of-tree probes
from the ``areal.platforms`` entry-point group > built-in ``cuda`` > ``cpu``.
An out-of-tree probe is a zero-argument callable returning a
``"pkg.mod:Class"`` string when its hardware is present, else ``None``; it
must not import heavy libraries unless it is about to answer yes. A platform
named by ``AREAL_PLATFORM`` must be available (``is_available()``); otherwise
resolution fails with its ``unavailable_reason()``.
"""

from __future__ import annotations

import os
import threading
from importlib import metadata

from areal_kernel.errors import ArealError
from areal_kernel.platforms.base import Platform

PLATFORM_PROBE_GROUP = "areal.platforms"

_lock = threading.RLock()
_current: Platform | None = None


def _platform_class(name: str) -> type[Platform]:
    from areal_kernel.plugins.registry import get_registry

    # platform="" skips the registry's platform check, which would recurse here.
    spec = get_registry().get("platform", name, platform="")
    return spec.load()


def _from_registry(name: str) -> Platform:
    from areal_kernel.api.platform import PlatformContext
    from areal_kernel.plugins.registry import get_registry

    # platform="" skips the registry's platform check, which would recurse here.
    return get_registry().build("platform", name, PlatformContext(name), platform="")


def _probe_out_of_tree() -> Platform | None:
    from areal_kernel.plugins.registry import import_target

    for ep in metadata.entry_points(group=PLATFORM_PROBE_GROUP):
        try:
            target = ep.load()()
        except Exception:  # a broken probe must not hide the cpu fallback
            continue
        if target:
            return import_target(target)()
    return None


def resolve_platform() -> Platform:
    name = os.environ.get("AREAL_PLATFORM", "").strip()
    if name:
        try:
            cls = _platform_class(name)
            # Chosen by name, it must still be usable here: say why not now
            # instead of failing later inside a backend.
            if not cls.is_available():
                raise ArealError(cls.unavailable_reason())
            return _from_registry(name)
        except ArealError as e:
            raise ArealError(f"AREAL_PLATFORM={name!r} is not usable: {e}") from None
    found = _probe_out_of_tree()
    if found is not None:
        return found
    from areal_kernel.platforms.base import CpuPlatform, CudaPlatform

    if CudaPlatform.is_available():
        return CudaPlatform()
    return CpuPlatform()


def current_platform() -> Platform:
    """The platform of this process (resolved on first call)."""
    global _current
    if _current is None:
        with _lock:
            if _current is None:
                _current = resolve_platform()
    return _current


def platform_named(name: str) -> Platform:
    """The platform registered as ``name`` (the current one when it has that
    name). For hooks that receive a platform *name* and must ask it questions
    instead of comparing the name."""
    cur = current_platform()
    if not name or cur.name == name:
        return cur
    return _from_registry(name)


def reset_current_platform() -> None:
    """Forget the resolved platform (tests; after changing AREAL_PLATFORM)."""
    global _current
    with _lock:
        _current = None
