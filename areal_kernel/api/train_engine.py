"""Kind ``train_engine`` (``actor.backend``; hook ``areal_register_train_engines``).

The target is a ``TrainEngine`` subclass; the kernel builds it in the
controller as ``Engine.from_context(TrainEngineContext(...))``
(``Registry.build("train_engine", name, ctx)``), then calls the members of
``TrainEngine`` documented in ``areal_kernel.api.engine``. The loss an engine
hands its micro-batches to follows ``areal_kernel.api.loss``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from areal_kernel.api.engine import TrainEngine, TrainEngineContext
from areal_kernel.api.kinds import KindContract, PluginContractError, origin

if TYPE_CHECKING:
    from areal_kernel.plugins.registry import FactorySpec

__all__ = ["TrainEngine", "TrainEngineContext", "KIND"]


def _construct(target: Any, ctx: TrainEngineContext, spec: "FactorySpec") -> TrainEngine:
    # Checked before the call: from_context is the base class's, so a target
    # that is not a subclass has no agreed way to be built at all.
    if not (isinstance(target, type) and issubclass(target, TrainEngine)):
        raise PluginContractError(
            f"actor.backend: {origin(spec)} registered {spec.target}, which is not a subclass of "
            "areal_kernel.api.engine.TrainEngine; the kernel builds train engines with Engine.from_context(context)"
        )
    return target.from_context(ctx)


KIND = KindContract(
    kind="train_engine",
    context=TrainEngineContext,
    contract=TrainEngine,
    construct=_construct,
    contract_name="areal_kernel.api.engine.TrainEngine",
    check=lambda obj: [] if isinstance(obj, TrainEngine) else ["the TrainEngine base class"],
)
