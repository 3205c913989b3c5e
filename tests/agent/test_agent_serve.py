"""``areal agent serve``: online training driven from outside the process.
The test (another process) opens sessions over HTTP, talks to them with the
``openai`` client, posts rewards and ends them; the run trains one step on
that group and exits. Sessions are admitted under the staleness budget: a
session beyond it is refused with a clear error."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import openai  # a test dependency (requirements-test.txt): missing is an error, not a skip
from agent_helpers import http
from areal_kernel.utils import prefork

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_online_sessions_from_outside_are_trained_on(areal_tiny_chat_model_dir, tmp_path):
    from areal_kernel.utils.network import find_free_port

    port = find_free_port()
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "areal_kernel.cli", "agent", "serve", os.path.join(REPO, "examples", "agent_online.yaml"),
        f"model.path={areal_tiny_chat_model_dir}", f"run_dir={run_dir}", f"workflow.agent.proxy.port={port}",
        "workflow.agent.proxy.session_wait_s=1", "trainer.max_steps=1", "trainer.batch_size=1",
        "rollout.gconfig.n_samples=2", "rollout.gconfig.max_new_tokens=6", "rollout.max_staleness=0",
        "logging.sinks=[jsonl]",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = open(tmp_path / "serve.log", "w")
    proc = prefork.popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            # Up, and both places of the budget offered: the proxy listens
            # before the run has started its rollouts, and a session asked
            # for earlier waits only session_wait_s (1 s) for a slot.
            try:
                status, health = http("GET", f"{url}/health")
                if status == 200 and health.get("free_slots") == 2:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the proxy never offered both slots"
            time.sleep(0.2)

        sessions = [http("POST", f"{url}/sessions", {"metadata": {"client": k}})[1] for k in range(2)]
        assert all("api_key" in s for s in sessions), sessions
        # Both places of the budget (one group of n_samples=2, max_staleness 0) are taken.
        status, body = http("POST", f"{url}/sessions", {})
        assert status == 503 and body["error"]["code"] == "no_free_slot"

        for k, s in enumerate(sessions):
            c = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
            messages: list = [{"role": "user", "content": f"Tell me about {k}."}]
            for turn in range(k + 1):  # the second client holds a two-turn conversation
                out = c.chat.completions.create(model="areal", messages=messages)
                messages += [out.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
            sid, key = s["session_id"], s["api_key"]
            assert http("POST", f"{url}/sessions/{sid}/reward", {"reward": float(k)}, key=key)[0] == 200
            assert http("POST", f"{url}/sessions/{sid}/end", key=key)[0] == 200
            status, body = http("POST", f"{url}/sessions/{sid}/reward", {"reward": 3.0}, key=key)
            assert status == 409 and body["error"]["code"] == "session_ended", (status, body)
        assert http("POST", f"{url}/sessions/sess-unknown/end", key=sessions[0]["api_key"])[0] == 404

        rc = proc.wait(timeout=300)
        out = (tmp_path / "serve.log").read_text()
        assert rc == 0, out[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        log.close()
    assert f"agent proxy: {url}" in out
    result = json.loads((run_dir / "result.json").read_text())
    assert result["steps"] == 1 and result["samples"] == 2
    (step,) = [json.loads(line) for line in open(run_dir / "metrics.jsonl") if '"perf/step_s"' in line]
    assert step["reward/mean"] == 0.5 and step["batch/sequences"] == 2  # rewards 0 and 1, one row per session
    # Provenance of the agents' samples: the run's one server generated both.
    (trained,) = [json.loads(line) for line in open(run_dir / "samples.jsonl")]
    servers = {s["server"] for s in trained["samples"]}
    assert len(trained["samples"]) == 2 and len(servers) == 1 and servers.pop().startswith("127.0.0.1:"), trained
