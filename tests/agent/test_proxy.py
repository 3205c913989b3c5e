"""The OpenAI-compatible proxy, driven by the official ``openai`` client, over
a real embedded server (tiny random Llama with SmolLM2's tokenizer and chat
template): what the client receives and what a session exports are exactly
what the inference engine generated."""
from __future__ import annotations

import openai  # a test dependency (requirements-test.txt): missing is an error, not a skip
import pytest
from agent_helpers import http



def client(proxy, key):
    return openai.OpenAI(base_url=proxy.base_url, api_key=key, max_retries=0)


def calls_since(recorder, start):
    return recorder.calls[start:]


def test_chat_choices_logprobs_and_export_are_what_the_engine_generated(proxy, recorder, tokenizer, new_session):
    sid, key = new_session()
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    start = len(recorder.calls)
    out = client(proxy, key).chat.completions.create(
        model="areal", messages=messages, n=3, seed=7, logprobs=True, max_tokens=8, temperature=1.0
    )
    calls = calls_since(recorder, start)
    assert len(out.choices) == 3 and len(calls) == 3
    # The first prompt is the chat template's rendering, tokenised.
    expected_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(calls[0][0].input_ids) == expected_prompt
    by_seed = {req.gconfig.seed: resp for req, resp in calls}
    assert sorted(by_seed) == [7, 8, 9]  # choice i samples with seed + i
    for i, choice in enumerate(out.choices):
        resp = by_seed[7 + i]
        assert choice.index == i
        assert choice.message.content == tokenizer.decode(resp.output_ids, skip_special_tokens=True)
        assert [t.logprob for t in choice.logprobs.content] == resp.output_logprobs
        assert choice.finish_reason == ("length" if resp.stop_reason.value == "length" else "stop")
    assert out.usage.prompt_tokens == len(calls[0][0].input_ids)
    assert out.usage.completion_tokens == sum(len(r.output_ids) for _, r in calls)

    status, exp = http("GET", f"{proxy.url}/sessions/{sid}/export?format=turns", key=key)
    assert status == 200 and len(exp["rows"]) == 3
    for i, row in enumerate(exp["rows"]):
        req, resp = calls[0][0], by_seed[7 + i]
        n = len(req.input_ids)
        assert row["input_ids"] == list(req.input_ids) + resp.output_ids
        assert row["loss_mask"] == [0] * n + [1] * len(resp.output_ids)
        assert row["logprobs"] == [0.0] * n + resp.output_logprobs
        assert row["versions"] == [-1] * n + resp.output_versions
        assert row["reward"] is None

    # The same seed gives the same answer again (a fresh session, same prompt).
    _, key2 = new_session()
    again = client(proxy, key2).chat.completions.create(model="areal", messages=messages, seed=7, max_tokens=8)
    assert again.choices[0].message.content == out.choices[0].message.content


def test_several_turns_reuse_the_exact_tokens_of_earlier_answers(proxy, recorder, tokenizer, new_session):
    sid, key = new_session()
    c = client(proxy, key)
    messages: list = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    start = len(recorder.calls)
    for k in range(3):
        out = c.chat.completions.create(model="areal", messages=messages, seed=100 + k, max_tokens=6)
        messages += [out.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"And {k}?"}]
    calls = calls_since(recorder, start)
    assert len(calls) == 3
    for (q0, r0), (q1, _) in zip(calls, calls[1:]):
        # Turn k+1's prompt is turn k's prompt and output, token for token, then the new messages.
        head = list(q0.input_ids) + r0.output_ids
        assert list(q1.input_ids)[: len(head)] == head
    assert proxy.stats["continued"] >= 2

    status, exp = http("GET", f"{proxy.url}/sessions/{sid}/export", key=key)
    assert status == 200 and len(exp["rows"]) == 1  # one conversation, one row
    row = exp["rows"][0]
    q_last, r_last = calls[-1]
    assert row["input_ids"] == list(q_last.input_ids) + r_last.output_ids
    # Every model answer is on the loss mask with its own logprobs and versions; nothing else is.
    want_mask = [0] * len(row["input_ids"])
    want_lp = [0.0] * len(row["input_ids"])
    for q, r in calls:
        s = len(q.input_ids)
        want_mask[s : s + len(r.output_ids)] = [1] * len(r.output_ids)
        want_lp[s : s + len(r.output_ids)] = r.output_logprobs
    assert row["loss_mask"] == want_mask and row["logprobs"] == want_lp
    assert sum(row["loss_mask"]) == sum(len(r.output_ids) for _, r in calls)
    # Provenance: the server that generated the answers (one here), as the trained sample records it.
    servers = {r.server for _, r in calls}
    assert len(servers) == 1 and None not in servers and row["server"] == servers.pop()


