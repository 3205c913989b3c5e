"""Tool calls through the proxy. The parser is checked on known strings; the
HTTP path with a real model: SmolLM2-135M-Instruct, greedy, shown two
examples of the call format in the conversation, writes a well-formed
``<tool_call>`` for the third question. That is a property of this model and
prompt (checked here), so the test is deterministic where greedy decoding
is; what it shows is the proxy's side: the call parsed into OpenAI's
``tool_calls`` with ``finish_reason: tool_calls``, in whole and streamed
answers, and a tool result continuing the same token sequence."""
from __future__ import annotations

import json

import openai  # a test dependency (requirements-test.txt): missing is an error, not a skip
import pytest
from agent_helpers import Recorder, http


SYSTEM = 'You call tools. To call a tool, answer only with <tool_call>{"name": NAME, "arguments": ARGS}</tool_call>.'
FEW_SHOT = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is 7 plus 5?"},
    {"role": "assistant", "content": '<tool_call>{"name": "add", "arguments": {"a": 7, "b": 5}}</tool_call>'},
    {"role": "user", "content": "What is 4 plus 1?"},
    {"role": "assistant", "content": '<tool_call>{"name": "add", "arguments": {"a": 4, "b": 1}}</tool_call>'},
    {"role": "user", "content": "What is 2 plus 3?"},
]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b",
          "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]  # fmt: skip


def test_the_proxy_uses_the_registered_hermes_parser():
    from areal_kernel.tools import ToolCallParser, build_tool_parser
    from areal_kernel.tools.hermes import HermesParser

    p = build_tool_parser("hermes", where="proxy.tool_parser")
    assert isinstance(p, ToolCallParser) and isinstance(p, HermesParser)
    out = p.parse('Let me add.<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    assert out.content == "Let me add." and not out.errors
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("add", {"a": 1, "b": 2})]
    # Malformed calls are errors on the sample, never exceptions (tests/tools has the parser's own cases).
    bad = p.parse('<tool_call>{"name": "add", "arguments": {"a": 1,}</tool_call>')
    assert bad.tool_calls == () and len(bad.errors) == 1


@pytest.fixture(scope="module")
def smol_proxy(tmp_path_factory):
    from transformers import AutoTokenizer

    from areal_kernel.agent.proxy import AgentProxy
    from areal_kernel.api.io import GenerationConfig
    from areal_kernel.inference.client import RemoteInferenceEngine
    from areal_kernel.inference.embedded.backend import EmbeddedProtocol
    from areal_kernel.inference.embedded.launcher import EmbeddedLauncher, EmbeddedServerConfig
    from areal_kernel.models.resolve import resolve_model_path

    model = resolve_model_path("smollm2-135m-instruct")
    launcher = EmbeddedLauncher(EmbeddedServerConfig(dtype="float32"), run_dir=str(tmp_path_factory.mktemp("smol")))
    infos = launcher.launch(model, n_servers=1, devices_per_server=0)
    engine = Recorder(RemoteInferenceEngine([i.address for i in infos], EmbeddedProtocol()))
    proxy = AgentProxy(AutoTokenizer.from_pretrained(model), gconfig=GenerationConfig(max_new_tokens=40), engine=engine)
    proxy.start()
    yield proxy, engine
    proxy.stop()
    engine.destroy()
    launcher.stop()


def test_a_tool_call_round_trip_is_parsed_and_token_exact(smol_proxy):
    proxy, engine = smol_proxy
    status, s = http("POST", f"{proxy.url}/sessions", {})
    c = openai.OpenAI(base_url=proxy.base_url, api_key=s["api_key"], max_retries=0)
    start = len(engine.calls)
    out = c.chat.completions.create(model="areal", messages=FEW_SHOT, tools=TOOLS, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}

    # The agent runs the tool and sends the result back.
    messages = [*FEW_SHOT, choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "5"}]  # fmt: skip
    again = c.chat.completions.create(model="areal", messages=messages, tools=TOOLS, temperature=0, max_tokens=8)
    assert again.choices[0].finish_reason in ("stop", "length")
    (q0, r0), (q1, r1) = engine.calls[start:]
    assert list(q1.input_ids)[: len(q0.input_ids) + len(r0.output_ids)] == list(q0.input_ids) + r0.output_ids
    status, exp = http("GET", f"{proxy.url}/sessions/{s['session_id']}/export", key=s["api_key"])
    (row,) = exp["rows"]
    assert row["input_ids"] == list(q1.input_ids) + r1.output_ids
    assert sum(row["loss_mask"]) == len(r0.output_ids) + len(r1.output_ids)

    # tool_choice "none": the same text comes back as content, not as a call.
    plain = c.chat.completions.create(model="areal", messages=FEW_SHOT, tools=TOOLS, temperature=0, tool_choice="none")
    assert plain.choices[0].finish_reason == "stop" and "<tool_call>" in plain.choices[0].message.content

    # Streamed: the call arrives as a tool_calls delta, then finish_reason tool_calls.
    chunks = list(c.chat.completions.create(model="areal", messages=FEW_SHOT, tools=TOOLS, temperature=0, stream=True))
    deltas = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [(0, "add", {"a": 2, "b": 3})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
