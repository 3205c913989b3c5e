"""Kind ``metric_sink`` (``logging.sinks``; hook ``areal_register_metric_sinks``).

The kernel builds each sink named in ``logging.sinks``, in that order, once
per ``areal train`` process, in the controller, after ``<run_dir>/config.yaml``
is written and before any server starts:
``Registry.build("metric_sink", name, MetricSinkContext(...))``, which calls
``Sink.from_context(context)``. ``MetricSink.from_context`` calls
``Sink(run_dir, total_steps=total_steps, **settings)`` (every field of the
validated ``logging.<name>`` section), so a subclass writes that constructor.

Then, in the same process and thread: ``log(step, metrics)`` once per
training step and once per evaluation (a step may arrive twice, also after a
resume), and ``close()`` once when the run ends, whatever its status. See
docs/plugin-authoring.md, "Metric sinks".
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from areal_kernel.api.kinds import KindContract, from_context, settings_fields

if TYPE_CHECKING:
    from areal_kernel.config.models import ExperimentConfig
    from areal_kernel.plugins.registry import FactorySpec

__all__ = ["MetricSink", "MetricSinkProtocol", "MetricSinkContext", "KIND"]


@dataclass(frozen=True)
class MetricSinkContext:
    """What a metric sink is built with.

    - ``name``: the sink's name in ``logging.sinks``.
    - ``run_dir``: the run directory (it exists).
    - ``total_steps``: the number of training steps the run will take.
    - ``settings``: its validated ``logging.<name>`` section (an instance of
      its ``config_model``; ``None`` without one).
    - ``config``: the whole validated ``ExperimentConfig`` (``None`` when a
      sink is built outside a run).
    """

    name: str
    run_dir: str
    total_steps: int | None = None
    settings: Any = None
    config: "ExperimentConfig | None" = None


@runtime_checkable
class MetricSinkProtocol(Protocol):
    """What the kernel calls on a built sink."""

    def log(self, step: int, metrics: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class MetricSink(abc.ABC):
    """Base class of metric sinks (the built-in ``console``, ``jsonl``,
    ``tensorboard`` and ``wandb`` are subclasses)."""

    @classmethod
    def from_context(cls, context: MetricSinkContext) -> "MetricSink":
        """The factory the kernel calls; the default is
        ``cls(run_dir, total_steps=..., **settings)``."""
        return cls(context.run_dir, total_steps=context.total_steps, **settings_fields(context.settings))  # type: ignore[call-arg]

    @abc.abstractmethod
    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """The metrics of ``step`` (values mostly floats; skip what is not a number)."""

    def close(self) -> None:
        """Flush and release files; called once when the run ends."""


def _old_shape(target: Any, ctx: MetricSinkContext) -> Any:
    return target(ctx.run_dir, total_steps=ctx.total_steps, **settings_fields(ctx.settings))


def _construct(target: Any, ctx: MetricSinkContext, spec: "FactorySpec") -> MetricSinkProtocol:
    return from_context(target, ctx, spec, _old_shape, "areal_kernel.api.metric_sink.MetricSink")


KIND = KindContract(
    kind="metric_sink",
    context=MetricSinkContext,
    contract=MetricSinkProtocol,
    construct=_construct,
    contract_name="areal_kernel.api.metric_sink.MetricSink",
    members=("log", "close"),
)
