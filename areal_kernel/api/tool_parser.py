"""Kind ``tool_parser`` (``workflow.multi_turn.tool_parser``; hook ``areal_register_tool_parsers``).

The target is a class built with no arguments
(``Registry.build("tool_parser", name, ToolParserContext(name))``) whose
instances satisfy ``ToolCallParser``: ``stop_strings`` and
``parse(text) -> ParsedOutput``, which never raises on model output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from areal_kernel.api.kinds import KindContract
from areal_kernel.tools.types import ParsedOutput, ToolCall, ToolCallParser

if TYPE_CHECKING:
    from areal_kernel.plugins.registry import FactorySpec

__all__ = ["ToolCallParser", "ParsedOutput", "ToolCall", "ToolParserContext", "KIND"]


@dataclass(frozen=True)
class ToolParserContext:
    """What a tool-call parser is built with: nothing but its registered ``name``."""

    name: str


def _construct(target: Any, ctx: ToolParserContext, spec: "FactorySpec") -> ToolCallParser:
    return target()


KIND = KindContract(
    kind="tool_parser",
    context=ToolParserContext,
    contract=ToolCallParser,
    construct=_construct,
    contract_name="areal_kernel.tools.ToolCallParser",
    members=("stop_strings", "parse"),
)
