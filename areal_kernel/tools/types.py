"""Types shared by tool-call parsers, the multi-turn workflow and the
OpenAI-compatible proxy. Importable without torch.

A parser turns the text of one model turn into content, reasoning and tool
calls. It never raises on model output: a model in training writes malformed
calls all the time, and that is a fact about the sample (the reward can see
it in ``errors``), not a failure of the run.
"""

from __future__ import annotations

# Defined with their kinds' contracts (areal_kernel.api.tool_parser and
# areal_kernel.api.tool); importable here as before.
from areal_kernel.api.tool import Tool
from areal_kernel.api.tool_parser import ParsedOutput, ToolCall, ToolCallParser

__all__ = ["Tool", "ToolCall", "ParsedOutput", "ToolCallParser"]
