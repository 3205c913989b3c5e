"""Kind ``model_source`` (a name in ``model.path``; hook ``areal_register_model_sources``).

The target is a function ``fn(variant: str | None) -> str`` (``ModelSource``)
returning a local HF directory; ``model.path: name@variant`` passes
``variant`` (``None`` without one). Called in the controller while
``model.path`` is resolved, before anything starts.

``Registry.build("model_source", name, ModelSourceContext(name, variant))``
calls it and returns the directory, checked to be a non-empty string.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from areal_kernel.api.kinds import KindContract, PluginContractError, origin

if TYPE_CHECKING:
    from areal_kernel.plugins.registry import FactorySpec

__all__ = ["ModelSource", "ModelSourceContext", "KIND"]


@runtime_checkable
class ModelSource(Protocol):
    """The type of a registered model source."""

    def __call__(self, variant: str | None) -> str: ...


@dataclass(frozen=True)
class ModelSourceContext:
    """The model name (``name``) and the part of ``model.path`` after ``@`` (``variant``)."""

    name: str
    variant: str | None = None


def _construct(target: Any, ctx: ModelSourceContext, spec: "FactorySpec") -> str:
    if not callable(target):
        raise PluginContractError(f"{origin(spec)} registered {spec.target}, which is not callable; see {__name__}")
    path = target(ctx.variant)
    if not isinstance(path, str) or not path:
        raise PluginContractError(
            f"{origin(spec)} returned {type(path).__name__} {path!r} for variant {ctx.variant!r}; a model "
            "source returns the path of a local HF directory"
        )
    return path


KIND = KindContract(
    kind="model_source",
    context=ModelSourceContext,
    contract=ModelSource,
    construct=_construct,
    contract_name="areal_kernel.api.model_source.ModelSource",
    check=lambda obj: [],  # _construct checked the result
)
