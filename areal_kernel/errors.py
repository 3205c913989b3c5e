"""Error types. Every user mistake surfaces as an ``ArealError`` subclass whose
message names the field, file or plugin and what would be valid; the CLI prints
it on one line (traceback only with ``--debug``)."""
from __future__ import annotations


class ArealError(Exception):
    """Base of every error the kernel reports to users."""


class ConfigError(ArealError):
    """The configuration (YAML or overrides) is invalid."""


class PluginError(ArealError):
    """A plugin or a registered name cannot be used."""


class PluginNotFoundError(PluginError):
    """No plugin registered the requested name."""


class PluginLoadError(PluginError):
    """The plugin that provides the name failed to load."""


class PlatformNotSupportedError(PluginError):
    """The name exists but does not support the current platform."""


class DataError(ArealError):
    """A dataset file is missing, empty or lacks required fields."""


class ServerError(ArealError):
    """An inference server failed to start or answered badly."""
