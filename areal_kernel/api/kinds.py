"""The 16 registry kinds as code: for each, the module of ``areal_kernel.api``
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

from areal_kernel.errors import ArealDeprecationWarning, ConfigError, PluginError
from areal_kernel.hookspecs import REGISTRATION_HOOKS

if TYPE_CHECKING:
    from areal_kernel.plugins.registry import FactorySpec


@dataclass(frozen=True)
class KindDoc:
    """One registry kind: the module of ``areal_kernel.api`` holding its
    contract, and its row of the table "Every kind in one place" in
    docs/plugin-authoring.md (a test compares the page with ``cells()``,
    cell for cell). Cells are markdown as the page shows them.

    - ``kind``: the registry kind (a key of ``hookspecs.REGISTRATION_HOOKS``).
    - ``module``: ``areal_kernel.api.<module>``, with the kind's context,
      contract and ``KIND`` (imported by ``kind_contract``, not here).
    - ``label``: what the docs call it; ``selected_by``: the config field or
      mechanism that picks a name; ``target``: what the registered target
      must be and how the kernel uses it; ``called_in``: the process;
      ``suite``: its contract suite, or ``"none (<why>)"``; a suite lives in
      ``areal_kernel.testing.contracts.<module>`` (the last part of
      ``module``: ``scheduler`` for ``areal_kernel.api.scheduler``) and is
      re-exported by ``areal_kernel.testing``.
    """

    kind: str
    module: str
    label: str
    selected_by: str
    target: str
    called_in: str
    suite: str

    @property
    def hook(self) -> str:
        return REGISTRATION_HOOKS[self.kind]

    def cells(self) -> list[str]:
        """The kind's row of the docs table."""
        suite = self.suite if self.suite.startswith("none") else f"`{self.suite}`"
        return [f"{self.label} (`{self.hook}`)", self.selected_by, self.target, self.called_in, suite]


