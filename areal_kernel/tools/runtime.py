"""Building registered parsers and tools by name, and running tool calls.

``ToolBox.execute`` never raises for what a model did: an unknown tool,
arguments that are not a JSON object, a tool that raises or one that runs
past its timeout each give a ``ToolResult`` with ``ok=False`` whose
``content`` says what went wrong, to be fed back to the model.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from areal_kernel.api.io import ModelResponse, StopReason
from areal_kernel.errors import ConfigError
from areal_kernel.tools.types import Tool, ToolCall, ToolCallParser


def build_tool_parser(name: str, where: str = "tool_parser") -> ToolCallParser:
    """The registered tool-call parser ``name``, built with no arguments
    (``Registry.build("tool_parser", name, ToolParserContext(name))``)."""
    from areal_kernel.api.tool_parser import ToolParserContext
    from areal_kernel.plugins import get_registry

    return get_registry().build("tool_parser", name, ToolParserContext(name), platform="", where=where)


def build_tool(name: str, settings: Any = None, where: str = "tools") -> Tool:
    """The registered tool ``name``, built as ``Tool(**settings)`` with its
    settings validated against the tool's ``config_model``
    (``Registry.build("tool", name, ToolContext(name, validated))``)."""
    from areal_kernel.api.tool import ToolContext
    from areal_kernel.config.sections import validate_settings
    from areal_kernel.plugins import get_registry

    reg = get_registry()
    try:
        spec = reg.get("tool", name, platform="")
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"{where}: {e}") from None
    validated = validate_settings(f"{where}.{name}", "tool", name, settings, spec=spec)
    return reg.build("tool", name, ToolContext(name, validated), platform="", where=where)


def tool_schema(name: str, tool: Tool) -> dict[str, Any]:
    """The OpenAI ``tools`` entry of ``tool`` (what chat templates render)."""
    return {
        "type": "function",
        "function": {"name": name, "description": tool.description, "parameters": tool.parameters},
    }


def turn_stop_reason(resp: ModelResponse, parser: ToolCallParser | None) -> StopReason:
    """``TOOL_CALL`` when the response ended on one of ``parser``'s stop
    strings (a complete call), else the response's own stop reason."""
    if parser is not None and resp.matched_stop is not None and resp.matched_stop in parser.stop_strings:
        return StopReason.TOOL_CALL
    return resp.stop_reason


@dataclass(frozen=True)
class ToolResult:
    """What one call returned (``ok``), or why it failed, as text for the model."""

    call: ToolCall
    content: str
    ok: bool


class ToolBox:
    """The tools of a run by name, with the per-call timeout."""

    def __init__(self, tools: Mapping[str, Tool], timeout_s: float = 10.0) -> None:
        self.tools = dict(tools)
        self.timeout_s = timeout_s

    @classmethod
    def build(
        cls,
        names: Sequence[str],
        settings: Mapping[str, Any] | None = None,
        timeout_s: float = 10.0,
        where: str = "tools",
    ) -> "ToolBox":
        settings = settings or {}
        return cls({n: build_tool(n, settings.get(n), where) for n in names}, timeout_s)

    def schemas(self) -> list[dict[str, Any]]:
        return [tool_schema(n, t) for n, t in self.tools.items()]

    async def execute(self, call: ToolCall) -> ToolResult:
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return ToolResult(call, f"error: there is no tool named '{call.name}' (tools: {known})", False)
        try:
            args = json.loads(call.arguments) if call.arguments.strip() else {}
        except json.JSONDecodeError as e:
            return ToolResult(call, f"error: the arguments of '{call.name}' are not valid JSON ({e.msg})", False)
        if not isinstance(args, dict):
            return ToolResult(call, f"error: the arguments of '{call.name}' must be a JSON object", False)
        try:
            out = await asyncio.wait_for(tool.call(args), timeout=self.timeout_s)
        except asyncio.TimeoutError:
            return ToolResult(call, f"error: tool '{call.name}' did not answer within {self.timeout_s:g} s", False)
        except Exception as e:
            return ToolResult(call, f"error: tool '{call.name}' failed: {type(e).__name__}: {e}", False)
        return ToolResult(call, out if isinstance(out, str) else str(out), True)
