"""Kind ``weight_transport`` (``weight_update.mode`` through the
``areal_select_weight_transport`` hook; hook ``areal_register_weight_transports``).

Built once per run, in the controller, after the train engine and the
inference servers: ``Registry.build("weight_transport", name,
WeightTransportContext(...))`` calls ``Transport.from_context(context)``;
``WeightTransport.from_context`` calls ``Transport(train_engine,
inference_engine, run_dir, bucket_bytes)``, so a subclass writes that
constructor. Then:

- ``setup()`` once, before the first update;
- ``update(version) -> dict[str, float]`` after every optimizer step: returns
  when every server serves the train engine's current weights stamped
  ``version`` (interrupted generations resume on them), with metrics such as
  ``weights/pause_s``;
- ``name`` (attribute): reported to ``areal_on_weight_update`` observers;
- ``admit(addresses, version) -> dict[str, float]`` (optional): bring the
  servers at ``addresses`` (joined the fleet, or restarted, and held: no
  request reaches them) to the train engine's current weights, stamped
  ``version``, without pausing the others; the fleet
  (``areal_kernel.inference.fleet``) calls it from the trainer's thread
  between updates and then releases them. ``update`` must also cope with the
  fleet changing between calls (servers added, removed, restarted). A
  transport without ``admit`` runs only with a fixed fleet: ``areal fleet
  add`` and ``rollout.elastic`` are refused, naming it;
- ``close()`` once the transport is no longer used.

A transport may call the train engine's ``send_weights``,
``named_weights_for_transfer``, ``init_weight_group`` and ``adapter_spec``,
and the inference engine's members (``areal_kernel.api.engine.InferenceEngine``:
``pause``, ``resume``, ``update_weights``, ``set_version``,
``init_weight_group_async``, ...). It writes only under ``run_dir``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from areal_kernel.api.kinds import KindContract, from_context

if TYPE_CHECKING:
    from areal_kernel.api.engine import InferenceEngine, TrainEngine
    from areal_kernel.config.models import ExperimentConfig
    from areal_kernel.plugins.registry import FactorySpec

__all__ = ["WeightTransport", "WeightTransportProtocol", "WeightTransportContext", "KIND"]


@dataclass(frozen=True)
class WeightTransportContext:
    """What a weight transport is built with.

    - ``name``: the transport's registered name (what the hook chose).
    - ``train_engine``: the initialized ``TrainEngine`` whose weights travel.
    - ``inference_engine``: the client of the running servers.
    - ``run_dir``: the run directory, the only place a transport may write.
    - ``bucket_bytes``: ``weight_update.bucket_mb`` in bytes.
    - ``config``: the whole validated ``ExperimentConfig`` (``None`` outside a run).
    """

    name: str
    train_engine: "TrainEngine"
    inference_engine: "InferenceEngine"
    run_dir: str
    bucket_bytes: int = 256 << 20
    config: "ExperimentConfig | None" = None


@runtime_checkable
class WeightTransportProtocol(Protocol):
    """What the kernel calls on a built transport."""

    name: str

    def setup(self) -> None: ...

    def update(self, version: int) -> dict[str, float]: ...

    def close(self) -> None: ...


class WeightTransport(abc.ABC):
    """Base class of weight transports (the built-in ``disk`` and ``broadcast``)."""

    name: ClassVar[str] = "transport"

    @classmethod
    def from_context(cls, context: WeightTransportContext) -> "WeightTransport":
        """The factory the kernel calls; the default is
        ``cls(train_engine, inference_engine, run_dir, bucket_bytes)``."""
        return cls(context.train_engine, context.inference_engine, context.run_dir, context.bucket_bytes)  # type: ignore[call-arg]

    def setup(self) -> None:
        """Once, before the first update (join groups, make directories)."""

    @abc.abstractmethod
    def update(self, version: int) -> dict[str, float]:
        """Make every server serve the train engine's weights as ``version``."""

    def admit(self, addresses: list[str], version: int) -> dict[str, float]:
        """Bring the held servers at ``addresses`` to the current weights as
        ``version`` (see the module docstring). This default says the
        transport cannot: the fleet then refuses to grow."""
        raise NotImplementedError(f"weight transport {self.name!r} cannot bring a new server to the current weights")

    def close(self) -> None:
        """Release what ``setup`` made; called once."""


def _old_shape(target: Any, ctx: WeightTransportContext) -> Any:
    return target(ctx.train_engine, ctx.inference_engine, ctx.run_dir, ctx.bucket_bytes)


def _construct(target: Any, ctx: WeightTransportContext, spec: "FactorySpec") -> WeightTransportProtocol:
    return from_context(target, ctx, spec, _old_shape, "areal_kernel.api.weight_transport.WeightTransport")


KIND = KindContract(
    kind="weight_transport",
    context=WeightTransportContext,
    contract=WeightTransportProtocol,
    construct=_construct,
    contract_name="areal_kernel.api.weight_transport.WeightTransport",
    members=("name", "setup", "update"),
)
