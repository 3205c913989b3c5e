"""The weight-delivery check (monitor.weights) against real embedded server
processes over HTTP: the torch train engine's weights sent by disk (full
weights and a LoRA adapter), the client's ``weight_fingerprints``, and the
trainer-side comparison. Each passing check has a negative control: a server
left on other weights is named with the tensor and the version."""

from __future__ import annotations


import pytest

from areal_kernel.api.engine import WeightUpdateMeta
from areal_kernel.monitor.weights import WeightDeliveryError, WeightsMonitor

from trained_engine import toy_batch as _batch, toy_loss as _loss, trained_engine as _engine

def _client(addresses: list[str], token: str | None):
    from areal_kernel.inference.client import RemoteInferenceEngine
    from areal_kernel.inference.embedded.backend import EmbeddedProtocol

    return RemoteInferenceEngine(addresses, EmbeddedProtocol(), admin_token=token)


def _monitor(said: list[str], action: str = "error", per_update: int = 1000) -> WeightsMonitor:
    return WeightsMonitor(action=action, tensors_per_update=per_update, elements_per_tensor=64, warn=said.append)


def test_disk_update_checks_clean_and_a_stale_server_is_named(servers, tiny_model_dir, tmp_path):
    client = _client([s.address for s in servers], servers[0].token)
    eng = _engine(tiny_model_dir, steps=2, seed=5)
    n = len(eng.named_weights_for_transfer())
    # The engine reads its sample from the live parameters: the same values as the transfer list's.
    from areal_kernel.monitor.weights import plan, sample_named

    named = eng.named_weights_for_transfer()
    pos = plan([(k, t.numel()) for k, t in named], 0, 1000, 16).positions
    direct, listed = eng.weight_sample(pos), sample_named(named, pos)
    assert direct.keys() == listed.keys() and all(direct[k].equal(listed[k]) for k in pos)
    version = max(s.info()["weight_version"] for s in servers) + 1
    path = str(tmp_path / "v")
    eng.send_weights(WeightUpdateMeta(kind="disk", version=version, path=path))
    try:
        client.update_weights(WeightUpdateMeta(kind="disk", version=version, path=path))
        said: list[str] = []
        mon = _monitor(said)
        out = mon.check(version, eng, client)
        assert out["weights_mismatch"] == 0 and out["weights_checked"] == 2 * n and out["weights_servers"] == 2
        mon.raise_if_alarmed()
        assert said == []
        # Negative control: server 1 is put back on the initial weights under
        # the same version (an update that "landed" with the wrong bytes).
        stale = servers[1]
        stale.ok("/update_weights_from_disk", {"path": tiny_model_dir, "version": version})
        out = mon.check(version, eng, client)
        assert out["weights_mismatch"] == n, out  # every trained tensor differs, on that server only
        with pytest.raises(WeightDeliveryError) as e:
            mon.raise_if_alarmed()
        msg = str(e.value)
        assert f"failed at version {version}: server {stale.address}: tensor 'model." in msg, msg
        assert servers[0].address not in msg
        assert {m.server for m in mon.mismatches} == {stale.address}
        # A server that reports another version is named too.
        stale.ok("/update_weights_from_disk", {"path": path, "version": version - 1})
        out = mon.check(version, eng, client)
        assert out["weights_mismatch"] == 1
        assert "reports serving weight version" in str(mon.mismatches[-1])
        mon.pending = None
    finally:
        for s in servers:
            s.ok("/update_weights_from_disk", {"path": tiny_model_dir, "version": version + 1})
        client.destroy()
        eng.destroy()


def test_adapter_update_is_checked_on_the_adapter_tensors(servers, tiny_model_dir, tmp_path):
    client = _client([servers[0].address], servers[0].token)
    eng = _engine(tiny_model_dir, {"name": "fp-a", "rank": 4, "alpha": 8}, steps=2, seed=6)
    other = _engine(tiny_model_dir, {"name": "fp-a", "rank": 4, "alpha": 8}, steps=2, seed=7)
    try:
        for e, version in ((eng, 1), (other, 2)):
            path = str(tmp_path / f"a{version}")
            e.send_weights(WeightUpdateMeta(kind="disk", version=version, path=path, adapter="fp-a"))
        client.load_adapter("fp-a", str(tmp_path / "a1"), 1)
        said: list[str] = []
        mon = _monitor(said)
        n = len(eng.named_weights_for_transfer())
        out = mon.check(1, eng, client)
        assert out["weights_mismatch"] == 0 and out["weights_checked"] == n > 0, out
        # Negative control: the server got another adapter's tensors under the same name and version.
        servers[0].ok("/load_adapter", {"name": "fp-a", "path": str(tmp_path / "a2"), "version": 1})
        out = mon.check(1, eng, client)
        assert out["weights_mismatch"] > 0
        assert all(".lora_" in m.tensor for m in mon.mismatches)
        # An adapter the server does not serve: every tensor is missing.
        client.unload_adapter("fp-a")
        mon.check(1, eng, client)
        assert "no tensor of this name" in str(mon.mismatches[-1])
    finally:
        servers[0].call("/unload_adapter", {"name": "fp-a"})
        client.destroy()
        for e in (eng, other):
            e.destroy()


