"""Types shared by tool-call parsers, the multi-turn workflow and the
OpenAI-compatible proxy. Importable without torch.

A parser turns the text of one model turn into content, reasoning and tool
calls. It never raises on model output: a model in training writes malformed
calls all the time, and that is a fact about the sample (the reward can see
it in ``errors``), not a failure of the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


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
