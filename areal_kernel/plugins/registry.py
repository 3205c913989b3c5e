"""The name registry: ``(kind, name) -> FactorySpec``, filled by registration hooks.

Factories are import strings, so registering costs nothing; the target is
imported only when a run selects the name.
"""

from __future__ import annotations

import difflib
import importlib
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, overload

from areal_kernel.errors import (
    ConfigError,
    PlatformNotSupportedError,
    PluginError,
    PluginLoadError,
    PluginNotFoundError,
)
from areal_kernel.hookspecs import REGISTRATION_HOOKS
from areal_kernel.plugins.known import install_hint

if TYPE_CHECKING:
    from areal_kernel.api.advantage_estimator import AdvantageEstimator, AdvantageEstimatorContext
    from areal_kernel.api.dataset import DatasetContext, DatasetSplits
    from areal_kernel.api.engine import TrainEngine, TrainEngineContext
    from areal_kernel.api.inference_engine import InferenceBackendContext, InferenceBackendProtocol
    from areal_kernel.api.loss import LossContext, PolicyLoss
    from areal_kernel.api.metric_sink import MetricSinkContext, MetricSinkProtocol
    from areal_kernel.api.environment import EnvironmentContext, EnvironmentSpec
    from areal_kernel.api.model_source import ModelSourceContext
    from areal_kernel.api.platform import Platform, PlatformContext
    from areal_kernel.api.reward import Reward, RewardContext
    from areal_kernel.api.scheduler import Scheduler, SchedulerContext
    from areal_kernel.api.tool import Tool, ToolContext
    from areal_kernel.api.tool_parser import ToolCallParser, ToolParserContext
    from areal_kernel.api.trainer import Trainer, TrainerContext
    from areal_kernel.api.weight_transport import WeightTransportContext, WeightTransportProtocol
    from areal_kernel.api.workflow import WorkflowContext, WorkflowProtocol

KINDS: tuple[str, ...] = tuple(REGISTRATION_HOOKS)


def import_target(target: str) -> Any:
    """Import ``"pkg.module:Attr.sub"`` and return the attribute."""
    if ":" not in target:
        raise ValueError(f"factory target {target!r} must look like 'package.module:Attribute'")
    module_name, _, attr_path = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    return obj


_LOADED: set[tuple[str, str]] = set()


def loaded_specs() -> frozenset[tuple[str, str]]:
    """``(kind, name)`` of every factory this process has loaded."""
    return frozenset(_LOADED)


@dataclass(frozen=True)
class FactorySpec:
    """A registered, not yet imported, factory."""

    kind: str
    name: str
    target: str
    plugin: str
    config_model: Any = None  # pydantic model class, or "pkg.mod:Model", or None
    platforms: tuple[str, ...] | None = None
    capabilities: frozenset[str] = field(default_factory=frozenset)
    description: str = ""
    # Rewards only: a sample whose reward reaches this value counts as solved
    # (eval/accuracy). Partial credit below it still counts in eval/reward.
    success_threshold: float | None = None
    # Rewards only: "pkg.module" (imported) or "pkg.module:function" (called)
    # in every reward worker process before its first sample.
    worker_preload: tuple[str, ...] = ()
    # Trainers only: the ``algorithm.<section>`` its settings are read from,
    # when not ``algorithm.<name>`` (several trainer names sharing one section,
    # as the kernel's ``dpo`` and ``ipo`` share ``algorithm.dpo``).
    settings_section: str | None = None

    @property
    def section(self) -> str:
        """The name of the settings section this factory reads (its own name
        unless it registered a ``settings_section``)."""
        return self.settings_section or self.name

    def load(self) -> Any:
        """Import the factory; a failure names the plugin and keeps the real cause."""
        # Remembered so that a later failure can be traced to the name in use.
        _LOADED.add((self.kind, self.name))
        try:
            return import_target(self.target)
        except Exception as e:
            raise PluginLoadError(
                f"{self.kind} '{self.name}' (plugin '{self.plugin}') failed to import "
                f"{self.target}: {type(e).__name__}: {e}\n{traceback.format_exc()}"
            ) from e

    def config_model_cls(self) -> Any:
        if self.config_model is None or not isinstance(self.config_model, str):
            return self.config_model
        try:
            return import_target(self.config_model)
        except Exception as e:
            raise PluginLoadError(
                f"config model {self.config_model} of {self.kind} '{self.name}' "
                f"(plugin '{self.plugin}') failed to import: {type(e).__name__}: {e}"
            ) from e

    def supports(self, platform: str) -> bool:
        return self.platforms is None or platform in self.platforms

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "name": self.name,
            "target": self.target,
            "plugin": self.plugin,
            "platforms": list(self.platforms) if self.platforms else None,
            "capabilities": sorted(self.capabilities),
            "description": self.description,
            "success_threshold": self.success_threshold,
            "worker_preload": list(self.worker_preload),
            "settings_section": self.settings_section,
            "config_model": self.config_model
            if isinstance(self.config_model, str) or self.config_model is None
            else f"{self.config_model.__module__}:{self.config_model.__qualname__}",
        }


