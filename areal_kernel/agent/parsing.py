"""Which tool-call parser the proxy applies to a model's answer.

``resolve_tool_parser(name)`` is the one place that decides: a parser
registered under the registry kind ``tool_parser`` wins; while no plugin
provides that kind, the proxy falls back to ``HermesToolParser`` below (the
common ``<tool_call>{json}</tool_call>`` format) for the name ``hermes``.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from areal_kernel.errors import ConfigError
from areal_kernel.tools.types import ParsedOutput, ToolCall, ToolCallParser

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class HermesToolParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks.

    The text outside the blocks is the content; a block whose JSON is
    malformed, or that lacks a string ``name``, is not a call and is named in
    ``errors`` (its text stays in the content, so nothing the model wrote is
    lost). An opening tag without its closing tag (the answer was cut off) is
    an error too."""

    stop_strings: tuple[str, ...] = ("</tool_call>",)

    def parse(self, text: str) -> ParsedOutput:
        calls: list[ToolCall] = []
        errors: list[str] = []
        content: list[str] = []
        pos = 0
        for m in _BLOCK.finditer(text):
            content.append(text[pos : m.start()])
            pos = m.end()
            call, err = _call_from_json(m.group(1))
            if call is None:
                errors.append(f"tool call {len(calls) + len(errors)}: {err}")
                content.append(m.group(0))
            else:
                calls.append(call)
        rest = text[pos:]
        if "<tool_call>" in rest:
            errors.append(f"tool call {len(calls) + len(errors)}: '<tool_call>' without '</tool_call>'")
        content.append(rest)
        return ParsedOutput(content="".join(content).strip(), tool_calls=tuple(calls), errors=tuple(errors))


def _call_from_json(body: str) -> tuple[ToolCall | None, str]:
    try:
        obj: Any = json.loads(body)
    except json.JSONDecodeError as e:
        return None, f"not JSON ({e.msg} at position {e.pos})"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None, 'expected an object with a string "name"'
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except json.JSONDecodeError:
            return None, '"arguments" is a string that is not JSON'
        text = args
    elif isinstance(args, dict):
        text = json.dumps(args, ensure_ascii=False)
    else:
        return None, '"arguments" must be an object'
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=obj["name"], arguments=text), ""


_FALLBACKS: dict[str, type] = {"hermes": HermesToolParser}


def resolve_tool_parser(name: str) -> ToolCallParser:
    """The parser registered as ``name`` (kind ``tool_parser``), or the
    built-in fallback of that name while no plugin registers the kind."""
    from areal_kernel.plugins import get_registry
    from areal_kernel.plugins.registry import KINDS

    reg = get_registry()
    if "tool_parser" in KINDS and (reg.find("tool_parser", name) is not None or name not in _FALLBACKS):
        target = reg.get("tool_parser", name, platform="").load()
        parser = target() if isinstance(target, type) else target
    elif name in _FALLBACKS:
        parser = _FALLBACKS[name]()
    else:
        raise ConfigError(f"proxy.tool_parser: unknown tool-call parser {name!r}; known: {sorted(_FALLBACKS)}")
    if not isinstance(parser, ToolCallParser):
        raise ConfigError(f"proxy.tool_parser: {name!r} gives {type(parser).__name__}, not a ToolCallParser")
    return parser
