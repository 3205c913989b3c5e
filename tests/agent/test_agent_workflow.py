"""``workflow.type: agent``: the kernel's workflow contract on an inline
agent, the same ``openai`` agent inline and as an unmodified subprocess
script, and agents that fail."""
from __future__ import annotations

import asyncio
import os

import pytest
from agent_helpers import Recorder

from areal_kernel.testing import WorkflowContract
from areal_kernel.testing.recording import loss_spans

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE_AGENT = os.path.join(REPO, "examples", "agent_openai.py")


class TestAgentWorkflow(WorkflowContract):
    @pytest.fixture
    def workflow_name(self):
        return "agent"

    @pytest.fixture
    def workflow_settings(self):
        return {"agent": "areal_kernel.agent.simple:ChatAgent", "agent_kwargs": {"prompt_template": "Q: {prompt}"}}

    @pytest.fixture(scope="class")
    @classmethod
    def workflow_engine(cls, tiny_server):
        return tiny_server


def build(settings: dict, n: int = 2, max_new_tokens: int = 6, pool=None):
    from transformers import AutoTokenizer

    from areal_kernel.agent.config import AgentWorkflowConfig
    from areal_kernel.agent.workflow import AgentWorkflow
    from areal_kernel.api.io import GenerationConfig

    return AgentWorkflow(
        tokenizer=AutoTokenizer.from_pretrained(os.environ["AREAL_TEST_TOKENIZER"]),
        gconfig=GenerationConfig(n_samples=n, max_new_tokens=max_new_tokens, temperature=1.0),
        reward_target="unused", reward_pool=pool, config=AgentWorkflowConfig.model_validate(settings),
    )  # fmt: skip


@pytest.fixture(autouse=True)
def _tokenizer_dir(areal_tiny_chat_model_dir, monkeypatch):
    monkeypatch.setenv("AREAL_TEST_TOKENIZER", areal_tiny_chat_model_dir)


def episode(wf, engine, record):
    async def go():
        try:
            return await wf.arun_episode(engine, dict(record))
        finally:
            await engine.aclose(current_loop_only=True)

    return asyncio.run(go())


def check_rows_are_engine_outputs(group, rec: Recorder):
    for t in group.trajectories:
        for i, j in loss_spans(t.loss_mask):
            assert any(list(q.input_ids) == t.input_ids[:i] and r.output_ids == t.input_ids[i:j]
                       and r.output_logprobs == t.logprobs[i:j] for q, r in rec.calls)  # fmt: skip


RECORD = {"id": "q1", "prompt": "What is 2 + 3?", "answer": "5", "_sample_seed": 11}


def test_the_same_openai_agent_runs_inline_and_as_an_unmodified_script(tiny_server):
    inline = build({"mode": "inline", "agent": f"{EXAMPLE_AGENT}:ArithmeticAgent"})
    script = build({"mode": "subprocess", "command": ["{python}", EXAMPLE_AGENT]})
    try:
        rec_a, rec_b = Recorder(tiny_server), Recorder(tiny_server)
        a = episode(inline, rec_a, RECORD)
        b = episode(script, rec_b, RECORD)
    finally:
        inline.close()
        script.close()
    for group, rec in ((a, rec_a), (b, rec_b)):
        assert group.group_id == "q1" and len(group.trajectories) == 2  # n_samples sessions, one row each
        assert all(t.group_id == "q1" and t.reward in (0.0, 1.0) for t in group.trajectories)
        check_rows_are_engine_outputs(group, rec)
    # Same record, same sample seeds: the script produced exactly what the inline agent did.
    assert [t.input_ids for t in a.trajectories] == [t.input_ids for t in b.trajectories]
    assert [t.reward for t in a.trajectories] == [t.reward for t in b.trajectories]
    # A session that asked twice (no number in the first answer) is still one row, with both answers on its mask.
    assert sum(sum(_runs(t.loss_mask)) for t in a.trajectories) == len(rec_a.calls) >= 2


def _runs(mask):
    prev = 0
    for m in mask:
        if m and not prev:
            yield 1
        prev = m