# Every registry kind once, in the hooks' order: the one list the contract
# modules (KIND_MODULES), Registry.build and the docs table come from.
KIND_DOCS: tuple[KindDoc, ...] = (
    KindDoc(
        "train_engine",
        "areal_kernel.api.train_engine",
        "train engine",
        "`actor.backend`",
        "a `TrainEngine` subclass (`areal_kernel.api.train_engine`) built as `Engine.from_context(ctx)` (a "
        "`TrainEngineContext`: its validated `actor.<name>` section, the whole config, allocation, platform, run "
        "directory, scheduler; see [Train engines](#train-engines)), then `initialize`, `compute_logprobs`, "
        "`train_batch` (the loss contract of `areal_kernel.api.loss`), `save_hf`, `send_weights`",
        "controller (ranks: yours)",
        "TrainEngineContract",
    ),
    KindDoc(
        "inference_engine",
        "areal_kernel.api.inference_engine",
        "inference engine",
        "`rollout.backend`",
        "a backend (`areal_kernel.api.inference_engine`) built as `Backend.from_context(ctx)` (an "
        "`InferenceBackendContext`; the base class's default calls `Backend(config)`) with `place`, "
        "`launch(model_dir, device_plan, run_dir) -> addresses`, `make_client(addresses)` (an `InferenceEngine`) "
        "and `stop()`; see [Inference backends](#inference-backends)",
        "controller (servers: yours)",
        "InferenceEngineContract",
    ),
    KindDoc(
        "weight_transport",
        "areal_kernel.api.weight_transport",
        "weight transport",
        "`weight_update.mode`, via `areal_select_weight_transport`",
        "[Weight transports](#weight-transports)",
        "controller",
        "WeightTransportContract",
    ),
    KindDoc(
        "scheduler",
        "areal_kernel.api.scheduler",
        "scheduler",
        "`scheduler.type`",
        "[Schedulers](#schedulers)",
        "controller",
        "SchedulerContract",
    ),
    KindDoc(
        "platform",
        "areal_kernel.api.platform",
        "platform",
        "`AREAL_PLATFORM` or a probe",
        "a `Platform` subclass ([The `Platform` interface](#the-platform-interface))",
        "every process",
        "PlatformContract",
    ),
    KindDoc(
        "dataset",
        "areal_kernel.api.dataset",
        "dataset",
        "`dataset.type`",
        "[Datasets](#datasets)",
        "controller",
        "DatasetContract",
    ),
    KindDoc(
        "reward",
        "areal_kernel.api.reward",
        "reward",
        "`reward.type`",
        "[Rewards](#rewards)",
        "reward worker processes",
        "RewardContract",
    ),
    KindDoc(
        "workflow",
        "areal_kernel.api.workflow",
        "workflow",
        "`workflow.type`",
        "[Workflows](#workflows)",
        "controller (asyncio loop)",
        "WorkflowContract",
    ),
    KindDoc(
        "advantage_estimator",
        "areal_kernel.api.advantage_estimator",
        "advantage estimator",
        "`algorithm.advantage`",
        "[Advantage estimators and losses](#advantage-estimators-and-losses)",
        "controller",
        "AdvantageEstimatorContract",
    ),
    KindDoc(
        "loss",
        "areal_kernel.api.loss",
        "loss",
        "`algorithm.loss`",
        "[Advantage estimators and losses](#advantage-estimators-and-losses)",
        "wherever the train engine computes",
        "LossContract",
    ),
    KindDoc(
        "metric_sink",
        "areal_kernel.api.metric_sink",
        "metric sink",
        "`logging.sinks`",
        "[Metric sinks](#metric-sinks)",
        "controller",
        "MetricSinkContract",
    ),
    KindDoc(
        "model_source",
        "areal_kernel.api.model_source",
        "model source",
        "`model.path`",
        "`fn(variant: str \\| None) -> str`, a local HF directory (`areal_kernel.api.model_source`)",
        "controller",
        "none (a function of one string)",
    ),
    KindDoc(
        "trainer",
        "areal_kernel.api.trainer",
        "trainer",
        "`algorithm.type`",
        "a `Trainer` subclass (`areal_kernel.api.trainer`) built as `factory(context)` with a `TrainerContext`, "
        "then `setup()`, `train()`, `close(status)`; see [Trainers](#trainers)",
        "controller",
        "TrainerContract",
    ),
    KindDoc(
        "tool_parser",
        "areal_kernel.api.tool_parser",
        "tool-call parser",
        "`workflow.multi_turn.tool_parser` (and the proxy, by name)",
        "a zero-argument class satisfying `areal_kernel.tools.ToolCallParser`; see "
        "[Tools and tool-call parsers](#tools-and-tool-call-parsers)",
        "controller (asyncio loop)",
        "ToolParserContract",
    ),
    KindDoc(
        "tool",
        "areal_kernel.api.tool",
        "tool",
        "`workflow.multi_turn.tools`",
        "a class built as `Tool(**settings)` satisfying `areal_kernel.tools.Tool`; see "
        "[Tools and tool-call parsers](#tools-and-tool-call-parsers)",
        "controller (asyncio loop)",
        "ToolContract",
    ),
    KindDoc(
        "environment",
        "areal_kernel.api.environment",
        "environment",
        "a role's `python` setting (`rollout.vllm.python`), `areal env create`",
        "`fn(ctx: EnvironmentContext) -> EnvironmentSpec`: what a managed environment installs and what an "
        "interpreter must hold (`areal_kernel.api.environment`); see [Environments](#environments)",
        "controller",
        "none (a spec built from one context; `areal env check` probes it)",
    ),
)

# kind -> module under areal_kernel.api holding its contract (imported on first use)
KIND_MODULES: dict[str, str] = {d.kind: d.module for d in KIND_DOCS}

# Suites of a capability (suite -> (kind, capability)): what a registration
# that declares the capability passes besides its kind's suite. They live
# in their kind's suite module and are re-exported by areal_kernel.testing.
CAPABILITY_SUITES: dict[str, tuple[str, str]] = {
    "PolicyEngineContract": ("train_engine", "policies"),
    "JointPoliciesContract": ("train_engine", "joint_policies"),
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
        ArealDeprecationWarning,
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
