"""Kind ``tool_parser`` (``workflow.multi_turn.tool_parser``; hook ``areal_register_tool_parsers``).

The target is a class built with no arguments
(``Registry.build("tool_parser", name, ToolParserContext(name))``) whose
instances satisfy ``ToolCallParser``: ``stop_strings`` and
``parse(text) -> ParsedOutput``, which never raises on model output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from areal_kernel.api.kinds import KindContract

if TYPE_CHECKING:
    from areal_kernel.plugins.registry import FactorySpec

__all__ = ["ToolCallParser", "ParsedOutput", "ToolCall", "ToolParserContext", "KIND"]

# A parser never raises on model output: a model in training writes malformed
# calls all the time, and that is a fact about the sample (the reward can see
# it in ``errors``), not a failure of the run.


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for.

    ``arguments`` stays the JSON text the model wrote, as the OpenAI wire
    format carries it; callers that execute the tool decode it.
    """

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedOutput:
    """One model turn split into its parts."""

    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: str | None = None
    # One line per malformed call or block, saying what was wrong with it.
    errors: tuple[str, ...] = ()


@runtime_checkable
class ToolCallParser(Protocol):
    """What a registered tool-call parser provides."""

    # Strings after which generation should stop because a call is complete
    # (the turn then ends with ``stop_reason=tool_call``).
    stop_strings: tuple[str, ...]

    def parse(self, text: str) -> ParsedOutput: ...


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