def test_fingerprint_route_is_guarded_and_validates_its_body(servers, client_for):
    s = servers[0]
    body = {"version": 0, "tensors": [{"name": "model.norm.weight", "positions": [0, 3]}]}
    assert client_for(s.address, token=None).call("/weight_fingerprint", body)[0] == 401
    out = s.ok("/weight_fingerprint", body)
    assert out["tensors"]["model.norm.weight"]["n"] == 2 and out["missing"] == []
    status, err = s.call("/weight_fingerprint", {"version": 0, "tensors": [{"name": "x", "positions": "all"}]})
    assert status == 400 and "tensors[0].positions" in err["error"]
    status, out = s.call("/weight_fingerprint", {"version": 0, "tensors": [{"name": "model.nope", "positions": [0]}]})
    assert status == 200 and out["missing"] == ["model.nope"]


@pytest.fixture(scope="module")
def bf16_server(tiny_model_dir, tmp_path_factory):
    from areal_kernel.inference.embedded.launcher import EmbeddedLauncher, EmbeddedServerConfig

    cfg = EmbeddedServerConfig(dtype="bfloat16")
    launcher = EmbeddedLauncher(cfg, run_dir=str(tmp_path_factory.mktemp("bf16-run")))
    try:
        (info,) = launcher.launch(tiny_model_dir, n_servers=1, devices_per_server=0)
        yield info.address
    finally:
        launcher.stop()


def test_server_in_bfloat16_compares_exactly_with_float32_trainer(bf16_server, tiny_model_dir, tmp_path):
    # The trainer holds float32; the server rounds each value to bfloat16 on
    # load. The check casts the trainer's sample the same way: equal, exactly.
    client = _client([bf16_server], None)
    eng = _engine(tiny_model_dir, steps=1, seed=8)
    try:
        path = str(tmp_path / "v1")
        eng.send_weights(WeightUpdateMeta(kind="disk", version=1, path=path))
        client.update_weights(WeightUpdateMeta(kind="disk", version=1, path=path))
        said: list[str] = []
        mon = _monitor(said)
        out = mon.check(1, eng, client)
        assert out["weights_mismatch"] == 0 and out["weights_checked"] > 0, mon.mismatches
        # Negative control: one more training step changes the trainer's
        # weights by less than bfloat16 resolves in many elements, yet the
        # sampled elements that changed their rounding are seen.
        eng.train_batch(_batch(99), _loss)
        out = mon.check(1, eng, client)
        assert out["weights_mismatch"] > 0
        assert "after casting the trainer's float32" in str(mon.mismatches[0])
    finally:
        client.destroy()
        eng.destroy()


def test_a_busy_engine_thread_does_not_hold_the_fingerprint_and_a_load_does(tiny_model_dir):
    """The route answers while the engine thread is busy (a long generation
    step on a loaded server; here a command that holds it), and never in the
    middle of a load: a fingerprint asked during a load answers after it,
    with the new version. The real server app over loopback HTTP, in this
    process so the test can hold its engine thread. Negative control, run by
    hand: with the fingerprint computed on the engine thread (as before),
    the first part times out."""
    import asyncio
    import threading

    from aiohttp import ClientSession
    from aiohttp.test_utils import TestServer

    from areal_kernel.inference.embedded import server as S

    args = S.parse_args(["--model", tiny_model_dir, "--port", "0"])
    state = S.ServerState(args)
    S.load(args, state)
    engine = state.engine
    body = {"version": 0, "tensors": [{"name": "model.norm.weight", "positions": [0, 1]}]}

    async def scenario() -> None:
        srv = TestServer(S.build_app(state), host="127.0.0.1")
        await srv.start_server()
        try:
            async with ClientSession() as http:

                async def ask() -> dict:
                    async with http.post(str(srv.make_url("/weight_fingerprint")), json=body) as r:
                        assert r.status == 200, await r.text()
                        return await r.json()

                release = threading.Event()
                busy = engine.call(lambda: release.wait(60))
                out = await asyncio.wait_for(ask(), 30)
                assert out["version"] == 0 and out["tensors"]["model.norm.weight"]["n"] == 2
                assert not busy.done(), "answered only once the engine thread was free"
                release.set()
                busy.result(30)

                loading, finish = threading.Event(), threading.Event()

                def slow_load() -> None:
                    loading.set()
                    finish.wait(60)

                update = engine.update_weights(slow_load, 7)
                assert await asyncio.to_thread(loading.wait, 30)
                asked = asyncio.create_task(ask())
                await asyncio.sleep(0.5)
                assert not asked.done(), "a fingerprint answered in the middle of a load"
                finish.set()
                assert (await asyncio.wait_for(asked, 30))["version"] == 7
                assert update.result(30)["version"] == 7
        finally:
            await srv.close()

    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()
