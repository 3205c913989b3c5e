"""The config's second phase: check plugin names and validate plugin settings.

Parsing (``ExperimentConfig.model_validate``, ``validate_config``) checks the
shape of a config and needs no plugin. ``resolve(config, registry)`` then
checks every name the config selects against ``registry`` (what the plugins
registered) and validates each settings section against the ``config_model``
its factory registered, defaults included where no section was written.

The registry is passed in, never looked up here: the config layer sits below
the plugin layer (``get_registry()`` loads the plugins). What it needs of a
registry is ``PluginLookup``; ``areal_kernel.plugins.Registry`` is one.
"""

from __future__ import annotations

import re
import warnings
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel

from areal_kernel.config.knobs import (
    ESTIMATOR_CALL_KEYWORDS,
    LEGACY_ESTIMATOR_KEYWORDS,
    LEGACY_LOSS_KEYWORDS,
    LOSS_CALL_KEYWORDS,
)
from areal_kernel.config.offline import FORMER_ALGORITHM_FIELDS
from areal_kernel.config.sections import PluginSection, unknown_section_error, validate_settings
from areal_kernel.errors import ArealDeprecationWarning, ConfigError, PluginLoadError, PluginNotFoundError

if TYPE_CHECKING:
    from areal_kernel.config.models import AlgorithmConfig, ExperimentConfig, LoggingConfig, SchedulerConfig


class SettingsSpec(Protocol):
    """What resolving needs of a registered factory (``FactorySpec`` is one)."""

    @property
    def kind(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def plugin(self) -> str: ...
    def config_model_cls(self) -> Any: ...


class PluginLookup(Protocol):
    """What resolving needs of the registry (``areal_kernel.plugins.Registry`` is one).

    ``get`` raises an error that says what is registered (and, with the
    default ``platform=None``, refuses a factory that does not support the
    current platform); ``find`` answers ``None`` instead."""

    def get(self, kind: str, name: str, *, platform: str | None = None) -> Any: ...
    def find(self, kind: str, name: str) -> Any: ...
    def specs(self, kind: str | None = None) -> list[Any]: ...


def resolve(config: ExperimentConfig, registry: PluginLookup, source: str = "config") -> ExperimentConfig:
    """Check ``config``'s plugin names against ``registry`` and validate
    every plugin settings section (in place; ``config`` is returned).

    One error, a ``ConfigError`` naming the field and what would be valid, at
    the first problem; ``source`` (the config file) heads the messages of
    names that the parse step used to report. Resolving twice is harmless."""
    for section in (config.actor, config.rollout, config.dataset, config.workflow, config.reward):
        resolve_plugin_section(section, registry)
    problems = _algorithm_name_problems(config.algorithm, registry) + _sink_name_problems(config.logging, registry)
    if problems:
        raise ConfigError(f"{source} is invalid:\n" + "\n".join(problems))
    _resolve_algorithm(config.algorithm, registry)
    _resolve_logging(config.logging, registry)
    _resolve_scheduler(config.scheduler, registry)
    return config


def resolve_plugin_section(section: PluginSection, registry: PluginLookup) -> PluginSection:
    """The second phase of one plugin section (``actor``, ``rollout``, ...):
    its selected name is registered (for the current platform) and its
    settings are valid; the settings become an instance of the config model."""
    where, name = section.where, section.selected_name
    try:
        spec = registry.get(section.registry_kind, name)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"{where}.{section.selector}: {e}") from None
    if section.__pydantic_extra__ is None:
        section.__pydantic_extra__ = {}
    extras = section.__pydantic_extra__
    settings = validate_settings(f"{where}.{name}", section.registry_kind, name, extras.get(name), spec=spec)
    if settings is None:
        extras.pop(name, None)
    else:
        extras[name] = settings
    if section.allocation_selector:
        # A backend's config model may check the dims of its allocation
        # (``check_allocation(allocation, where)``, raising ConfigError), so
        # that `areal validate` refuses e.g. parallelism it cannot run.
        check = getattr(spec.config_model_cls(), "check_allocation", None)
        if callable(check):
            check(section.allocation, f"{where}.{section.selector}")
    section._resolved_name = name
    return section


