"""The ``multi_turn`` workflow on a real embedded server.

The model is the session's tiny chat Llama (SmolLM2's tokenizer and chat
template), first taught by a few hundred plain PyTorch steps to answer three
prompts exactly, so that the episodes below are deterministic:

- "Use the calculator: 2 + 3" -> a ``<tool_call>`` block followed by more
  words (which a stop at ``</tool_call>`` must cut off);
- "What is 2 + 3?" -> " hel" + "lo" (two tokens: re-tokenising the decoded
  text gives the single token " hello", so token drift is visible), then,
  after the feedback message, "5".

Everything else is real: server, client, reward workers, tools.
"""
from __future__ import annotations

import asyncio
import dataclasses

import pytest

from areal_kernel.api.io import GenerationConfig, ModelRequest, ModelResponse, StopReason
from areal_kernel.testing import WorkflowContract
from areal_kernel.workflow.multi_turn import MultiTurnWorkflow
from areal_kernel.workflow.multi_turn_config import MultiTurnConfig

pytestmark = pytest.mark.slow

EXACT = "areal_kernel.reward.exact_match:exact_match_reward"
TOOL_PROMPT = "Use the calculator: 2 + 3"
ASK = "What is 2 + 3?"
FEEDBACK = "Your answer is wrong. Try again."
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'
AFTER_CALL = " and then many more words"


def _workflow(tok, *, pool=None, gconfig=None, **settings):
    cfg = MultiTurnConfig(**{"feedback": FEEDBACK, **settings})
    g = gconfig or GenerationConfig(max_new_tokens=48, greedy=True, n_samples=1)
    return MultiTurnWorkflow(tokenizer=tok, gconfig=g, reward_target=EXACT, reward_pool=pool, config=cfg)


def _ids(tok, text):
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _lessons(tok):
    """(prompt ids, target ids) the tiny model is taught."""
    wf = _workflow(tok, tools=["calculator"])
    eos = tok.eos_token_id
    p_tool = wf.encode_prompt({"prompt": TOOL_PROMPT})
    p_ask = wf.encode_prompt({"prompt": ASK})
    first = _ids(tok, " hel") + _ids(tok, "lo") + [eos]
    after = wf.env_ids(ModelResponse(p_ask, first, stop_reason=StopReason.STOP), [{"role": "user", "content": FEEDBACK}])
    return [(p_tool, _ids(tok, CALL + AFTER_CALL) + [eos]), (p_ask, first), (p_ask + first + after, _ids(tok, "5") + [eos])]


