"""Tool calls: parsers that find them in model output, and tools that answer them.

Parsers are registered through ``areal_register_tool_parsers`` (kind
``tool_parser``), tools through ``areal_register_tools`` (kind ``tool``); the
multi-turn workflow and the OpenAI-compatible proxy build them by name with
``build_tool_parser`` / ``ToolBox.build``.
"""

from areal_kernel.tools.runtime import (
    ToolBox,
    ToolResult,
    build_tool,
    build_tool_parser,
    tool_schema,
    turn_stop_reason,
)
from areal_kernel.tools.types import ParsedOutput, Tool, ToolCall, ToolCallParser

__all__ = [
    "ParsedOutput",
    "Tool",
    "ToolBox",
    "ToolCall",
    "ToolCallParser",
    "ToolResult",
    "build_tool",
    "build_tool_parser",
    "tool_schema",
    "turn_stop_reason",
]
