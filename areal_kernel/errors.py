"""Error types. Every user mistake surfaces as an ``ArealError`` subclass whose
message names the field, file or plugin and what would be valid; the CLI prints
it on one line (traceback only with ``--debug``).

Plugins report a user's mistake the same way: raise ``ArealError`` (or a
subclass such as ``ConfigError`` or ``DataError``) with a message that says
what to change. Any other exception from plugin code is treated as a bug in
the plugin and reported as a ``PluginCodeError`` naming it."""

from __future__ import annotations


class ArealError(Exception):
    """Base of every error the kernel reports to users."""


class ArealDeprecationWarning(DeprecationWarning):
    """A name or convention of the kernel's API that goes away in the next
    minor release (docs/api.md, "Versioning policy"). A subclass so that the
    ``areal`` CLI can show these while Python keeps hiding other packages'
    deprecations (``DeprecationWarning`` is hidden by default outside
    ``__main__``): an author running ``areal train`` with an old-style plugin
    is told."""


class ConfigError(ArealError):
    """The configuration (YAML or overrides) is invalid."""


class PluginError(ArealError):
    """A plugin or a registered name cannot be used."""


class PluginNotFoundError(PluginError):
    """No plugin registered the requested name."""


class PluginLoadError(PluginError):
    """The plugin that provides the name failed to load."""


class PluginCodeError(PluginError):
    """Code of an installed plugin raised a plain exception (a bug in the
    plugin, not a user mistake the plugin reported). The message names the
    plugin, its distribution and the registered name; ``__cause__`` is the
    original exception.

    ``plugin``, ``distribution`` and ``registered`` (``"reward 'x'"``,
    ``"hook areal_on_run_start"``, or ``""`` when unknown) say whose code it was.
    """

    def __init__(self, message: str, *, plugin: str = "", distribution: str = "", registered: str = "") -> None:
        super().__init__(message)
        self.plugin = plugin
        self.distribution = distribution
        self.registered = registered


class PlatformNotSupportedError(PluginError):
    """The name exists but does not support the current platform."""


class DataError(ArealError):
    """A dataset file is missing, empty or lacks required fields."""


class ServerError(ArealError):
    """An inference server failed to start or answered badly."""