def test_retokenising_model_output_would_drift_and_the_proxy_does_not(tokenizer):
    """The drift case made deterministic: the model produced "hello" as two
    tokens ("hel" + "lo"), which the tokenizer never produces from that text.
    Re-rendering the conversation and tokenising it gives other ids; the
    proxy's continuation keeps the model's ids and appends only the new turn."""
    from areal_kernel.agent.chat import ChatTokenizer

    chat = ChatTokenizer(tokenizer)
    first = [{"role": "user", "content": "Say hello."}]
    prompt = chat.prompt(first, None)
    split = chat.encode("hel") + chat.encode("lo")
    assert split != chat.encode("hello")  # a split the tokenizer would not make
    output = split + [tokenizer.eos_token_id]
    reply = {"role": "assistant", "content": chat.decode(output)}
    new = [{"role": "user", "content": "Again."}]
    delta = chat.continuation(first, new, None, output, stopped_on_token=True)
    assert delta is not None
    exact = prompt + output + delta
    retokenised = chat.prompt([*first, reply, *new], None)
    assert chat.decode(exact, skip_special_tokens=False) == chat.decode(retokenised, skip_special_tokens=False)
    assert exact != retokenised  # same text, other ids: training on those would score unsampled tokens
    assert exact[: len(prompt) + len(output)] == prompt + output


