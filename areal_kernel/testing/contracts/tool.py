"""``ToolContract``: the suite for tools (kind ``tool``,
``areal_kernel.api.tool``)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from areal_kernel.testing.contracts._shared import _check_unknown_setting_is_refused


class ToolContract:
    """Fixtures: ``tool_name`` (the registered tool) and ``tool_cases`` (a
    list of ``(arguments, expected)``: the call's text must contain
    ``expected``). Optional: ``tool_settings`` (its settings, default
    ``{}``) and ``tool_bad_arguments`` (argument objects the tool must
    refuse: the call raises, which the kernel feeds back as an error;
    default ``[]``)."""

    @pytest.fixture
    def tool_settings(self) -> dict[str, Any]:
        return {}

    @pytest.fixture
    def tool_bad_arguments(self) -> list[dict[str, Any]]:
        return []

    @staticmethod
    def _box(name: str, settings: dict) -> Any:
        from areal_kernel.tools import ToolBox

        return ToolBox.build([name], {name: settings} if settings else None, timeout_s=60.0)

    def test_describes_itself_in_openai_format(self, tool_name: str, tool_settings: dict) -> None:
        box = self._box(tool_name, tool_settings)
        (schema,) = box.schemas()
        json.dumps(schema)  # what a chat template or an OpenAI client receives
        fn = schema["function"]
        assert schema["type"] == "function" and fn["name"] == tool_name
        assert isinstance(fn["description"], str) and fn["description"].strip()
        params = fn["parameters"]
        assert params.get("type") == "object" and isinstance(params.get("properties"), dict), params
        assert set(params.get("required", [])) <= set(params["properties"]), params

    def test_answers_the_cases(self, tool_name: str, tool_settings: dict, tool_cases: list) -> None:
        from areal_kernel.tools import ToolCall

        box = self._box(tool_name, tool_settings)
        required = set(box.schemas()[0]["function"]["parameters"].get("required", []))
        calls = [ToolCall(f"call_{i}", tool_name, json.dumps(args)) for i, (args, _) in enumerate(tool_cases)]
        assert calls, "give at least one case"

        async def run_all() -> list[Any]:
            # Concurrently, as episodes of a run call tools at the same time.
            return await asyncio.gather(*(box.execute(c) for c in calls))

        for (args, expected), res in zip(tool_cases, asyncio.run(run_all())):
            assert required <= set(args), f"case {args} lacks required arguments {sorted(required - set(args))}"
            assert res.ok, f"{tool_name}({args}) failed: {res.content}"
            assert isinstance(res.content, str) and expected in res.content, (args, res.content)

    def test_bad_arguments_become_an_error_message(
        self, tool_name: str, tool_settings: dict, tool_bad_arguments: list
    ) -> None:
        from areal_kernel.tools import ToolCall

        box = self._box(tool_name, tool_settings)
        for args in [*tool_bad_arguments, None]:
            text = "{not json" if args is None else json.dumps(args)
            res = asyncio.run(box.execute(ToolCall("call_0", tool_name, text)))
            assert not res.ok and res.content.startswith("error:") and tool_name in res.content, (args, res)

    def test_unknown_setting_is_refused(self, tool_name: str) -> None:
        _check_unknown_setting_is_refused("tool", tool_name, f"tools.{tool_name}")
