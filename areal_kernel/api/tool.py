"""Kind ``tool`` (``workflow.multi_turn.tools``; hook ``areal_register_tools``).

The target is a class built as ``Tool(**settings)``, ``settings`` being every
field of its validated ``config_model`` (nothing without one), through
``Registry.build("tool", name, ToolContext(name, settings))``. Its instances
satisfy ``Tool``: ``description``, ``parameters`` (a JSON schema, OpenAI
function format) and ``async call(arguments) -> str``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from areal_kernel.api.kinds import KindContract, settings_fields

if TYPE_CHECKING:
    from areal_kernel.plugins.registry import FactorySpec

__all__ = ["Tool", "ToolContext", "KIND"]


@runtime_checkable
class Tool(Protocol):
    """What a registered tool provides (built as ``Tool(**settings)``).

    The registered name is the tool's name. ``parameters`` is the JSON schema
    of the arguments object (OpenAI function format: ``{"type": "object",
    "properties": {...}, "required": [...]}``). ``call`` receives the decoded
    arguments and returns the text fed back to the model; it must not block
    the event loop (run blocking work with ``asyncio.to_thread``). Raising is
    allowed: the caller turns the exception into an error message for the
    model, as it does for a call that runs past its timeout.
    """

    description: str
    parameters: dict[str, Any]

    async def call(self, arguments: dict[str, Any]) -> str: ...


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