def _registered_names(registry: PluginLookup, kind: str) -> str:
    return ", ".join(sorted(s.name for s in registry.specs(kind)))


def _algorithm_name_problems(algorithm: AlgorithmConfig, registry: PluginLookup) -> list[str]:
    problems = []
    for kind, field in (("advantage_estimator", "advantage"), ("loss", "loss")):
        name = getattr(algorithm, field)
        if registry.find(kind, name) is None:
            problems.append(
                f"algorithm.{field}: no {kind} named {name!r} is registered; "
                f"registered: {_registered_names(registry, kind)}"
            )
    try:
        registry.get("trainer", algorithm.type, platform="")
    except (PluginNotFoundError, PluginLoadError) as e:
        # The registry's message lists the registered trainers and, for a
        # known plugin's name, the pip install that provides it.
        msg = str(e)
        for kind, field in (("advantage_estimator", "advantage"), ("loss", "loss")):
            if registry.find(kind, algorithm.type) is not None:
                # The name is right, the field is not: a near trainer name would mislead.
                msg = re.sub(r" Did you mean '[^']*'\?", "", msg)
                msg += (
                    f" '{algorithm.type}' is a registered {kind}: select it with algorithm.{field}: "
                    f"{algorithm.type} (the RL trainer is algorithm.type: grpo)."
                )
        problems.append(f"algorithm.type: {msg}")
    return problems


def _sink_name_problems(logging: LoggingConfig, registry: PluginLookup) -> list[str]:
    # Caught here, not after the run has started its servers.
    unknown = [n for n in logging.sinks if registry.find("metric_sink", n) is None]
    if not unknown:
        return []
    return [
        f"logging.sinks: no metric sink named {unknown[0]!r} is registered; "
        f"registered: {_registered_names(registry, 'metric_sink')}"
    ]


def _resolve_algorithm(algorithm: AlgorithmConfig, registry: PluginLookup) -> None:
    extras = algorithm.__pydantic_extra__ if algorithm.__pydantic_extra__ is not None else {}
    selected = algorithm.selected_factories()
    specs = {kind: registry.get(kind, name, platform="") for kind, name in selected.items()}
    has_model = {kind: spec.config_model_cls() is not None for kind, spec in specs.items()}
    # The section each selected factory reads: its name, or a trainer's
    # registered settings_section (the kernel's ipo reads algorithm.dpo).
    sections = {kind: getattr(specs[kind], "settings_section", None) or name for kind, name in selected.items()}
    for key in list(extras):
        if key in sections.values():
            continue
        former = registry.find("trainer", key) if key in FORMER_ALGORITHM_FIELDS else None
        if former is None:
            raise _foreign_section_error(algorithm, key, sections, specs["trainer"], registry)
        # Deprecated: validated and ignored, as when it was a field.
        validate_settings(f"algorithm.{key}", "trainer", key, extras[key], spec=former)
        warnings.warn(
            f"algorithm.{key}: the settings of trainer '{key}', which algorithm.type '{algorithm.type}' does not "
            "read; ignored. Remove the section: from the next minor release it is an error",
            ArealDeprecationWarning,
            stacklevel=2,
        )
        del extras[key]
    settings: dict[str, Any] = {}
    validated: dict[str, Any] = {}  # section name -> its validated settings
    for kind, name in selected.items():
        section = sections[kind]
        where = f"algorithm.{section}"
        if not has_model[kind] and any(has_model[k] for k, n in sections.items() if n == section):
            settings[kind] = None
            continue  # the section belongs to the same-named factory that declares settings
        value = validate_settings(where, kind, name, extras.get(section), spec=specs[kind])
        settings[kind] = value
        if value is None:
            continue
        if section in type(algorithm).model_fields:
            raise ConfigError(f"{where}: {kind} '{name}' declares settings, but '{section}' is an algorithm key")
        if section in validated:
            raise ConfigError(
                f"{where}: more than one of the selected advantage estimator, loss and trainer is named "
                f"'{section}' and declares settings; one section cannot hold both"
            )
        if kind != "trainer":
            # The kernel passes these itself (the knobs as keywords too, to a callable
            # without a knobs parameter, while that convention lasts): a settings
            # field of the same name could never arrive.
            if kind == "advantage_estimator":
                reserved = ESTIMATOR_CALL_KEYWORDS + LEGACY_ESTIMATOR_KEYWORDS
            else:
                reserved = LOSS_CALL_KEYWORDS + LEGACY_LOSS_KEYWORDS
            clash = sorted(set(type(value).model_fields) & set(reserved))
            if clash:
                raise ConfigError(
                    f"{where}: the config_model of {kind} '{name}' has field(s) {', '.join(clash)}, which the "
                    f"kernel already passes (algorithm.{clash[0]}); rename them in the plugin"
                )
        validated[section] = value
    for key in list(extras):
        if key not in validated and not extras[key]:
            del extras[key]  # an empty section of a factory without settings
    # Every selected factory with a config_model gets its validated settings,
    # defaults included when the user wrote no section (as the plugin sections do).
    extras.update(validated)
    algorithm._settings = {kind: (selected[kind], value) for kind, value in settings.items()}