def _teach(src: str, dst: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    lessons = _lessons(tok)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(600):
        right = True
        for prompt, target in lessons:
            ids = torch.tensor([prompt + target])
            out = model(input_ids=ids, labels=torch.tensor([[-100] * len(prompt) + target]))
            out.loss.backward()
            pred = out.logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()
            right = right and pred == target
        if right and step >= 20:
            break
        opt.step()
        opt.zero_grad()
    assert right, "the tiny model did not learn its lessons"
    model.save_pretrained(dst)
    tok.save_pretrained(dst)


@pytest.fixture(scope="module")
def taught_dir(areal_tiny_chat_model_dir, tmp_path_factory):
    dst = str(tmp_path_factory.mktemp("taught"))
    _teach(areal_tiny_chat_model_dir, dst)
    return dst


@pytest.fixture(scope="module")
def tok(taught_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(taught_dir)


@pytest.fixture(scope="module")
def engine(taught_dir, tmp_path_factory):
    from areal_kernel.testing.servers import embedded_server

    with embedded_server(taught_dir, str(tmp_path_factory.mktemp("srv"))) as eng:
        yield eng


@pytest.fixture(scope="module")
def pool():
    from areal_kernel.reward.pool import RewardPool

    p = RewardPool(n_workers=1, timeout_s=60, preload=(), settings={EXACT: {}})
    yield p
    p.close()


class _Recorder:
    def __init__(self, engine):
        self.engine, self.calls = engine, []

    async def agenerate(self, req):
        resp = await self.engine.agenerate(req)
        self.calls.append((req, resp))
        return resp


def _run(engine, coro):
    async def go():
        try:
            return await coro
        finally:
            await engine.aclose(current_loop_only=True)

    return asyncio.run(go())


def test_feedback_gives_a_second_turn_with_discounted_reward_and_exact_tokens(tok, engine, pool):
    wf = _workflow(tok, pool=pool, max_turns=3, turn_discount=0.5)
    rec = _Recorder(engine)
    group = _run(engine, wf.arun_episode(rec, {"id": "q1", "prompt": ASK, "answer": "5"}))
    (t,) = group.trajectories
    turns = t.metadata["turns"]
    assert [x["text"] for x in turns] == [" hello", "5"] and [x["reward"] for x in turns] == [0.0, 1.0]
    assert t.reward == 0.5  # solved at turn 1: 0.5 ** 1
    assert t.metadata["metrics"]["second_turn_success"] == 1.0 and t.metadata["metrics"]["first_turn_success"] == 0.0
    (q1, r1), (q2, r2) = rec.calls
    n1, n2 = len(q1.input_ids), len(q2.input_ids)
    # Turn 2's prompt: turn 1's prompt and its exact output ids, then only the new message's tokens.
    assert q2.input_ids[: n1 + r1.output_len] == q1.input_ids + r1.output_ids
    assert t.input_ids == q2.input_ids + r2.output_ids
    assert t.loss_mask == [0] * n1 + [1] * r1.output_len + [0] * (n2 - n1 - r1.output_len) + [1] * r2.output_len
    assert t.logprobs == [0.0] * n1 + r1.output_logprobs + [0.0] * (n2 - n1 - r1.output_len) + r2.output_logprobs
    assert t.versions == [-1] * n1 + r1.output_versions + [-1] * (n2 - n1 - r1.output_len) + r2.output_versions
    # Provenance: the server that answered (both turns, one server here), per turn and for the sample.
    assert r1.server and [x["server"] for x in turns] == [r1.server, r2.server] and t.metadata["server"] == r1.server
    assert tok.decode(q2.input_ids[n1 + r1.output_len :]) == f"\n<|im_start|>user\n{FEEDBACK}<|im_end|>\n<|im_start|>assistant\n"
    # The drift case: re-tokenising the decoded turn-1 text would change the ids the model produced.
    prefix = q1.input_ids + r1.output_ids
    assert list(tok(tok.decode(prefix), add_special_tokens=False)["input_ids"]) != prefix
    # One turn only: no feedback, the wrong answer's reward stands.
    wf1 = _workflow(tok, pool=pool, max_turns=1)
    (t1,) = _run(engine, wf1.arun_episode(engine, {"id": "q1", "prompt": ASK, "answer": "5"})).trajectories
    assert t1.reward == 0.0 and len(t1.metadata["turns"]) == 1 and "second_turn_success" not in t1.metadata["metrics"]


def test_a_tool_call_stops_generation_and_its_result_is_fed_back(tok, engine, pool):
    wf = _workflow(tok, pool=pool, max_turns=2, tools=["calculator"])
    rec = _Recorder(engine)
    group = _run(engine, wf.arun_episode(rec, {"id": "t1", "prompt": TOOL_PROMPT, "answer": "5"}))
    (t,) = group.trajectories
    (q1, r1), (q2, r2) = rec.calls
    assert q1.gconfig.stop == ["</tool_call>"]
    assert r1.stop_reason == StopReason.STOP and r1.matched_stop == "</tool_call>"
    first = t.metadata["turns"][0]
    assert first["stop_reason"] == "tool_call" and first["tool_calls"] == 1 and first["reward"] is None
    text = tok.decode(r1.output_ids)
    assert text.startswith(CALL) and "more words" not in text, text  # stopped right after the call
    # The calculator's answer is the next message, in the tokens the model reads next.
    fed = tok.decode(q2.input_ids[len(q1.input_ids) + r1.output_len :])
    assert fed == "<|im_end|>\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n", fed
    assert q2.input_ids[: len(q1.input_ids) + r1.output_len] == q1.input_ids + r1.output_ids
    assert t.metadata["turns"][1]["reward"] is not None and t.metadata["metrics"]["tool_calls"] == 1.0
    # Without the stop string the same greedy request runs on past the call.
    g = dataclasses.replace(q1.gconfig, stop=[])
    free = _run(engine, engine.agenerate(ModelRequest(q1.input_ids, g)))
    assert AFTER_CALL.strip() in tok.decode(free.output_ids) and free.matched_stop is None


def test_greedy_evaluation_answers_tool_calls_and_scores_once(tok, engine, pool):
    wf = _workflow(tok, pool=pool, max_turns=3, tools=["calculator"])
    calls = wf.reward_calls
    score, text = _run(engine, wf.aevaluate(engine, {"id": "t1", "prompt": ASK, "answer": "5"}, 16))
    assert (score, text) == (0.0, " hello") and wf.reward_calls == calls + 1  # no second try in evaluation


def test_greedy_evaluation_samples_with_the_workflows_adapter(tok, engine, pool):
    """A multi-policy run gives each policy's workflow its adapter in its
    gconfig; the held-out evaluation samples with it too (it used the base).
    The engine here serves no adapter: the recorder notes the name and sends
    the request on without it."""
    g = GenerationConfig(max_new_tokens=48, greedy=True, n_samples=1, adapter="pol")
    wf = _workflow(tok, pool=pool, max_turns=2, tools=["calculator"], gconfig=g)
    asked = []

    class Strip:
        async def agenerate(self, req):
            asked.append((req.gconfig.adapter, req.gconfig.greedy))
            return await engine.agenerate(dataclasses.replace(req, gconfig=dataclasses.replace(req.gconfig, adapter=None)))

    _run(engine, wf.aevaluate(Strip(), {"id": "t1", "prompt": TOOL_PROMPT, "answer": "5"}, 16))
    assert len(asked) == 2 and set(asked) == {("pol", True)}, asked  # both turns (a tool call, then the answer)


def test_bad_settings_name_the_field():
    from areal_kernel.config.loader import validate_config
    from areal_kernel.plugins import get_registry
    from areal_kernel.errors import ConfigError

    for bad, where in [
        ({"tools": ["calc"]}, "workflow.multi_turn.tools"),
        ({"tools": ["python"], "tool_settings": {"python": {"timeout": 1}}}, "workflow.multi_turn.tool_settings.python.timeout"),
        ({"tool_settings": {"calculator": {}}}, "workflow.multi_turn.tool_settings.calculator"),
        ({"tool_parser": "nope"}, "workflow.multi_turn.tool_parser"),
        ({"max_turns": 0}, "workflow.multi_turn.max_turns"),
        ({"use_chat_template": False}, "workflow.multi_turn.use_chat_template"),
    ]:
        with pytest.raises(ConfigError) as e:
            validate_config({"workflow": {"type": "multi_turn", "multi_turn": bad}}, "test", registry=get_registry())
        assert where in str(e.value), (bad, str(e.value))


# The contract's settings: several turns, and the default discount of a retry (0.5).
CONTRACT_SETTINGS = {"max_turns": 3, "turn_discount": 0.5, "feedback": "No.", "tools": ["calculator"]}


class TestMultiTurnWorkflow(WorkflowContract):
    """The contract on the taught model, tools on: it answers the contract's
    question with "hello", which the probe reward scores below 1, so every
    episode takes several turns and its reward is a discounted score
    (checked below): the suite's reward rule admits a discounting workflow."""

    @pytest.fixture
    def workflow_name(self):
        return "multi_turn"

    @pytest.fixture
    def workflow_settings(self):
        return dict(CONTRACT_SETTINGS)

    @pytest.fixture(scope="class")
    @classmethod
    def workflow_model_dir(cls, taught_dir):
        return taught_dir

    @pytest.fixture(scope="class")
    @classmethod
    def workflow_engine(cls, engine):
        return engine

    def expected_completion(self, tokenizer, trajectory):
        # The reward scores the final turn: the last run of loss tokens.
        m = trajectory.loss_mask
        end = max(i for i, x in enumerate(m) if x) + 1
        start = end
        while start > 0 and m[start - 1]:
            start -= 1
        return tokenizer.decode(trajectory.input_ids[start:end], skip_special_tokens=True)


def test_contract_episodes_took_several_turns(tok, engine, tmp_path):
    """The contract above exercises more than one turn (else it would check a single-turn workflow)."""
    from areal_kernel.reward.pool import RewardPool
    from areal_kernel.testing.probe_reward import PROBE_REWARD_TARGET

    p = RewardPool(n_workers=1, timeout_s=60, preload=(), settings={PROBE_REWARD_TARGET: {"log_path": str(tmp_path / "l")}})
    try:
        wf = MultiTurnWorkflow(
            tokenizer=tok, gconfig=GenerationConfig(max_new_tokens=6, n_samples=3), reward_target=PROBE_REWARD_TARGET,
            reward_pool=p, config=MultiTurnConfig(**CONTRACT_SETTINGS),
        )  # fmt: skip
        group = _run(engine, wf.arun_episode(engine, {"id": "c", "prompt": ASK, "answer": "5", "_sample_seed": 7}))
    finally:
        p.close()
    assert all(len(t.metadata["turns"]) > 1 for t in group.trajectories)
    # The reward is discounted: below the score of the turn it came from.
    best = [max(x["reward"] for x in t.metadata["turns"] if x["reward"] is not None) for t in group.trajectories]
    assert any(0 < t.reward < s for t, s in zip(group.trajectories, best)), [(t.reward, s) for t, s in zip(group.trajectories, best)]
    assert all(sum(1 for a, b in zip([0] + t.loss_mask, t.loss_mask) if b and not a) > 1 for t in group.trajectories)