class Registry:
    """Factories by kind and name, with the plugin-load state needed for good errors."""

    def __init__(self, platform_name: Callable[[], str] | None = None) -> None:
        """``platform_name``: the name of the current platform, for the
        default platform check of ``get``/``build``. The process registry
        (``get_registry()``) has the plugin manager's; a registry filled by
        hand without one checks only the platform passed explicitly."""
        self.platform_name = platform_name
        self._specs: dict[str, dict[str, FactorySpec]] = {k: {} for k in KINDS}
        self.conflicts: list[str] = []
        # filled by the plugin manager: entry-point name -> (dist, error text)
        self.failed_plugins: dict[str, tuple[str, str]] = {}
        self.disabled_plugins: list[str] = []

    # -- registration --------------------------------------------------------
    def add(self, spec: FactorySpec, *, builtin: bool = False) -> None:
        if spec.kind not in self._specs:
            raise ValueError(f"unknown registry kind {spec.kind!r}; valid: {', '.join(KINDS)}")
        table = self._specs[spec.kind]
        old = table.get(spec.name)
        if old is not None and old.plugin != spec.plugin:
            if old.plugin == "builtin" and not builtin:
                # External plugins may replace a kernel default on purpose.
                self.conflicts.append(f"{spec.kind} '{spec.name}': plugin '{spec.plugin}' overrides the built-in")
            else:
                self.conflicts.append(
                    f"{spec.kind} '{spec.name}': registered by both '{old.plugin}' and "
                    f"'{spec.plugin}'; keeping '{old.plugin}'"
                )
                return
        table[spec.name] = spec

    def remove_plugin(self, plugin: str) -> None:
        for table in self._specs.values():
            for name in [n for n, s in table.items() if s.plugin == plugin]:
                del table[name]

    # -- lookup --------------------------------------------------------------
    def names(self, kind: str) -> list[str]:
        return sorted(self._specs[kind])

    def specs(self, kind: str | None = None) -> list[FactorySpec]:
        kinds = [kind] if kind else list(KINDS)
        return [s for k in kinds for _, s in sorted(self._specs[k].items())]

    def find(self, kind: str, name: str) -> FactorySpec | None:
        return self._specs.get(kind, {}).get(name)

    def get(self, kind: str, name: str, *, platform: str | None = None) -> FactorySpec:
        """The factory ``name`` of ``kind``, or an error that says what to do.

        ``platform``: check that the factory supports it (default: the
        current platform, ``platform_name()``; pass ``""`` to skip the check).
        """
        if kind not in self._specs:
            raise ValueError(f"unknown registry kind {kind!r}; valid: {', '.join(KINDS)}")
        spec = self._specs[kind].get(name)
        if spec is None:
            raise self._not_found(kind, name)
        if platform is None and (spec.platforms is None or self.platform_name is None):
            return spec  # supports every platform (no need to resolve the current one), or none is known
        if platform is None:
            assert self.platform_name is not None
            # The registry sits below the platform layer: the current platform
            # comes from whoever made the registry (the plugin manager).
            platform = self.platform_name()
        if platform and not spec.supports(platform):
            raise PlatformNotSupportedError(
                f"{kind} '{name}' (plugin '{spec.plugin}') supports platforms "
                f"{', '.join(spec.platforms or ())}; the current platform is '{platform}' "
                f"(set AREAL_PLATFORM to choose another)"
            )
        return spec

    # -- building ------------------------------------------------------------
    @overload
    def build(
        self,
        kind: Literal["train_engine"],
        name: str,
        ctx: "TrainEngineContext",
        *,
        platform: str | None = ...,
        where: str = ...,
    ) -> "TrainEngine": ...
    @overload
    def build(
        self,
        kind: Literal["inference_engine"],
        name: str,
        ctx: "InferenceBackendContext",
        *,
        platform: str | None = ...,
        where: str = ...,
    ) -> "InferenceBackendProtocol": ...
    @overload
    def build(
        self,
        kind: Literal["weight_transport"],
        name: str,
        ctx: "WeightTransportContext",
        *,
        platform: str | None = ...,
        where: str = ...,
    ) -> "WeightTransportProtocol": ...
    @overload
    def build(
        self,
        kind: Literal["scheduler"],
        name: str,
        ctx: "SchedulerContext",
        *,
        platform: str | None = ...,
        where: str = ...,
    ) -> "Scheduler": ...
    @overload
    def build(
        self,
        kind: Literal["platform"],
        name: str,
        ctx: "PlatformContext",
        *,
        platform: str | None = ...,
        where: str = ...,
    ) -> "Platform": ...
    @overload
    def build(
        self,
        kind: Literal["dataset"],
        name: str,
        ctx: "DatasetContext",
        *,
        platform: str | None = ...,
        where: str = ...,
    ) -> "DatasetSplits": ...
    @overload
    def build(
        self, kind: Literal["reward"], name: str, ctx: "RewardContext", *, platform: str | None = ..., where: str = ...
    ) -> "Reward": ...
    @overload
    def build(
        self,
        kind: Literal["workflow"],
        name: str,
        ctx: "WorkflowContext",
        *,
        platform: str | None = ...,
        where: str = ...,
    ) -> "WorkflowProtocol": ...
    @overload
    def build(
        self,
        kind: Literal["advantage_estimator"],
        name: str,
        ctx: "AdvantageEstimatorContext",
        *,
        platform: str | None = ...,
        where: str = ...,
    ) -> "AdvantageEstimator": ...
    @overload
    def build(
        self, kind: Literal["loss"], name: str, ctx: "LossContext", *, platform: str | None = ..., where: str = ...
    ) -> "PolicyLoss": ...
    @overload
    def build(
        self,
        kind: Literal["metric_sink"],
        name: str,
        ctx: "MetricSinkContext",
        *,
        platform: str | None = ...,
        where: str = ...,
    ) -> "MetricSinkProtocol": ...
    @overload
    def build(
        self,
        kind: Literal["model_source"],
        name: str,
        ctx: "ModelSourceContext",
        *,
        platform: str | None = ...,
        where: str = ...,
    ) -> str: ...
    @overload
    def build(
        self,
        kind: Literal["environment"],
        name: str,
        ctx: "EnvironmentContext",
        *,
        platform: str | None = ...,
        where: str = ...,
    ) -> "EnvironmentSpec": ...
    @overload
    def build(
        self,
        kind: Literal["trainer"],
        name: str,
        ctx: "TrainerContext",
        *,
        platform: str | None = ...,
        where: str = ...,
    ) -> "Trainer": ...
    @overload
    def build(
        self,
        kind: Literal["tool_parser"],
        name: str,
        ctx: "ToolParserContext",
        *,
        platform: str | None = ...,
        where: str = ...,
    ) -> "ToolCallParser": ...
    @overload
    def build(
        self, kind: Literal["tool"], name: str, ctx: "ToolContext", *, platform: str | None = ..., where: str = ...
    ) -> "Tool": ...
    @overload
    def build(self, kind: str, name: str, ctx: Any, *, platform: str | None = ..., where: str = ...) -> Any: ...

    def build(self, kind: str, name: str, ctx: Any, *, platform: str | None = None, where: str = "") -> Any:
        """Build ``name`` of ``kind`` through its registered factory with the
        kind's context ``ctx``, and check the result against the kind's
        contract (``areal_kernel.api.<kind module>``, see ``areal_kernel.api.kinds``).

        The one construction path of the kernel: a plugin whose object falls
        short of its kind's contract is named here (``PluginContractError``:
        the kind, the name, the plugin, the missing members), before the run
        uses it. ``platform``: as for ``get``. ``where``: the config field
        that selected the name, put before lookup and contract errors (a
        lookup error then becomes a ``ConfigError`` of that field).
        """
        from areal_kernel.api.kinds import kind_contract, shortfall_error

        contract = kind_contract(kind)
        if not isinstance(ctx, contract.context):
            raise TypeError(
                f"Registry.build({kind!r}, {name!r}, ctx): ctx must be a {contract.context.__module__}."
                f"{contract.context.__qualname__}, got {type(ctx).__name__}"
            )
        try:
            spec = self.get(kind, name, platform=platform)
        except PluginError as e:
            if not where:
                raise
            # The user wrote the name in that field: the field's error.
            raise ConfigError(f"{where}: {e}") from None
        obj = contract.construct(spec.load(), ctx, spec)
        missing = contract.shortfalls(obj)
        if missing:
            raise shortfall_error(spec, obj, missing, contract.contract_name, where)
        return obj

    def _not_found(self, kind: str, name: str) -> Exception:
        if name in self.failed_plugins:
            dist, err = self.failed_plugins[name]
            # The cause in one line; the traceback stays in `areal plugins --json`
            # for whoever asks, not in the user's error.
            cause = err.split("Traceback (most recent call last)")[0].strip() or err.strip().splitlines()[-1]
            return PluginLoadError(
                f"{kind} '{name}': plugin '{name}' ({dist}) is installed but failed to load: {cause} "
                f"(full traceback: areal plugins --json)"
            )
        available = self.names(kind)
        parts = [f"no {kind} named '{name}'."]
        parts.append(f"Available: {', '.join(available)}." if available else f"No {kind} is registered.")
        close = difflib.get_close_matches(name, available, n=1)
        if close:
            parts.append(f"Did you mean '{close[0]}'?")
        hint = install_hint(name, kind)
        if hint:
            parts.append(hint + ".")
        if self.failed_plugins:
            parts.append(
                "Plugins that failed to load: " + ", ".join(sorted(self.failed_plugins)) + " (see `areal plugins`)."
            )
        if self.disabled_plugins:
            parts.append("Plugins disabled by AREAL_PLUGINS: " + ", ".join(sorted(self.disabled_plugins)) + ".")
        return PluginNotFoundError(" ".join(parts))
