"""The platform of this process: resolved once, from the process registry.

The plugin manager holds it (``PluginManager.platform()``), beside the
registry it is resolved from, so that ``Registry.get`` checks factories
against it through the callable the manager gives the registry instead of
importing this layer.
"""

from __future__ import annotations

from areal_kernel.platforms.base import Platform
from areal_kernel.platforms.resolve import platform_from_registry
from areal_kernel.plugins.manager import get_plugin_manager


def current_platform() -> Platform:
    """The platform of this process (resolved on first call)."""
    return get_plugin_manager().platform()


def platform_named(name: str) -> Platform:
    """The platform registered as ``name`` (the current one when it has that
    name). For hooks that receive a platform *name* and must ask it questions
    instead of comparing the name."""
    cur = current_platform()
    if not name or cur.name == name:
        return cur
    return platform_from_registry(name, get_plugin_manager().ensure_loaded().registry)


def reset_current_platform() -> None:
    """Forget the resolved platform (tests; after changing AREAL_PLATFORM)."""
    get_plugin_manager().reset_platform()
