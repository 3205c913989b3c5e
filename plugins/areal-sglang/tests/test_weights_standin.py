"""In-memory weight updates (transport ``sglang_broadcast``) into STAND-IN SGLang
servers (sglang_standin.py; no real SGLang runs here). The stand-ins join the
update group for real, through the torch.distributed calls SGLang 0.5.23's
``init_custom_process_group`` makes (tcp:// rendezvous, PrefixStore, torch's
process-group helper; gloo on CPU), and receive each bucket into the layout of
SGLang's ``FlattenedTensorBucket.empty``. Every request body they get is
checked by SGLang's own request classes (the oracle fixture)."""

from __future__ import annotations

import hashlib

import pytest

from areal_sglang.backend import SGLangInferenceEngine
from areal_sglang.weights import SGLangBroadcastTransport, flattened_offsets, plan_flattened_buckets

from sglang_standin import flattened_bucket_empty
from sglang_testutil import standin_state


def _sha(t) -> str:
    import torch

    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _tensors(seed: int):
    """Mixed dtypes and odd sizes, so a dense layout in send order would misalign."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(7, 5, generator=g).to(torch.bfloat16)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(3, 5, generator=g)),
        ("model.norm.weight", torch.randn(3, generator=g).to(torch.bfloat16)),
        ("model.position_ids", torch.randint(-(2**40), 2**40, (2, 3), generator=g, dtype=torch.int64)),
        ("model.layers.0.mlp.gate_proj.weight", torch.randn(1, 3, 3, generator=g)),
        ("model.mask", torch.rand(5, generator=g) > 0.5),
        ("model.layers.0.bias", torch.randn(11, generator=g).to(torch.float16)),
        ("model.empty", torch.empty(0, 4)),
        ("lm_head.weight", torch.randn(9, 7, generator=g)),
    ]


class TensorEngine:
    """A train engine reduced to what transports use: named_weights_for_transfer()."""

    def __init__(self, named):
        self.named = named

    def named_weights_for_transfer(self):
        return list(self.named)


def test_bucket_plan_is_what_flattened_tensor_bucket_accepts():
    from areal_kernel.weights.broadcast import tensor_meta

    meta = tensor_meta(_tensors(0))
    for budget in (1, 40, 64, 100, 1 << 20):
        buckets = plan_flattened_buckets(meta, budget)
        assert sorted(i for b in buckets for i in b) == list(range(len(meta)))  # each tensor exactly once
        for b in buckets:
            bm = [meta[i] for i in b]
            offsets, size = flattened_offsets(bm)
            # The stand-in's copy of FlattenedTensorBucket.empty agrees on every offset and the size.
            flat, spans = flattened_bucket_empty(
                [m["name"] for m in bm], [m["dtype"] for m in bm], [m["shape"] for m in bm]
            )
            assert [s[3] for s in spans] == offsets and flat.numel() == size
    assert len(plan_flattened_buckets(meta, 1 << 20)) == 1
    # Send order (bf16 first, then fp32 at byte 70) is what SGLang would refuse.
    with pytest.raises(Exception, match="itemsize"):
        flattened_offsets(meta[:2])
    with pytest.raises(Exception, match="Unaligned"):
        flattened_bucket_empty(
            [m["name"] for m in meta[:2]], [m["dtype"] for m in meta[:2]], [m["shape"] for m in meta[:2]]
        )


@pytest.mark.slow
def test_broadcast_updates_arrive_bit_exact_on_two_servers(model_dir, launch_standins, tmp_path):
    _, infos = launch_standins(model_dir, n=2)
    engine = SGLangInferenceEngine([i.address for i in infos])
    train = TensorEngine(_tensors(1))
    transport = SGLangBroadcastTransport(train, engine, str(tmp_path), bucket_bytes=96, timeout_s=60)
    transport.setup()
    for i, info in enumerate(infos):
        grp = standin_state(info.address)["groups"]["areal_weights"]
        assert (grp["rank_offset"], grp["world_size"], grp["backend"]) == (1 + i, 3, "gloo")

    stats = transport.update(1)
    n_buckets = int(stats["weights/buckets"])
    assert n_buckets > 2
    expect = {n: _sha(t) for n, t in train.named}
    for info in infos:
        st = standin_state(info.address)
        assert st["received"] == expect
        assert st["version"] == "1" and st["session"] is False and st["paused"] is None
        routes = [e["route"] for e in st["log"]]
        assert routes == (
            ["/init_weights_update_group", "/pause_generation", "/begin_weight_update"]
            + ["/update_weights_from_distributed"] * n_buckets
            + ["/end_weight_update", "/continue_generation"]
        )
        updates = [e for e in st["log"] if e["route"] == "/update_weights_from_distributed"]
        assert all(e["paused"] == "abort" and e["body"]["load_format"] == "flattened_bucket" for e in updates)
        # Only the last bucket sets the version (as a string) and flushes the cache.
        assert [e["body"].get("weight_version") for e in updates] == [None] * (n_buckets - 1) + ["1"]
        assert [e["body"]["flush_cache"] for e in updates] == [False] * (n_buckets - 1) + [True]
    assert engine.get_version() == 1

    # New values, a second update on the same group: the servers follow.
    train.named = _tensors(2)
    transport.update(2)
    expect2 = {n: _sha(t) for n, t in train.named}
    assert expect2 != expect
    for info in infos:
        st = standin_state(info.address)
        assert st["received"] == expect2 and st["version"] == "2"
    assert engine.get_version() == 2

    transport.close()
    for info in infos:
        st = standin_state(info.address)
        assert st["groups"] == {} and st["log"][-1]["route"] == "/destroy_weights_update_group"
    engine.destroy()


class OracleBackedEngine(SGLangInferenceEngine):
    """The plugin's client, with each control call's body checked by SGLang's
    request classes and the weight-group calls executed by SGLang's own
    ``WeightUpdater`` in the oracle process (see sglang_oracle.WeightReceiver)."""

    def __init__(self, oracle_url: str) -> None:
        super().__init__([oracle_url.removeprefix("http://")])
        self.oracle_url = oracle_url
        self.routes: list[str] = []
        self.received: dict[str, str] = {}

    def control(self, address, op):
        from areal_kernel.inference.wire import control_calls

        for call in control_calls(op):
            res = self._oracle_call(call)
        return res

    def _oracle_call(self, call):
        from sglang_testutil import post_json

        check = post_json(self.oracle_url + "/check_request", {"route": call.path, "body": call.json or {}})
        assert check["ok"], check
        self.routes.append(call.path)
        b = call.json or {}
        if call.path == "/init_weights_update_group":
            res = post_json(self.oracle_url + "/sglang_weights/init", b, timeout=120)
        elif call.path == "/update_weights_from_distributed":
            res = post_json(self.oracle_url + "/sglang_weights/receive", b, timeout=120)
            self.received.update(res.get("checksums", {}))
        elif call.path == "/destroy_weights_update_group":
            res = post_json(self.oracle_url + "/sglang_weights/destroy", b, timeout=120)
        else:  # pause / begin / end / continue: nothing to do without a model
            res = {"success": True, "message": "Success"}
        return res


@pytest.mark.slow
def test_sglang_own_weight_updater_receives_our_buckets_bit_exact(oracle_url, tmp_path):
    """SGLang's real init_weights_update_group (init_custom_process_group) and
    receive_weights_from_distributed (FlattenedTensorBucket.empty + broadcast)
    against this transport, over real gloo."""
    engine = OracleBackedEngine(oracle_url)
    train = TensorEngine(_tensors(3))
    transport = SGLangBroadcastTransport(train, engine, str(tmp_path), bucket_bytes=96, timeout_s=120)
    transport.setup()
    stats = transport.update(7)
    assert engine.received == {n: _sha(t) for n, t in train.named}
    n = int(stats["weights/buckets"])
    assert engine.routes == (
        ["/init_weights_update_group", "/pause_generation", "/begin_weight_update"]
        + ["/update_weights_from_distributed"] * n
        + ["/end_weight_update", "/continue_generation"]
    )
    assert engine.get_version() == 7
    transport.close()
    assert engine.routes[-1] == "/destroy_weights_update_group"
    engine.destroy()


def test_a_server_failing_a_bucket_stops_the_update_with_its_error(tmp_path):
    """No servers needed: a client whose bucket call fails at once (as an HTTP
    400 would) and a group whose broadcast never completes (a stand-in for a
    collective that lost a rank). The update must raise, not wait for it."""
    import concurrent.futures

    from areal_kernel.errors import ArealError, ServerError
    from areal_kernel.weights.broadcast import WeightGroup

    calls = []

    class Infer:
        servers, tp_size = [], 1

        def __getattr__(self, name):
            return lambda *a, **k: calls.append(name)

        def update_bucket_async(self, *a):
            calls.append("bucket")
            f = concurrent.futures.Future()
            f.set_exception(ServerError("127.0.0.1:1/update_weights_from_distributed answered HTTP 400: Unaligned"))
            return [f]

    class NeverDone:
        def broadcast(self, tensors, opts):
            return self

        def wait(self):
            raise AssertionError("the update waited for a collective that cannot complete")

    t = SGLangBroadcastTransport(TensorEngine(_tensors(4)), Infer(), str(tmp_path), bucket_bytes=1 << 20)
    t.group = WeightGroup(NeverDone(), None, 0, 2, "areal_weights", "gloo")
    with pytest.raises(ServerError, match="Unaligned"):
        t.update(1)
    assert calls == ["pause", "begin_weight_update", "bucket", "end_weight_update", "resume"]
    with pytest.raises(ArealError, match="a previous update failed"):
        t.update(2)
