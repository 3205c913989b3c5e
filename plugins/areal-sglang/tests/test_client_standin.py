"""The kernel's generic client driving STAND-IN SGLang servers (sglang_standin.py,
written from SGLang's documented wire format; no real SGLang runs here) that were
started by the real launcher. Every argv and request body the stand-ins get is
checked by SGLang's own parser/request classes (the oracle fixture).

Covers: generation across servers, retries on 5xx, interruption by a weight
update (abort, new weights, resume from partial output: one response with
tokens of two versions), weight-update call order and versions, the
SGLang-only control calls, failover when a server dies, and auth."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from areal_kernel.api.engine import WeightUpdateMeta
from areal_kernel.api.io import GenerationConfig, ModelRequest, StopReason
from areal_sglang.backend import SGLangInferenceEngine
from areal_sglang.protocol import SGLangProtocol

from sglang_testutil import post_json, standin_state, wait_for_tokens

pytestmark = pytest.mark.slow


def gen(engine, prompts, **g):
    async def go():
        try:
            return await asyncio.gather(*(engine.agenerate(ModelRequest(p, GenerationConfig(**g))) for p in prompts))
        finally:
            await engine.aclose(current_loop_only=True)

    return asyncio.run(go())


def test_generates_across_servers_with_aligned_logprobs(model_dir, launch_standins):
    _, infos = launch_standins(model_dir, n=2)
    engine = SGLangInferenceEngine([i.address for i in infos])
    prompts = [[1, 2, 3], [4], [5, 6], [7, 8, 9], [10], [11, 12]]
    rs = gen(engine, prompts, max_new_tokens=6, greedy=True)
    assert {r.server for r in rs} == {i.address for i in infos}
    for r in rs:
        assert r.output_len == 6 and r.stop_reason == StopReason.LENGTH
        assert len(r.output_logprobs) == 6 and all(lp < 0 for lp in r.output_logprobs)
        assert r.output_versions == [0] * 6  # from --weight-version 0 via meta_info.weight_version
    # Greedy is deterministic across servers: the same prompt gives the same tokens anywhere.
    again = gen(engine, prompts, max_new_tokens=6, greedy=True)
    assert [r.output_ids for r in again] == [r.output_ids for r in rs]
    engine.destroy()


def test_stop_token_ends_generation_with_stop_reason(model_dir, launch_standins):
    _, (info,) = launch_standins(model_dir)
    engine = SGLangInferenceEngine([info.address])
    (full,) = gen(engine, [[3, 1, 4]], max_new_tokens=10, greedy=True)
    stop_at = full.output_ids[4]
    (r,) = gen(engine, [[3, 1, 4]], max_new_tokens=10, greedy=True, stop_token_ids=[stop_at])
    k = full.output_ids.index(stop_at)
    assert r.stop_reason == StopReason.STOP and r.output_ids == full.output_ids[: k + 1]
    engine.destroy()


def test_retries_transient_server_errors(model_dir, launch_standins):
    _, (info,) = launch_standins(model_dir)
    post_json(f"http://{info.address}/_standin/fail_next", {"n": 2, "status": 503})
    engine = SGLangInferenceEngine([info.address], retries=3, down_probe_s=0.05)
    (r,) = gen(engine, [[9, 9]], max_new_tokens=4, greedy=True)
    assert r.output_len == 4 and engine.stats["failovers"] == 2
    # More failures than retries: a clear error, not a hang.
    post_json(f"http://{info.address}/_standin/fail_next", {"n": 5, "status": 500})
    engine2 = SGLangInferenceEngine([info.address], retries=1, down_probe_s=0.05)
    from areal_kernel.errors import ServerError

    with pytest.raises(ServerError, match="failed 2 times"):
        gen(engine2, [[9, 9]], max_new_tokens=4, greedy=True)
    engine.destroy()
    engine2.destroy()


def test_rejected_body_is_a_clear_error(model_dir, launch_standins):
    """A 4xx from the server (here: the oracle rejecting top_k=0 that a buggy
    protocol would send) is not retried and names the route."""
    from areal_kernel.errors import ServerError

    class Buggy(SGLangProtocol):
        def generate(self, *a, **k):
            call = super().generate(*a, **k)
            call.json["sampling_params"]["top_k"] = 0
            return call

    _, (info,) = launch_standins(model_dir)
    engine = SGLangInferenceEngine([info.address], Buggy())
    with pytest.raises(ServerError, match=r"/generate rejected the request \(HTTP 422\).*top_k"):
        gen(engine, [[1]], max_new_tokens=2, temperature=0.8)  # (greedy would make SGLang ignore top_k)
    engine.destroy()


def test_interrupted_generation_resumes_on_new_weights(model_dir, alt_model_dir, launch_standins):
    _, (info,) = launch_standins(model_dir, extra_env={"AREAL_STANDIN_TOKEN_DELAY_S": "0.01"})
    engine = SGLangInferenceEngine([info.address])
    prompt = [2, 7, 1, 8]
    N = 200
    box = {}

    t = threading.Thread(target=lambda: box.setdefault("r", gen(engine, [prompt], max_new_tokens=N, greedy=True)[0]))
    t.start()
    wait_for_tokens(info.address, 1, 3)
    # What DiskTransport does: pause (abort) -> load new weights with version 1 -> resume.
    engine.pause()
    time.sleep(0.1)
    assert t.is_alive(), "an aborted generation must wait for resume, not return"
    engine.update_weights(WeightUpdateMeta(kind="disk", version=1, path=alt_model_dir))
    engine.resume()
    t.join(60)
    r = box["r"]
    assert r.n_interruptions >= 1 and r.output_len == N and r.stop_reason == StopReason.LENGTH
    n_old = r.output_versions.count(0)
    assert 0 < n_old < N and r.output_versions == [0] * n_old + [1] * (N - n_old)
    # Each part carries the tokens and logprobs of the weights that produced it.
    (fresh,) = gen(engine, [prompt], max_new_tokens=n_old, greedy=True)
    (tail,) = gen(engine, [prompt + r.output_ids[:n_old]], max_new_tokens=N - n_old, greedy=True)
    assert r.output_ids[n_old:] == tail.output_ids and r.output_logprobs[n_old:] == tail.output_logprobs
    assert tail.output_versions == [1] * (N - n_old)
    # The old prefix differs from what the new weights would have produced.
    assert fresh.output_ids != r.output_ids[:n_old]
    # Back on the first weights, the prefix (tokens and logprobs) is reproduced exactly.
    engine.pause()
    engine.update_weights(WeightUpdateMeta(kind="disk", version=2, path=model_dir))
    engine.resume()
    (again,) = gen(engine, [prompt], max_new_tokens=n_old, greedy=True)
    assert again.output_ids == r.output_ids[:n_old] and again.output_logprobs == r.output_logprobs[:n_old]
    engine.destroy()


def test_weight_update_sequence_and_versions_reach_the_server(model_dir, alt_model_dir, launch_standins):
    _, infos = launch_standins(model_dir, n=2)
    engine = SGLangInferenceEngine([i.address for i in infos])
    engine.pause()
    engine.update_weights(WeightUpdateMeta(kind="disk", version=1, path=alt_model_dir))
    engine.resume()
    engine.set_version(2)
    engine.flush_cache()
    engine.release_memory(["kv_cache"])
    engine.resume_memory(["kv_cache"])
    engine.abort()
    assert engine.get_version() == 2
    (r,) = gen(engine, [[4, 4]], max_new_tokens=3, greedy=True)
    assert r.output_versions == [2, 2, 2]  # /update_weight_version reached the server
    for i, info in enumerate(infos):
        st = standin_state(info.address)
        routes = [e["route"] for e in st["log"]]
        assert routes == [
            "/pause_generation",
            "/update_weights_from_disk",
            "/continue_generation",
            "/update_weight_version",
            "/flush_cache",
            "/release_memory_occupation",
            "/resume_memory_occupation",
            "/abort_request",
        ]
        log = {e["route"]: e for e in st["log"]}
        assert log["/update_weights_from_disk"]["paused"] == "abort"  # loaded while paused
        assert log["/update_weights_from_disk"]["body"]["weight_version"] == "1"
        assert log["/update_weight_version"]["body"]["new_version"] == "2"
        assert st["version"] == "2" and st["released"] == []
    engine.destroy()


def test_failover_when_a_server_dies_mid_generation(model_dir, launch_standins):
    _, infos = launch_standins(model_dir, n=2, extra_env={"AREAL_STANDIN_TOKEN_DELAY_S": "0.02"})
    engine = SGLangInferenceEngine([i.address for i in infos], down_probe_s=30)
    box = {}
    t = threading.Thread(
        target=lambda: box.setdefault("rs", gen(engine, [[1, 2], [3, 4]], max_new_tokens=40, greedy=True))
    )
    t.start()
    for info in infos:  # least-loaded put one request on each server
        wait_for_tokens(info.address, 1, 2)
    os.killpg(infos[0].pid, signal.SIGKILL)
    t.join(60)
    rs = box["rs"]
    assert all(r.output_len == 40 for r in rs)
    assert {r.server for r in rs} == {infos[1].address}
    assert engine.stats["failovers"] >= 1
    engine.destroy()


def test_api_key_is_passed_to_the_server_and_sent_by_the_client(model_dir, launch_standins):
    _, (info,) = launch_standins(model_dir, api_key="sk-test")
    from areal_kernel.errors import ServerError

    with pytest.raises(ServerError, match="401"):
        SGLangInferenceEngine([info.address]).flush_cache()
    engine = SGLangInferenceEngine([info.address], admin_token="sk-test")
    engine.flush_cache()
    (r,) = gen(engine, [[5]], max_new_tokens=2, greedy=True)
    assert r.output_len == 2
    engine.destroy()


def test_supervisor_restarts_a_killed_server_with_the_current_weights(model_dir, alt_model_dir, launch_standins):
    """The kernel's supervisor restarts SGLang servers too (the launcher is the
    kernel's SubprocessLauncher): a killed stand-in comes back on its address,
    gets the last disk update replayed (weights and version), and generations
    after the kill complete on it."""
    from areal_kernel.inference.supervisor import ServerSupervisor
    from areal_kernel.testing.waits import wait_until

    lau, (info,) = launch_standins(model_dir)
    engine = SGLangInferenceEngine([info.address], down_probe_s=0.2)
    restarted = []
    sup = ServerSupervisor(
        lau, engine, max_restarts=1, poll_s=0.05, on_restart=lambda a, v: restarted.append((a, v))
    ).start()
    try:
        engine.pause()
        engine.update_weights(WeightUpdateMeta(kind="disk", version=1, path=alt_model_dir))
        engine.resume()
        updated_digest = standin_state(info.address)["digest"]
        (before,) = gen(engine, [[6, 1, 6]], max_new_tokens=5, greedy=True)
        old_pid = lau.servers[0].pid
        os.killpg(old_pid, signal.SIGKILL)
        wait_until(lambda: restarted, timeout_s=60, what="the supervisor to restart the stand-in")
        assert restarted == [(info.address, 1)]
        assert lau.servers[0].address == info.address and lau.servers[0].pid != old_pid
        st = standin_state(info.address)
        assert st["digest"] == updated_digest and st["version"] == "1"
        assert [e["route"] for e in st["log"]] == ["/update_weights_from_disk"]  # the replayed update
        (after,) = gen(engine, [[6, 1, 6]], max_new_tokens=5, greedy=True)
        assert after.output_ids == before.output_ids and after.output_versions == [1] * 5
    finally:
        sup.stop()
        engine.destroy()


def test_a_request_with_images_fails_with_a_clear_error(model_dir, launch_standins):
    """SGLang's protocol here has no ``add_images`` (README: vision-language
    on SGLang is not supported): a request with images is refused by the
    client before anything is sent, naming the protocol, and the engine
    serves the next text request as usual."""
    from areal_kernel.api.io import ImageInputs

    _, (info,) = launch_standins(model_dir)
    engine = SGLangInferenceEngine([info.address], retries=0)
    # Any non-empty file: the refusal comes before an image is ever read.
    req = ModelRequest([1, 2, 3], GenerationConfig(max_new_tokens=4, greedy=True), images=ImageInputs((b"\x89PNG",)))

    async def go():
        try:
            return await engine.agenerate(req)
        finally:
            await engine.aclose(current_loop_only=True)

    with pytest.raises(
        NotImplementedError, match=r"SGLangProtocol does not take images .*serve vision-language models"
    ):
        asyncio.run(go())
    (r,) = gen(engine, [[1, 2, 3]], max_new_tokens=4, greedy=True)
    assert r.output_len == 4 and engine.stats["failovers"] == 0
    engine.destroy()
