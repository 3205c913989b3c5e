"""The ``hermes`` tool-call parser and the ``<think>`` reasoning split.

Format (Hermes, Qwen2.5/3 and many others)::

    <think>optional reasoning</think>
    Some text.
    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2 + 3"}}
    </tool_call>

Every ``<tool_call>`` block holds one JSON object with a string ``name`` and
an ``arguments`` object (a JSON string holding an object is accepted too).
A block that is not such an object, or one left open at the end of the
text, becomes an entry of ``ParsedOutput.errors``; parsing never raises.
"""

from __future__ import annotations

import json
import re
from typing import Any

from areal_kernel.tools.types import ParsedOutput, ToolCall

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)


def split_reasoning(text: str, open_tag: str = THINK_OPEN, close_tag: str = THINK_CLOSE) -> tuple[str | None, str]:
    """``(reasoning, rest)`` of one model turn.

    ``<think>r</think>rest`` gives ``("r", "rest")``; a closing tag without an
    opening one (templates that open the block in the prompt) makes all text
    before it the reasoning; a block left open (generation cut off) makes the
    rest of the text reasoning and no content. No tag: ``(None, text)``.
    """
    close = text.find(close_tag)
    start = text.find(open_tag)
    if close < 0:
        if start < 0:
            return None, text
        return text[start + len(open_tag) :].strip(), text[:start].strip()
    if 0 <= start < close:
        return text[start + len(open_tag) : close].strip(), (text[:start] + text[close + len(close_tag) :]).strip()
    return text[:close].strip(), text[close + len(close_tag) :].strip()


def _decode_call(body: str, index: int) -> tuple[ToolCall | None, str | None]:
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError as e:
        return (
            None,
            f"tool call {index}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}): {body.strip()[:200]!r}",
        )
    if not isinstance(obj, dict):
        return None, f"tool call {index}: expected a JSON object with 'name' and 'arguments', got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None, f"tool call {index}: 'name' must be a non-empty string, got {name!r}"
    args: Any = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return None, f"tool call {index} ({name}): 'arguments' is a string that is not valid JSON ({e.msg})"
    if not isinstance(args, dict):
        return None, f"tool call {index} ({name}): 'arguments' must be a JSON object, got {type(args).__name__}"
    return ToolCall(id=f"call_{index}", name=name, arguments=json.dumps(args, ensure_ascii=False)), None


class HermesParser:
    """``<tool_call>{json}</tool_call>`` blocks, with ``<think>`` reasoning split off."""

    stop_strings: tuple[str, ...] = (CALL_CLOSE,)

    def parse(self, text: str) -> ParsedOutput:
        reasoning, rest = split_reasoning(text)
        calls: list[ToolCall] = []
        errors: list[str] = []
        index = 0
        for m in _CALL.finditer(rest):
            call, err = _decode_call(m.group(1), index)
            index += 1
            if call is not None:
                calls.append(call)
            if err is not None:
                errors.append(err)
        content = _CALL.sub("", rest)
        tail_open = content.find(CALL_OPEN)
        if tail_open >= 0:
            errors.append(f"tool call {index}: '{CALL_OPEN}' is never closed with '{CALL_CLOSE}'")
            content = content[:tail_open]
        return ParsedOutput(content=content.strip(), tool_calls=tuple(calls), reasoning=reasoning, errors=tuple(errors))
