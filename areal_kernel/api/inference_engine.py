"""Kind ``inference_engine`` (``rollout.backend``; hook ``areal_register_inference_engines``).

The target is an inference backend (``InferenceBackendProtocol``; subclass
``areal_kernel.inference.backend.InferenceBackend``), built once per run in
the controller: ``Registry.build("inference_engine", name,
InferenceBackendContext(...))`` calls ``Backend.from_context(context)``,
whose default is ``Backend(config)``. The kernel then calls, in order:

1. ``place(scheduler, placements)`` and ``launch(model_dir, device_plan,
   run_dir) -> list[str]`` (through the scheduler's ``start_inference``):
   start the servers and return their ``host:port`` addresses once healthy;
2. ``make_client(addresses)``: the ``InferenceEngine``
   (``areal_kernel.api.engine``) the rollout, the weight transports and the
   supervisor use; every member of that class is called by someone;
3. ``launcher`` (attribute): a ``SubprocessLauncher`` through which the
   supervisor restarts dead servers (``rollout.restart_servers``);
4. ``stop()`` when the run ends, whatever its status.

The full order of calls is the docstring of ``areal_kernel.inference.backend``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from areal_kernel.api.engine import InferenceEngine
from areal_kernel.api.kinds import KindContract, from_context

if TYPE_CHECKING:
    from areal_kernel.api.scheduler import Placement
    from areal_kernel.config.allocation import Allocation
    from areal_kernel.config.models import ExperimentConfig
    from areal_kernel.plugins.registry import FactorySpec

__all__ = ["InferenceEngine", "InferenceBackendProtocol", "InferenceBackendContext", "KIND"]


@dataclass(frozen=True)
class InferenceBackendContext:
    """What an inference backend is built with.

    - ``name``: the selected backend (``rollout.backend``'s name).
    - ``config``: the whole validated ``ExperimentConfig``.
    - ``settings``: its validated ``rollout.<name>`` section
      (``config.rollout.plugin_config``; ``None`` without a ``config_model``).
    - ``allocation``: the parsed ``rollout.backend`` (``vllm:d2t1``).
    """

    name: str
    config: "ExperimentConfig"
    settings: Any = None
    allocation: "Allocation | None" = None

    @classmethod
    def for_config(cls, config: "ExperimentConfig") -> "InferenceBackendContext":
        """The context the kernel builds for ``config``'s ``rollout.backend``."""
        alloc = config.rollout.allocation
        return cls(name=alloc.backend, config=config, settings=config.rollout.plugin_config, allocation=alloc)


@runtime_checkable
class InferenceBackendProtocol(Protocol):
    """What the kernel calls or reads on a built inference backend."""

    launcher: Any

    def place(self, scheduler: Any, placements: "list[Placement]") -> None: ...

    def launch(self, model_dir: str, device_plan: list[list[int]], run_dir: str) -> list[str]: ...

    def make_client(self, addresses: list[str]) -> InferenceEngine: ...

    def stop(self) -> None: ...


def _old_shape(target: Any, ctx: InferenceBackendContext) -> Any:
    return target(ctx.config)


def _construct(target: Any, ctx: InferenceBackendContext, spec: "FactorySpec") -> InferenceBackendProtocol:
    return from_context(target, ctx, spec, _old_shape, "areal_kernel.inference.backend.InferenceBackend")


KIND = KindContract(
    kind="inference_engine",
    context=InferenceBackendContext,
    contract=InferenceBackendProtocol,
    construct=_construct,
    contract_name="areal_kernel.inference.backend.InferenceBackend",
    members=("place", "launch", "make_client", "stop"),
)