def _foreign_section_error(
    algorithm: AlgorithmConfig, key: str, sections: dict[str, str], trainer: Any, registry: PluginLookup
) -> ConfigError:
    """The error for ``algorithm.<key>``, a mapping that no selected factory reads."""
    owners = sorted(
        s.name for s in registry.specs("trainer") if (getattr(s, "settings_section", None) or s.name) == key
    )
    if owners:
        # Another trainer's section (e.g. algorithm.sft left in a config switched to dpo).
        own = (
            f"its settings are algorithm.{sections['trainer']}"
            if trainer.config_model_cls() is not None
            else "it takes no settings"
        )
        return ConfigError(
            f"algorithm.{key}: the settings of trainer {' / '.join(repr(o) for o in owners)}, but algorithm.type "
            f"selects '{algorithm.type}' ({own}); remove the section or change algorithm.type"
        )
    shared = sections["trainer"] != algorithm.type
    return unknown_section_error(
        "algorithm",
        key,
        [*type(algorithm).model_fields, *sorted(set(sections.values()))],
        f"a settings section is named after the selected advantage '{algorithm.advantage}' or loss "
        f"'{algorithm.loss}', or the trainer '{algorithm.type}' (algorithm.type)"
        + (f", whose settings are algorithm.{sections['trainer']}" if shared else ""),
    )


def _resolve_logging(logging: LoggingConfig, registry: PluginLookup) -> None:
    extras = logging.__pydantic_extra__ if logging.__pydantic_extra__ is not None else {}
    for name in logging.sinks:
        spec = registry.get("metric_sink", name, platform="")
        settings = validate_settings(f"logging.{name}", "metric_sink", name, extras.get(name), spec=spec)
        if settings is not None:
            extras[name] = settings
        else:
            extras.pop(name, None)  # an empty section of a sink without settings
    logging._resolved_sinks = tuple(logging.sinks)


def _resolve_scheduler(scheduler: SchedulerConfig, registry: PluginLookup) -> None:
    names = sorted(s.name for s in registry.specs("scheduler"))
    if scheduler.type != "auto" and registry.find("scheduler", scheduler.type) is None:
        raise ConfigError(
            f"scheduler.type: no scheduler named {scheduler.type!r} is registered; registered: {', '.join(names)} "
            "(or 'auto')"
        )
    allowed = names if scheduler.type == "auto" else [scheduler.type]
    extras = scheduler.__pydantic_extra__ if scheduler.__pydantic_extra__ is not None else {}
    for key in list(extras):
        if key not in allowed:
            raise unknown_section_error(
                "scheduler", key, [*type(scheduler).model_fields, *allowed],
                f"a settings section is named after the selected scheduler ({', '.join(allowed)})",
            )  # fmt: skip
    # Every allowed scheduler's settings (the section given, else its model's
    # defaults): with type auto the areal_select_scheduler hook picks one later.
    sections: dict[str, BaseModel | None] = {}
    for name in allowed:
        spec = registry.get("scheduler", name, platform="")
        sections[name] = validate_settings(f"scheduler.{name}", "scheduler", name, extras.get(name), spec=spec)
        if name in extras:
            if sections[name] is None:
                del extras[name]
            else:
                extras[name] = sections[name]
    scheduler._resolved_type = scheduler.type
    scheduler._sections = sections
