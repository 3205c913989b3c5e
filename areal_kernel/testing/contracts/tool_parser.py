"""``ToolParserContract``: the suite for tool-call parsers (kind
``tool_parser``, ``areal_kernel.api.tool_parser``)."""

from __future__ import annotations

import json
from typing import Any

import pytest


# Model output a parser must survive without raising (garbage, truncation, nesting).
_HOSTILE_OUTPUTS = [
    "",
    "plain answer: 42",
    "\x00\ufffd\U0001f600 \u202e",
    "{" * 200 + "}" * 3,
    "<tool_call>",
    "</tool_call>",
    '<tool_call>{"name": "x", "arguments": {"a": 1}',
    "<tool_call>null</tool_call>",
    "<tool_call>[1, 2]</tool_call>",
    '<tool_call>{"name": 7}</tool_call>',
    '<tool_call>{"name": "x", "arguments": "{oops"}</tool_call>',
    "<think>unfinished reasoning",
    "</think></think><think>",
    '```json\n{"name": "x"}\n```',
]


class ToolParserContract:
    """Fixtures: ``tool_parser_name`` (the registered parser) and
    ``tool_parser_cases`` (a list of ``(text, calls)`` where ``calls`` is the
    list of ``(name, arguments_dict)`` the parser must find, in order).
    Optional: ``tool_parser_malformed`` (texts holding a malformed call that
    must yield an entry of ``errors``; default ``[]``)."""

    @pytest.fixture
    def tool_parser_malformed(self) -> list[str]:
        return []

    @staticmethod
    def _parser(name: str) -> Any:
        from areal_kernel.tools import ToolCallParser, build_tool_parser

        parser = build_tool_parser(name)
        assert isinstance(parser, ToolCallParser)
        return parser

    @staticmethod
    def _check_output(out: Any) -> None:
        from areal_kernel.tools import ParsedOutput, ToolCall

        assert isinstance(out, ParsedOutput), f"parse returned {type(out).__name__}, not ParsedOutput"
        assert isinstance(out.content, str) and (out.reasoning is None or isinstance(out.reasoning, str))
        assert isinstance(out.tool_calls, tuple) and isinstance(out.errors, tuple)
        assert all(isinstance(e, str) and e for e in out.errors), out.errors
        ids = [c.id for c in out.tool_calls]
        assert len(set(ids)) == len(ids), f"tool call ids repeat within one output: {ids}"
        for c in out.tool_calls:
            assert isinstance(c, ToolCall) and c.id and c.name, c
            assert isinstance(json.loads(c.arguments), dict), f"arguments of {c.name} are not a JSON object: {c}"

    def test_stop_strings_are_non_empty_strings(self, tool_parser_name: str) -> None:
        stops = self._parser(tool_parser_name).stop_strings
        assert isinstance(stops, tuple) and all(isinstance(s, str) and s for s in stops), stops

    def test_finds_the_calls(self, tool_parser_name: str, tool_parser_cases: list) -> None:
        parser = self._parser(tool_parser_name)
        assert any(calls for _, calls in tool_parser_cases), "give at least one case that holds a call"
        for text, calls in tool_parser_cases:
            out = parser.parse(text)
            self._check_output(out)
            got = [(c.name, json.loads(c.arguments)) for c in out.tool_calls]
            assert got == [(n, a) for n, a in calls], (text, got)
            assert not out.errors, (text, out.errors)

    def test_generation_stopped_at_a_stop_string_holds_the_call(
        self, tool_parser_name: str, tool_parser_cases: list
    ) -> None:
        """Generation ends right after the first stop string: the text up to
        there must already hold the first call."""
        parser = self._parser(tool_parser_name)
        for text, calls in tool_parser_cases:
            if not calls:
                continue
            ends = [text.find(s) + len(s) for s in parser.stop_strings if s in text]
            assert ends, f"no stop string of {parser.stop_strings} in a text holding a call: {text!r}"
            out = parser.parse(text[: min(ends)])
            self._check_output(out)
            assert out.tool_calls and (out.tool_calls[0].name, json.loads(out.tool_calls[0].arguments)) == (
                calls[0][0],
                calls[0][1],
            ), (text[: min(ends)], out)

    def test_malformed_calls_are_errors_not_exceptions(
        self, tool_parser_name: str, tool_parser_malformed: list[str]
    ) -> None:
        parser = self._parser(tool_parser_name)
        for text in _HOSTILE_OUTPUTS + list(tool_parser_malformed):
            self._check_output(parser.parse(text))
        for text in tool_parser_malformed:
            assert parser.parse(text).errors, f"a malformed call gave no error: {text!r}"