def test_streaming_sends_the_same_answer_as_openai_chunks(proxy, new_session):
    messages = [{"role": "user", "content": "Count to three."}]
    _, key = new_session()
    whole = client(proxy, key).chat.completions.create(model="areal", messages=messages, seed=5, max_tokens=8)
    _, key2 = new_session()
    stream = client(proxy, key2).chat.completions.create(
        model="areal", messages=messages, seed=5, max_tokens=8, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert text == whole.choices[0].message.content
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_models_lists_the_served_model(proxy, new_session):
    _, key = new_session()
    assert [m.id for m in client(proxy, key).models.list().data] == ["areal"]
    # The proxy serves one model: a request's `model` is not looked up (docs/agents.md says so).
    out = client(proxy, key).chat.completions.create(model="default", messages=[{"role": "user", "content": "x"}],
                                                     max_tokens=2)  # fmt: skip
    assert out.model == "areal" and out.choices[0].message.role == "assistant"


def test_bad_input_is_one_clear_error_and_the_proxy_goes_on(proxy, new_session):
    sid, key = new_session()
    other_sid, other_key = new_session()
    url = proxy.url
    c = client(proxy, key)

    with pytest.raises(openai.AuthenticationError, match="not a session's key"):
        client(proxy, "sk-nobody").chat.completions.create(model="areal", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="field 'stop'"):
        c.chat.completions.create(model="areal", messages=[{"role": "user", "content": "x"}], stop=["\n"])
    with pytest.raises(openai.BadRequestError, match="messages"):
        c.chat.completions.create(model="areal", messages=[])
    with pytest.raises(openai.BadRequestError, match="role"):
        c.chat.completions.create(model="areal", messages=[{"role": "robot", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="'wizard' is not a chat role; expected one of system"):
        c.chat.completions.create(model="areal", messages=[{"role": "wizard", "content": "x"}])

    def err(status_body):
        status, body = status_body
        assert set(body) == {"error"} and body["error"]["message"], body
        return status, body["error"]["code"]

    assert err(http("POST", f"{url}/v1/chat/completions", key=key, raw=b"{not json")) == (400, "invalid_json")
    assert err(http("POST", f"{url}/sessions/sess-nope/reward", {"reward": 1.0}, key=key)) == (404, "unknown_session")
    # A key reaches its own session only.
    assert err(http("POST", f"{url}/sessions/{other_sid}/reward", {"reward": 1.0}, key=key)) == (403, "wrong_session_key")
    assert err(http("GET", f"{url}/sessions/{other_sid}/export", key=key)) == (403, "wrong_session_key")
    assert err(http("POST", f"{url}/sessions/{sid}/reward", {"reward": "high"}, key=key)) == (400, "invalid_reward")
    assert err(http("POST", f"{url}/sessions/{sid}/reward", {"reward": 1, "turn": 3}, key=key)) == (400, "invalid_turn")
    assert err(http("POST", f"{url}/sessions/{sid}/reward", {"score": 1}, key=key)) == (400, "invalid_request")

    c.chat.completions.create(model="areal", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert http("POST", f"{url}/sessions/{sid}/reward", {"reward": 0.5, "turn": 0}, key=key)[0] == 200
    assert http("POST", f"{url}/sessions/{sid}/reward", {"reward": 1.0}, key=key)[0] == 200
    assert http("POST", f"{url}/sessions/{sid}/end", key=key)[0] == 200
    assert err(http("POST", f"{url}/sessions/{sid}/reward", {"reward": 2.0}, key=key)) == (409, "session_ended")
    assert err(http("POST", f"{url}/sessions/{sid}/end", key=key)) == (409, "session_ended")
    with pytest.raises(openai.ConflictError, match="has ended"):
        c.chat.completions.create(model="areal", messages=[{"role": "user", "content": "x"}])
    # Nothing of that changed another session, and the proxy still serves.
    assert http("GET", f"{url}/sessions/{other_sid}", key=other_key)[1]["reward"] is None
    status, summary = http("GET", f"{url}/sessions/{sid}", key=key)
    assert summary["reward"] == 1.0 and summary["completions"][0]["reward"] == 0.5 and summary["ended"]
    ok = client(proxy, other_key).chat.completions.create(model="areal", messages=[{"role": "user", "content": "y"}], max_tokens=2)
    assert ok.choices[0].message.role == "assistant"


def test_opening_sessions_needs_the_admin_token_when_one_is_set(tokenizer, recorder):
    from pydantic import ValidationError

    from areal_kernel.agent.config import ProxyConfig
    from areal_kernel.agent.proxy import AgentProxy

    with pytest.raises(ValidationError, match="admin_token"):
        ProxyConfig(host="0.0.0.0")  # reachable from other machines: sessions must not be open to all
    assert ProxyConfig(host="0.0.0.0", admin_token="t0ken").admin_token == "t0ken"

    p = AgentProxy(tokenizer, ProxyConfig(admin_token="t0ken"), engine=recorder)
    p.start()
    try:
        status, body = http("POST", f"{p.url}/sessions", {})
        assert status == 401 and body["error"]["code"] == "invalid_admin_token"
        status, body = http("POST", f"{p.url}/sessions", {}, key="t0ken")
        assert status == 200
        sid = body["session_id"]
        assert http("GET", f"{p.url}/sessions/{sid}", key="t0ken")[0] == 200  # the operator sees every session
        assert http("GET", f"{p.url}/sessions/{sid}", key="wrong")[0] == 403
    finally:
        p.stop()


def test_sessions_wait_for_a_rollout_slot(tokenizer, recorder):
    """Online mode: a session takes one place of the staleness budget; with
    none offered, opening one fails with a clear error after the wait."""
    from areal_kernel.agent.config import ProxyConfig
    from areal_kernel.agent.proxy import AgentProxy

    p = AgentProxy(tokenizer, ProxyConfig(session_wait_s=0.3), require_slots=True)
    p.start()
    try:
        status, body = http("POST", f"{p.url}/sessions", {})
        assert status == 503 and body["error"]["code"] == "no_free_slot"
        (slot,) = p.offer_slots(recorder, "group-7", [42])
        status, body = http("POST", f"{p.url}/sessions", {"metadata": {"user": "a"}})
        assert status == 200
        session = slot.claimed.result(timeout=5)
        assert (session.id, session.group, session.seed, session.engine) == (body["session_id"], "group-7", 42, recorder)
        assert http("POST", f"{p.url}/sessions", {})[0] == 503  # its one slot is taken
    finally:
        p.stop()
