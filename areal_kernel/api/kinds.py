"""The 15 registry kinds as code: for each, the module of ``areal_kernel.api``
that holds its contract, and how ``Registry.build`` turns a registered target
into a checked object.

Each kind module (``areal_kernel.api.<module>``) defines a frozen context
class (what the kind's factory receives), the contract the built object
satisfies (a base class or a runtime-checkable ``Protocol``), and ``KIND``, a
``KindContract`` saying how the kernel calls the target with a context and
which members it checks afterwards. ``Registry.build(kind, name, ctx)`` is the
one construction path of the kernel; a plugin whose object falls short is
named at build time, before the run uses it.

Nothing here imports torch, pydantic models of the config, or a kind module
before it is asked for.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from areal_kernel.errors import ConfigError, PluginError

if TYPE_CHECKING:
    from areal_kernel.plugins.registry import FactorySpec

# kind -> module under areal_kernel.api holding its contract (imported on first use)
KIND_MODULES: dict[str, str] = {
    "train_engine": "areal_kernel.api.train_engine",
    "inference_engine": "areal_kernel.api.inference_engine",
    "weight_transport": "areal_kernel.api.weight_transport",
    "scheduler": "areal_kernel.api.scheduler",
    "platform": "areal_kernel.api.platform",
    "dataset": "areal_kernel.api.dataset",
    "reward": "areal_kernel.api.reward",
    "workflow": "areal_kernel.api.workflow",
    "advantage_estimator": "areal_kernel.api.advantage_estimator",
    "loss": "areal_kernel.api.loss",
    "metric_sink": "areal_kernel.api.metric_sink",
    "model_source": "areal_kernel.api.model_source",
    "trainer": "areal_kernel.api.trainer",
    "tool_parser": "areal_kernel.api.tool_parser",
    "tool": "areal_kernel.api.tool",
}


class PluginContractError(PluginError, ConfigError):
    """A registered target built an object that does not satisfy its kind's
    contract (a missing member, the wrong type). The message names the kind,
    the registered name, the plugin and what is missing. A ``ConfigError``
    too, so that callers that caught the earlier per-kind errors still do."""


@dataclass(frozen=True)
class KindContract:
    """How the kernel builds one kind.

    - ``kind``: the registry kind (``"workflow"``).
    - ``context``: the frozen class the factory receives.
    - ``contract``: the base class or runtime-checkable ``Protocol`` the
      built object satisfies (the type ``Registry.build`` returns).
    - ``members``: the names the kernel calls or reads on the built object,
      checked by name (``hasattr``, as a runtime-checkable Protocol does).
    - ``construct(target, ctx, spec)``: calls the registered target.
    - ``callable_result``: the built object is itself called (functions:
      estimators, losses); checked with ``callable``.
    - ``check``: replaces the two checks above when given (a kind whose
      object is checked otherwise, e.g. ``isinstance`` of a base class).
    - ``contract_name``: where an author reads the contract (for messages).
    """

    kind: str
    context: type
    contract: Any
    construct: Callable[[Any, Any, "FactorySpec"], Any]
    contract_name: str
    members: tuple[str, ...] = ()
    callable_result: bool = False
    check: Callable[[Any], list[str]] | None = field(default=None)

    def shortfalls(self, obj: Any) -> list[str]:
        """What ``obj`` lacks under this contract (empty: it satisfies it)."""
        if self.check is not None:
            return self.check(obj)
        missing = [m for m in self.members if not _has_member(obj, m)]
        if self.callable_result and not callable(obj):
            missing.insert(0, "__call__")
        return missing


def _has_member(obj: Any, name: str) -> bool:
    # hasattr, as isinstance() with a runtime-checkable Protocol does.
    return hasattr(obj, name)


def kind_contract(kind: str) -> KindContract:
    """The ``KindContract`` of ``kind`` (its module imported now)."""
    module = KIND_MODULES.get(kind)
    if module is None:
        raise ValueError(f"unknown registry kind {kind!r}; valid: {', '.join(KIND_MODULES)}")
    contract = importlib.import_module(module).KIND
    assert isinstance(contract, KindContract) and contract.kind == kind, module
    return contract


def origin(spec: "FactorySpec") -> str:
    return f"{spec.kind} '{spec.name}' (plugin '{spec.plugin}')"


def shortfall_error(
    spec: "FactorySpec", obj: Any, missing: list[str], contract_name: str, where: str = ""
) -> PluginContractError:
    what = "is not callable" if missing == ["__call__"] else f"lacks {', '.join(missing)}"
    prefix = f"{where}: " if where else ""
    return PluginContractError(f"{prefix}{origin(spec)} built {_describe(obj)}, which {what}; see {contract_name}")


def _describe(obj: Any) -> str:
    if isinstance(obj, type) or inspect.isfunction(obj):
        return getattr(obj, "__qualname__", repr(obj))
    return f"a {type(obj).__name__}"


def from_context(target: Any, ctx: Any, spec: "FactorySpec", old_shape: Callable[[Any, Any], Any], base: str) -> Any:
    """``target.from_context(ctx)``, the kind's construction shape; a class
    without it (written for the shape before ``from_context``) is built the
    old way, with a ``DeprecationWarning`` naming the new shape. The old
    shape keeps working for one minor release (docs/api.md, Deprecation
    period)."""
    factory = getattr(target, "from_context", None)
    if callable(factory):
        return factory(ctx)
    warnings.warn(
        f"{origin(spec)}: {spec.target} has no from_context(context); building it the old way is "
        f"deprecated and stops working in the next minor release: subclass {base} (whose from_context "
        "calls the old constructor) or define from_context",
        DeprecationWarning,
        # from_context <- the kind's construct <- Registry.build <- whoever built it.
        stacklevel=4,
    )
    return old_shape(target, ctx)


def settings_fields(settings: Any) -> dict[str, Any]:
    """Validated settings as keyword arguments: every field, defaults
    included, values as validated (``config.sections.settings_kwargs``
    without importing the config layer); a plain mapping as it is; ``None``
    gives none."""
    if settings is None:
        return {}
    fields = getattr(type(settings), "model_fields", None)
    if fields is not None:
        return {k: getattr(settings, k) for k in fields}
    return dict(settings)
