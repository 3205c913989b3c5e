"""Types shared by tool-call parsers, the multi-turn workflow and the
OpenAI-compatible proxy. Importable without torch.

A parser turns the text of one model turn into content, reasoning and tool
calls. It never raises on model output: a model in training writes malformed
calls all the time, and that is a fact about the sample (the reward can see
it in ``errors``), not a failure of the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


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
