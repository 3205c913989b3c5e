"""Tool-call parsing and tools: the built-in ``hermes`` parser, ``calculator``
and ``python`` tools pass their contract suites; ``ToolBox`` turns every
failure of a call (unknown tool, bad JSON, a tool that raises or hangs) into
an error message and the caller goes on."""
from __future__ import annotations

import asyncio
import json

import pytest

from areal_kernel.testing import ToolContract, ToolParserContract
from areal_kernel.tools import ParsedOutput, ToolBox, ToolCall, ToolCallParser
from areal_kernel.tools.builtin_tools import evaluate_arithmetic
from areal_kernel.tools.hermes import HermesParser, split_reasoning

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'


class TestHermesParser(ToolParserContract):
    @pytest.fixture
    def tool_parser_name(self):
        return "hermes"

    @pytest.fixture
    def tool_parser_cases(self):
        return [
            ("The answer is 5.", []),
            (CALL, [("calculator", {"expression": "2 + 3"})]),
            ("<think>use the tool</think>Let me compute." + CALL + " trailing words",
             [("calculator", {"expression": "2 + 3"})]),
            ('<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
             '<tool_call>{"name": "calculator", "arguments": {"expression": "7*6"}}</tool_call>',
             [("python", {"code": "print(1)"}), ("calculator", {"expression": "7*6"})]),
            ('<tool_call>{"name": "noargs"}</tool_call>', [("noargs", {})]),
        ]  # fmt: skip

    @pytest.fixture
    def tool_parser_malformed(self):
        return [
            '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"</tool_call>',
            "<tool_call>calculator(2+3)</tool_call>",
            '<tool_call>{"arguments": {}}</tool_call>',
            '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>',
            '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}',
        ]


class TestCalculatorTool(ToolContract):
    @pytest.fixture
    def tool_name(self):
        return "calculator"

    @pytest.fixture
    def tool_cases(self):
        return [({"expression": "2 + 3"}, "5"), ({"expression": "(12 + 7) * 3"}, "57"), ({"expression": "7 / 2"}, "3.5"),
                ({"expression": "-2 ** 10"}, "-1024"), ({"expression": "10 / 4 * 2"}, "5")]  # fmt: skip

    @pytest.fixture
    def tool_bad_arguments(self):
        return [{"expression": "__import__('os').system('true')"}, {"expression": "1/0"}, {"expression": 3},
                {}, {"expression": "9 ** 9 ** 9"}, {"expression": "(2 ** 60) ** 60"}]  # fmt: skip


class TestPythonTool(ToolContract):
    @pytest.fixture
    def tool_name(self):
        return "python"

    @pytest.fixture
    def tool_settings(self):
        return {"timeout_s": 5.0, "max_output_chars": 200}

    @pytest.fixture
    def tool_cases(self):
        return [
            ({"code": "print(6 * 7)"}, "42"),
            ({"code": "import os\nprint(sorted(os.environ))"}, "['HOME', 'LANG', 'PATH']"),  # nothing inherited
            ({"code": "raise SystemExit(3)"}, "(exit code 3)"),
            ({"code": "print('x' * 5000)"}, "x" * 200),
        ]

    @pytest.fixture
    def tool_bad_arguments(self):
        return [{"code": 5}, {}]


def test_the_python_tool_is_stopped_at_its_sandbox_timeout():
    box = ToolBox.build(["python"], {"python": {"timeout_s": 1.0}}, timeout_s=30)
    res = asyncio.run(box.execute(ToolCall("c", "python", json.dumps({"code": "while True: pass"}))))
    assert res.ok and "longer than 1 s" in res.content, res


def test_calculator_never_runs_code():
    for expr in ("__import__('os')", "open('/etc/passwd')", "(1).__class__", "[1, 2]", "x + 1", "'a' * 3", "2 if 1 else 3"):
        with pytest.raises(ValueError, match="not allowed"):
            evaluate_arithmetic(expr)
    assert evaluate_arithmetic("3 // 2 + 5 % 3") == 3


class _Slow:
    description = "never answers"
    parameters = {"type": "object", "properties": {}}

    async def call(self, arguments):
        await asyncio.sleep(3600)


class _Broken:
    description = "raises"
    parameters = {"type": "object", "properties": {}}

    async def call(self, arguments):
        raise RuntimeError("disk on fire")


def test_failing_calls_become_error_messages_and_the_caller_goes_on():
    box = ToolBox({"slow": _Slow(), "broken": _Broken()}, timeout_s=0.2)
    calls = [
        ToolCall("a", "slow", "{}"),
        ToolCall("b", "broken", "{}"),
        ToolCall("c", "missing", "{}"),
        ToolCall("d", "broken", "{not json"),
        ToolCall("e", "broken", "[1]"),
    ]

    async def run():
        return await asyncio.gather(*(box.execute(c) for c in calls))

    slow, broken, missing, bad_json, not_object = asyncio.run(run())
    assert not any(r.ok for r in (slow, broken, missing, bad_json, not_object))
    assert "did not answer within 0.2 s" in slow.content
    assert "RuntimeError: disk on fire" in broken.content
    assert "no tool named 'missing'" in missing.content and "broken, slow" in missing.content
    assert "not valid JSON" in bad_json.content and "JSON object" in not_object.content


def test_reasoning_split():
    assert split_reasoning("<think>a</think>b") == ("a", "b")
    assert split_reasoning("a</think>b") == ("a", "b")  # the template opened the block in the prompt
    assert split_reasoning("x<think>cut off") == ("cut off", "x")
    assert split_reasoning("no tags") == (None, "no tags")
    out = HermesParser().parse("<think>2+3 needs a tool</think>" + CALL)
    assert isinstance(out, ParsedOutput) and out.reasoning == "2+3 needs a tool" and out.content == ""
    assert isinstance(HermesParser(), ToolCallParser)


def test_areal_plugins_lists_the_tools_the_parser_and_multi_turn(run_areal):
    proc = run_areal("plugins", "--json", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    registered = {r for p in json.loads(proc.stdout)["plugins"] for r in p.get("registers") or []}
    assert {"workflow:multi_turn", "tool_parser:hermes", "tool:calculator", "tool:python"} <= registered