def test_failing_agents_are_dropped_and_the_run_goes_on(tiny_server):
    from areal_kernel.errors import ArealError

    flaky = build({"mode": "inline", "agent": f"{HERE}/agents.py:FailsOnOddSessions"}, n=4, max_new_tokens=3)
    dead = build({"mode": "inline", "agent": f"{HERE}/agents.py:AlwaysFails"})
    crash = build({"mode": "subprocess", "command": ["{python}", "-c", "import sys; sys.exit('env broke')"]})
    wrong = build({"mode": "inline", "agent": f"{HERE}/agents.py:ReturnsText"}, n=1, max_new_tokens=3)
    try:
        group = episode(flaky, tiny_server, RECORD)
        assert len(group.trajectories) == 2 and flaky.agent_failures == 2  # the two that raised are dropped
        assert all(t.reward == 0.5 for t in group.trajectories)
        with pytest.raises(ArealError, match="every agent session of record 'q1' failed; last: agent raised ValueError: no luck"):
            episode(dead, tiny_server, RECORD)
        with pytest.raises(ArealError, match="exited with 1: env broke"):
            episode(crash, tiny_server, RECORD)
        with pytest.raises(ArealError, match="returned 'one'; expected a finite number or None"):
            episode(wrong, tiny_server, RECORD)
        # The proxy served all along.
        assert len(flaky.proxy.store) == 0 and episode(flaky, tiny_server, {**RECORD, "id": "q2"}) is not None
    finally:
        for wf in (flaky, dead, crash, wrong):
            wf.close()


def test_bad_agent_settings_are_config_errors():
    from areal_kernel.config.sections import validate_settings
    from areal_kernel.errors import ConfigError
    from areal_kernel.plugins import get_registry

    spec = get_registry().get("workflow", "agent")
    with pytest.raises(ConfigError, match="mode 'inline' needs the agent class"):
        validate_settings("workflow.agent", "workflow", "agent", {"mode": "inline"}, spec=spec)
    with pytest.raises(ConfigError, match="mode 'subprocess' needs the command"):
        validate_settings("workflow.agent", "workflow", "agent", {"mode": "subprocess"}, spec=spec)
    with pytest.raises(ConfigError, match="admin_token"):
        validate_settings(
            "workflow.agent", "workflow", "agent", {"mode": "online", "proxy": {"host": "0.0.0.0"}}, spec=spec
        )
    with pytest.raises(ConfigError, match="has no attribute 'Nope'"):
        build({"mode": "inline", "agent": "areal_kernel.agent.simple:Nope"})


@pytest.mark.parametrize("name, mode", [("agent_openai.yaml", "inline"), ("agent_online.yaml", "online")])
def test_agent_examples_validate(name, mode):
    from areal_kernel.config.loader import load_config
    from areal_kernel.plugins import get_registry

    cfg = load_config(os.path.join(REPO, "examples", name), registry=get_registry())
    assert cfg.workflow.type == "agent" and cfg.workflow.plugin_config.mode == mode


def test_the_records_file_section_of_the_agent_docs_loads_its_records(tmp_path, monkeypatch):
    """docs/agents.md's `dataset` section for a records file, put in place of
    examples/agent_openai.yaml's, validates and loads the example records."""
    import re

    import yaml

    from areal_kernel.config.loader import load_config
    from areal_kernel.plugins import get_registry
    from areal_kernel.trainer.components import load_data

    doc = open(os.path.join(REPO, "docs", "agents.md"), encoding="utf-8").read()
    section = doc.split("### Training on your own records", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block, "no yaml block under 'Training on your own records'"
    config = yaml.safe_load(open(os.path.join(REPO, "examples", "agent_openai.yaml"), encoding="utf-8"))
    config["dataset"] = yaml.safe_load(block.group(1))["dataset"]
    path = tmp_path / "agent_file.yaml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.chdir(REPO)  # the doc's path is relative to the repository root, where the commands run
    cfg = load_config(str(path), registry=get_registry())
    train, evals = load_data(cfg, ())
    assert len(train) + len(evals) == 8 and len(evals) >= 1
    assert all("prompt" in r and "answer" in r for r in train + evals)
