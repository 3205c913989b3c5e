"""Kind ``tool`` (``workflow.multi_turn.tools``; hook ``areal_register_tools``).

The target is a class built as ``Tool(**settings)``, ``settings`` being every
field of its validated ``config_model`` (nothing without one), through
``Registry.build("tool", name, ToolContext(name, settings))``. Its instances
satisfy ``Tool``: ``description``, ``parameters`` (a JSON schema, OpenAI
function format) and ``async call(arguments) -> str``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from areal_kernel.api.kinds import KindContract, settings_fields
from areal_kernel.tools.types import Tool

if TYPE_CHECKING:
    from areal_kernel.plugins.registry import FactorySpec

__all__ = ["Tool", "ToolContext", "KIND"]


@dataclass(frozen=True)
class ToolContext:
    """What a tool is built with.

    - ``name``: the registered name (the name the model calls it by).
    - ``settings``: its validated settings (an instance of its
      ``config_model``; ``None`` without one), passed as keywords.
    """

    name: str
    settings: Any = None


def _construct(target: Any, ctx: ToolContext, spec: "FactorySpec") -> Tool:
    return target(**settings_fields(ctx.settings))


KIND = KindContract(
    kind="tool",
    context=ToolContext,
    contract=Tool,
    construct=_construct,
    contract_name="areal_kernel.tools.Tool",
    members=("description", "parameters", "call"),
)
