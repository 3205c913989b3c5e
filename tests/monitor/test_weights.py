"""The weight-delivery fingerprint (areal_kernel.monitor.weights): the sample
plan (deterministic, rotating, covering every tensor), the checksum
(exact on identical bytes, sensitive to one bit of one sampled element), the
trainer-side comparison (dtype conversion on the server, missing tensors,
shapes, stale versions) and the monitor's actions. The route on a real
embedded server is in tests/inference/test_weight_fingerprint.py; a run whose
update is corrupted in transit in tests/faults/test_run_faults.py."""

from __future__ import annotations

import pytest
import torch

from areal_kernel.monitor.weights import (
    FingerprintSpec,
    WeightDeliveryError,
    WeightsMonitor,
    checksum,
    compare,
    fingerprint,
    plan,
    rotation_period,
    sample,
    sample_named,
)


def _model(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {f"model.layers.{i}.{n}.weight": s for i in range(5) for n, s in (("q", (8, 16)), ("mlp", (16, 4)))}
    shapes.update({"model.norm.weight": (16,), "model.embed_tokens.weight": (50, 16)})
    return {n: torch.randn(s, generator=g).to(dtype) for n, s in shapes.items()}


def _numels(model: dict[str, torch.Tensor]) -> list[tuple[str, int]]:
    return [(n, t.numel()) for n, t in model.items()]


def _check(trainer: dict, server: dict, spec: FingerprintSpec, served_version: int | None = None):
    sent = sample_named(trainer.items(), spec.positions)
    reply = fingerprint(server, spec, spec.version if served_version is None else served_version)
    return compare(sent, {n: t.numel() for n, t in trainer.items()}, spec, "srv:1", reply)


def test_plan_is_deterministic_and_keyed_by_version():
    m = _numels(_model())
    a, b = plan(m, 3, 4, 16), plan(m, 3, 4, 16)
    assert a == b
    assert len(a.positions) == 4 and all(len(p) == 16 for p in a.positions.values())  # 12 tensors, 3 chunks
    assert all(p == sorted(set(p)) for p in a.positions.values())  # distinct, in range
    assert all(max(p) < dict(m)[n] for n, p in a.positions.items())
    c = plan(m, 4, 4, 16)
    assert set(c.positions) != set(a.positions)  # another chunk of tensors
    # The same tensor at another version gets other positions.
    k = rotation_period(len(m), 4)
    d = plan(m, 3 + k, 4, 16)
    assert set(d.positions) == set(a.positions) and d.positions != a.positions
    # A small tensor is read whole.
    assert plan([("x", 5)], 0, 1, 16).positions == {"x": [0, 1, 2, 3, 4]}


@pytest.mark.parametrize("per_update", [1, 3, 4, 12, 100])
def test_rotation_covers_every_tensor_within_k_versions(per_update):
    m = _numels(_model())
    k = rotation_period(len(m), per_update)
    assert k == -(-len(m) // per_update)
    for start in (0, 5, 17):  # any K consecutive versions, not only 0..K-1
        seen = set()
        for v in range(start, start + k):
            seen.update(plan(m, v, per_update, 8).positions)
        assert seen == set(dict(m)), (start, set(dict(m)) - seen)
    # Negative control: K - 1 versions miss some tensor whenever K > 1.
    if k > 1:
        seen = set()
        for v in range(k - 1):
            seen.update(plan(m, v, per_update, 8).positions)
        assert seen != set(dict(m))


def test_identical_weights_compare_equal_and_json_round_trips():
    trainer, server = _model(), {k: v.clone() for k, v in _model().items()}
    for v in range(4):
        spec = FingerprintSpec.from_json(plan(_numels(trainer), v, 5, 32).to_json())
        checked, bad = _check(trainer, server, spec)
        assert checked == len(spec.positions) == 4 and bad == [], bad  # 12 tensors in 3 chunks


def test_one_bit_of_one_sampled_element_is_detected_and_named():
    trainer = _model()
    spec = plan(_numels(trainer), 2, 4, 8)
    name, pos = next(iter(spec.positions.items()))
    for flip in (1, 1 << 22):  # the lowest mantissa bit, and a high one
        server = {k: v.clone() for k, v in trainer.items()}
        flat = server[name].view(-1)
        flat.view(torch.int32)[pos[3]] ^= flip
        checked, bad = _check(trainer, server, spec)
        assert checked == 4
        assert [(m.server, m.tensor, m.version) for m in bad] == [("srv:1", name, 2)], bad
        assert "differs from what the trainer sent" in bad[0].detail
    # Control: the same change at an element the spec does not sample passes (the sample is a sample).
    server = {k: v.clone() for k, v in trainer.items()}
    unsampled = next(i for i in range(server[name].numel()) if i not in pos)
    server[name].view(-1)[unsampled] += 1.0
    assert _check(trainer, server, spec)[1] == []


def test_swapped_elements_are_detected():
    # The plain bit sum is order-free; the position-weighted one is not.
    trainer = _model()
    spec = plan(_numels(trainer), 0, 1, 8)
    name, pos = next(iter(spec.positions.items()))
    server = {k: v.clone() for k, v in trainer.items()}
    flat = server[name].view(-1)
    a, b = flat[pos[0]].item(), flat[pos[1]].item()
    flat[pos[0]], flat[pos[1]] = b, a
    assert checksum(sample(server[name], pos))["bits"] == checksum(sample(trainer[name], pos))["bits"]
    assert [m.tensor for m in _check(trainer, server, spec)[1]] == [name]


@pytest.mark.parametrize("served", [torch.bfloat16, torch.float16])
def test_server_holding_another_dtype_compares_exactly(served):
    # The server loads float32 weights into `served` (one rounding, as
    # Tensor.copy_ does); the trainer casts its sample the same way.
    trainer = _model()
    server = {}
    for k, v in trainer.items():
        dst = torch.empty(v.shape, dtype=served)
        dst.copy_(v)
        server[k] = dst
    spec = plan(_numels(trainer), 1, 100, 64)
    checked, bad = _check(trainer, server, spec)
    assert checked == len(trainer) and bad == [], bad
    # One ulp of the served dtype in one sampled element is still detected.
    name, pos = next(iter(spec.positions.items()))
    server[name].view(-1).view(torch.int16)[pos[0]] ^= 1
    assert [m.tensor for m in _check(trainer, server, spec)[1]] == [name]


@pytest.mark.parametrize("factor", [2.0, 0.75, 1 / 3])
def test_a_server_holding_scaled_values_compares_exactly_when_it_says_so(factor):
    # vLLM holds a LoRA adapter's lora_B multiplied by its scaling (in place,
    # in its dtype) and says so with "scale"; the trainer multiplies the same way.
    trainer = _model()
    server = {k: v.clone() for k, v in trainer.items()}
    name = "model.layers.2.mlp.weight"
    server[name] *= factor
    spec = plan(_numels(trainer), 3, 100, 16)
    sent = sample_named(trainer.items(), spec.positions)
    numels = {n: t.numel() for n, t in trainer.items()}
    reply = fingerprint(server, spec, 3)
    # Control: without the server's word the scaled tensor differs.
    assert [m.tensor for m in compare(sent, numels, spec, "srv", reply)[1]] == [name]
    reply["tensors"][name]["scale"] = factor
    checked, bad = compare(sent, numels, spec, "srv", reply)
    assert checked == len(trainer) and bad == [], bad
    # One ulp off in the scaled values is still a mismatch.
    pos = spec.positions[name]
    server[name].view(-1).view(torch.int32)[pos[0]] ^= 1
    reply = fingerprint(server, spec, 3)
    reply["tensors"][name]["scale"] = factor
    assert [m.tensor for m in compare(sent, numels, spec, "srv", reply)[1]] == [name]
    reply["tensors"][name]["scale"] = "2"
    assert "non-numeric scale" in compare(sent, numels, spec, "srv", reply)[1][0].detail


def test_missing_tensor_wrong_size_and_stale_version_are_named():
    trainer = _model()
    spec = plan(_numels(trainer), 7, 100, 4)
    server = {k: v.clone() for k, v in trainer.items()}
    del server["model.norm.weight"]
    server["model.layers.0.q.weight"] = torch.zeros(4, 4)
    _, bad = _check(trainer, server, spec, served_version=6)
    by_tensor = {m.tensor: m.detail for m in bad}
    assert "no tensor of this name" in by_tensor["model.norm.weight"]
    assert "16 elements on the server, 128 sent" in by_tensor["model.layers.0.q.weight"]
    assert "version 6" in by_tensor["*"]
    assert all(m.version == 7 for m in bad)


def test_spec_parsing_names_bad_fields():
    with pytest.raises(Exception, match="'version'"):
        FingerprintSpec.from_json({"tensors": []})
    with pytest.raises(Exception, match=r"tensors\[0\].positions"):
        FingerprintSpec.from_json({"version": 1, "tensors": [{"name": "a", "positions": [-1]}]})


class _Engine:
    """A train engine and a client over in-process tables."""

    def __init__(self, trainer: dict, servers: dict[str, dict]) -> None:
        self.trainer, self.servers = trainer, servers
        self.version = 0

    def adapter_spec(self):
        return None

    def named_weights_for_transfer(self):
        return list(self.trainer.items())

    def weight_sample(self, positions):
        return sample_named(self.trainer.items(), positions)

    def weight_fingerprints(self, spec):
        s = FingerprintSpec.from_json(spec)
        return {a: fingerprint(t, s, self.version) for a, t in self.servers.items()}, {}


def test_monitor_error_names_server_tensor_and_version_and_warn_goes_on():
    trainer = _model()
    good = {k: v.clone() for k, v in trainer.items()}
    bad = {k: v.clone() for k, v in trainer.items()}
    bad["model.layers.3.mlp.weight"].mul_(-1)
    eng = _Engine(trainer, {"127.0.0.1:1": good, "127.0.0.1:2": bad})
    mon = WeightsMonitor(action="error", tensors_per_update=4, elements_per_tensor=8, warn=lambda m: None)
    k = rotation_period(len(trainer), 4)
    fired_at = None
    for v in range(1, k + 1):
        eng.version = v
        out = mon.check(v, eng, eng)
        assert out["weights_checked"] == 8 and out["weights_servers"] == 2
        if out["weights_mismatch"]:
            with pytest.raises(WeightDeliveryError) as e:
                mon.raise_if_alarmed()
            fired_at = v
            break
        mon.raise_if_alarmed()  # nothing pending
    assert fired_at is not None, "the rotation never checked the corrupted tensor"
    msg = str(e.value)
    assert f"at version {fired_at}" in msg and "server 127.0.0.1:2" in msg
    assert "'model.layers.3.mlp.weight'" in msg and "127.0.0.1:1" not in msg
    # warn: the same finding is a warning and nothing is raised.
    said: list[str] = []
    warn = WeightsMonitor(action="warn", tensors_per_update=4, elements_per_tensor=8, warn=said.append)
    eng.version = fired_at
    assert warn.check(fired_at, eng, eng)["weights_mismatch"] == 1
    warn.raise_if_alarmed()
    assert len(said) == 1 and said[0].startswith("warning: weight delivery check failed")
    # off: nothing is checked.
    assert WeightsMonitor(action="off").check(fired_at, eng, eng) == {}


def test_monitor_skips_with_one_note_when_a_side_cannot_fingerprint():
    class NoRoute(_Engine):
        def weight_fingerprints(self, spec):
            raise NotImplementedError("the servers have no weight fingerprint route")

    said: list[str] = []
    eng = NoRoute(_model(), {})
    mon = WeightsMonitor(warn=said.append)
    assert mon.check(1, eng, eng) == {} and mon.check(2, eng, eng) == {}
    assert len(said) == 1 and "skipped" in said[0] and "no weight fingerprint route" in said[0]

    meta = {k: torch.empty(v.shape, device="meta") for k, v in _model().items()}
    with pytest.raises(NotImplementedError, match="meta"):
        sample_named(meta.items(), {"model.norm.weight": [0]})


def test_tensors_a_server_cannot_read_back_are_left_out_and_the_rest_still_checked():
    """A server that holds some tensors in another form (vLLM on CPU repacks
    linear weights and frees the plain ones) lists them as ``unreadable``:
    they are not compared, said once, and left out of later plans, while a
    corrupted readable tensor is still caught. Nothing readable: skipped."""

    class Repacking(_Engine):
        def weight_fingerprints(self, spec):
            s = FingerprintSpec.from_json(spec)
            out = {}
            for a, table in self.servers.items():
                readable = {n: t for n, t in table.items() if ".q." not in n}
                reply = fingerprint(readable, s, self.version)
                reply["unreadable"] = [n for n in s.positions if ".q." in n]
                reply["missing"] = [n for n in reply["missing"] if n not in reply["unreadable"]]
                out[a] = reply
            return out, {}

    trainer = _model()
    bad = {k: v.clone() for k, v in trainer.items()}
    bad["model.layers.2.mlp.weight"].add_(1.0)
    said: list[str] = []
    eng = Repacking(trainer, {"127.0.0.1:1": bad})
    mon = WeightsMonitor(action="warn", tensors_per_update=4, elements_per_tensor=8, warn=said.append)
    caught = False
    for v in range(1, 2 * rotation_period(len(trainer), 4) + 1):
        eng.version = v
        known = set(mon.unreadable)
        out = mon.check(v, eng, eng)
        spec = plan([t for t in _numels(trainer) if t[0] not in known], v, 4, 8)
        assert not set(spec.positions) & known  # once known, never planned again
        # Every planned readable tensor was compared; the unreadable ones were not.
        assert out["weights_checked"] == sum(1 for n in spec.positions if ".q." not in n)
        caught = caught or out["weights_mismatch"] > 0
    assert mon.unreadable and mon.unreadable <= {n for n in trainer if ".q." in n}
    assert caught, "the corrupted readable tensor was never checked"
    notes = [m for m in said if m.startswith("note: weight-delivery check: server 127.0.0.1:1 cannot read back")]
    failures = [m for m in said if m.startswith("warning: weight delivery check failed")]
    assert notes and len(notes) + len(failures) == len(said), said
    assert all("model.layers.2.mlp.weight" in m for m in failures), failures  # never an unreadable tensor

    # A server that can read none of them: the check says so and stops.
    class Opaque(_Engine):
        def weight_fingerprints(self, spec):
            s = FingerprintSpec.from_json(spec)
            return {"127.0.0.1:1": {"version": self.version, "tensors": {}, "missing": [],
                                    "unreadable": list(s.positions)}}, {}  # fmt: skip

    said2: list[str] = []
    opaque = Opaque(trainer, {})
    mon2 = WeightsMonitor(tensors_per_update=len(trainer), warn=said2.append)
    assert mon2.check(1, opaque, opaque)["weights_checked"] == 0
    assert mon2.skipped is not None and mon2.check(2, opaque, opaque) == {}
    assert any("skipped" in m and "read back none" in m for m in said2), said2


def test_prefix_keeps_positions_among_the_first_elements_and_shapes_travel():
    model = _model()
    shapes = {n: list(t.shape) for n, t in model.items()}
    spec = plan(_numels(model), 3, 100, 16, shapes=shapes, within=20)
    assert all(max(p) < 20 and len(p) == 16 for p in spec.positions.values())
    back = FingerprintSpec.from_json(spec.to_json())
    assert back == spec and back.shapes["model.embed_tokens.weight"] == [50, 16]
    # Negative control: without the prefix, positions spread over the tensor.
    assert max(max(p) for p in plan(_numels(model), 3, 100, 16).positions.values()) >= 20


def test_batched_checksums_equal_one_at_a_time():
    # The servers' batched fingerprint and a backend's per-tensor one (SGLang's parse) must agree.
    from areal_kernel.monitor.weights import checksums

    g = torch.Generator().manual_seed(3)
    vals = [
        torch.randn(64, generator=g),
        torch.randn(5, generator=g).to(torch.bfloat16),
        torch.randn(64, generator=g),
        torch.randint(-(2**40), 2**40, (7,), generator=g),
        torch.rand(9, generator=g) > 0.5,
    ]
    assert checksums(vals, [100, 5, None, 7, 9]) == [checksum(v, n) for v, n in zip(vals, [100, 5, None, 7, 9])]
    # Negative control: another order of the same values gives another position-weighted sum.
    assert checksums([vals[0].flip(0)])[0]["wbits"] != checksum(vals[0])["wbits"]
