"""Plugin discovery, guarded loading and the name registry."""

from areal_kernel.plugins.manager import PluginRecord, get_plugin_manager, get_registry, reset_plugin_manager
from areal_kernel.plugins.registry import FactorySpec, Registry

__all__ = [
    "FactorySpec",
    "PluginRecord",
    "Registry",
    "get_plugin_manager",
    "get_registry",
    "reset_plugin_manager",
]
