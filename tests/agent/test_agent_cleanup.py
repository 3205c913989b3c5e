"""An agent that follows the contract but closes nothing, trained through a
real ``areal train``: the kernel ends what the agent left (its tasks with its
session, its clients' connections before the rollout loop closes), so the
run ends without a traceback and no connection to the proxy is left open.

Over 60 s (1-2 minutes on a shared 2-core machine): it is a real
``areal train`` (server start, two steps, two evaluations), because the loop
whose end matters is the run's rollout loop, followed by the evaluation's."""
from __future__ import annotations

import os
import re

import pytest

pytest.importorskip("openai")
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def test_an_agent_that_leaks_its_client_trains_without_a_traceback(run_areal, areal_tiny_chat_model_dir, tmp_path):
    proc = run_areal(
        "train", os.path.join(REPO, "examples", "agent_openai.yaml"),
        f"workflow.agent.agent={HERE}/agents.py:LeaksItsClient", f"model.path={areal_tiny_chat_model_dir}",
        f"run_dir={tmp_path / 'run'}", "trainer.max_steps=2", "trainer.batch_size=2", "trainer.eval_size=2",
        "rollout.gconfig.n_samples=4", "rollout.gconfig.max_new_tokens=6", "algorithm.dynamic_filter=false",
        timeout=600,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "Traceback" not in out and "Event loop is closed" not in out, out[-6000:]
    assert "was never retrieved" not in out and "destroyed but it is pending" not in out, out[-6000:]
    # The openai client's httpx logs every request at INFO; the kernel keeps them off the console.
    assert "HTTP Request" not in out, out[-3000:]
    m = re.search(r"LEAK-REPORT kept_clients=(\d+) open_sockets_to_proxy=(\d+) tasks_started=(\d+) "
                  r"tasks_cancelled=(\d+)", out)  # fmt: skip
    assert m, out[-3000:]
    kept, open_sockets, started, cancelled = map(int, m.groups())
    # 2 steps x 2 records x 4 sessions + 2 x 2 evaluation sessions, at least; half of the clients kept.
    assert started >= 20 and kept >= 10, m.group(0)
    assert open_sockets == 0, m.group(0)  # the kept clients' connections were closed by the kernel
    assert cancelled == started, m.group(0)  # every task an agent session left was cancelled at its end
