"""One real embedded server on the tiny chat model (SmolLM2's tokenizer and
template, random weights) shared by the agent tests, and a proxy in front of
it whose engine records every request and response."""

from __future__ import annotations

import os

import pytest
from agent_helpers import Recorder, http

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_server(areal_tiny_chat_model_dir, tmp_path_factory):
    from areal_kernel.testing.servers import embedded_server

    with embedded_server(areal_tiny_chat_model_dir, str(tmp_path_factory.mktemp("agent-srv"))) as engine:
        yield engine


@pytest.fixture(scope="session")
def tokenizer(areal_tiny_chat_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(areal_tiny_chat_model_dir)


@pytest.fixture(scope="module")
def recorder(tiny_server):
    return Recorder(tiny_server)


@pytest.fixture(scope="module")
def proxy(tokenizer, recorder):
    from areal_kernel.agent.proxy import AgentProxy
    from areal_kernel.api.io import GenerationConfig

    p = AgentProxy(tokenizer, gconfig=GenerationConfig(max_new_tokens=10), engine=recorder)
    p.start()
    yield p
    p.stop()


@pytest.fixture
def new_session(proxy):
    """Open a session over HTTP: (session_id, api_key)."""

    def open_one() -> tuple[str, str]:
        status, out = http("POST", f"{proxy.url}/sessions", {})
        assert status == 200, out
        assert out["base_url"] == proxy.base_url
        return out["session_id"], out["api_key"]

    return open_one
