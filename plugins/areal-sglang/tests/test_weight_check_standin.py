"""The weight-delivery check (monitor.weights) against STAND-IN SGLang servers
(sglang_standin.py) through SGLang's own ``/get_weights_by_name`` route (its
body checked by SGLang's request class, the oracle fixture): weights sent by
disk and by broadcast to servers holding bfloat16 compare exactly; a server
left on other weights is named with the tensor and the version."""

from __future__ import annotations

import pytest

from areal_kernel.api.engine import WeightUpdateMeta
from areal_kernel.monitor.weights import NamedWeights, WeightDeliveryError, WeightsMonitor
from areal_sglang.backend import SGLangInferenceEngine
from areal_sglang.protocol import SGLangProtocol
from areal_sglang.weights import SGLangBroadcastTransport

pytestmark = pytest.mark.slow


def _tensors(seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(40, 96, generator=g)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(96, 96, generator=g)),
        ("model.layers.0.mlp.down_proj.weight", torch.randn(96, 128, generator=g)),
        ("model.norm.weight", torch.randn(96, generator=g)),
        ("lm_head.weight", torch.randn(40, 96, generator=g)),
    ]


def _monitor() -> WeightsMonitor:
    return WeightsMonitor(action="error", tensors_per_update=100, elements_per_tensor=64, warn=print)


def test_disk_update_checks_exactly_and_a_server_on_old_weights_is_named(model_dir, launch_standins, tmp_path):
    from areal_kernel.weights.disk import save_state_dict_dir

    _, infos = launch_standins(model_dir, n=2, dtype="bfloat16")
    client = SGLangInferenceEngine([i.address for i in infos], SGLangProtocol(dtype="bfloat16"))
    train = NamedWeights(_tensors(1))
    v1 = str(tmp_path / "v1")
    save_state_dict_dir(train.named, v1)
    client.update_weights(WeightUpdateMeta(kind="disk", version=1, path=v1))
    mon = _monitor()
    out = mon.check(1, train, client)
    assert out["weights_mismatch"] == 0 and out["weights_checked"] == 2 * 5 and out["weights_servers"] == 2
    mon.raise_if_alarmed()
    # Positions lie in the first 64 elements: one row of each 2-D weight.
    # Negative control: version 2 reaches server 0 only; server 1 keeps version 1's bytes.
    train.named = _tensors(2)
    v2 = str(tmp_path / "v2")
    save_state_dict_dir(train.named, v2)
    client.control(infos[0].address, client.protocol.update_weights_from_disk(v2, 2))
    client.control(infos[1].address, client.protocol.update_weights_from_disk(v1, 2))
    out = mon.check(2, train, client)
    assert out["weights_mismatch"] == 5, mon.mismatches
    assert {m.server for m in mon.mismatches} == {infos[1].address}
    with pytest.raises(WeightDeliveryError, match=f"at version 2: server {infos[1].address}: tensor 'model"):
        mon.raise_if_alarmed()
    client.destroy()


def test_broadcast_update_checks_exactly(model_dir, launch_standins, tmp_path):
    _, infos = launch_standins(model_dir, n=1, dtype="bfloat16")
    client = SGLangInferenceEngine([i.address for i in infos], SGLangProtocol(dtype="bfloat16"))
    train = NamedWeights(_tensors(3))
    transport = SGLangBroadcastTransport(train, client, str(tmp_path), bucket_bytes=1 << 16, timeout_s=60)
    transport.setup()
    transport.update(1)
    mon = _monitor()
    out = mon.check(1, train, client)
    assert out["weights_mismatch"] == 0 and out["weights_checked"] == 5, mon.mismatches
    # Negative control: one element of one sampled position changes by one bfloat16 ulp on the trainer side.
    spec_tensor = "model.layers.0.mlp.down_proj.weight"
    import torch

    t = dict(train.named)[spec_tensor]
    t.view(-1)[:64] = (t.view(-1)[:64].to(torch.bfloat16).view(torch.int16) + 1).view(torch.bfloat16).float()
    out = mon.check(1, train, client)
    assert [m.tensor for m in mon.mismatches] == [spec_tensor], mon.mismatches
    mon.pending = None
    transport.close()
    client.destroy()


# -- LoRA adapters: the directory each server serves (GET /v1/models) ----------------

ADAPTER = "policy"


class _AdapterWeights(NamedWeights):
    """The trainer side of an adapter check: the adapter's tensors under
    peft's names, and the adapter's name (what a train engine's
    ``adapter_spec`` gives the monitor)."""

    def adapter_spec(self):  # type: ignore[override]
        from types import SimpleNamespace

        return SimpleNamespace(name=ADAPTER)


def _adapter_tensors(seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for m in ("q_proj", "v_proj"):
        base = f"base_model.model.model.layers.0.self_attn.{m}"
        out += [(f"{base}.lora_A.weight", torch.randn(4, 96, generator=g)),
                (f"{base}.lora_B.weight", torch.randn(96, 4, generator=g))]  # fmt: skip
    return out


def _adapter_dir(root, version: int) -> str:
    from areal_kernel.engine.lora import write_adapter_dir

    # Named as the kernel's disk transport names them: one directory per version.
    path = str(root / f"{ADAPTER}-v{version}")
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    write_adapter_dir(path, _adapter_tensors(version), config)
    return path


def test_adapter_update_is_checked_by_the_directory_each_server_serves(model_dir, launch_standins, tmp_path):
    """SGLang cannot read an adapter's weights back; the check asks each
    server (``GET /v1/models``, its answer checked against SGLang's
    ``ModelList``) which directory it serves the adapter from and maps it to
    the version the client loaded from there. Clean updates pass on both
    servers; an update one server refused (it keeps the previous directory,
    or, refused after the unload, serves no adapter at all) names that
    server, the version and the adapter."""
    from areal_sglang.config import SGLangLoraSettings

    from sglang_testutil import post_json

    lora = SGLangLoraSettings(max_rank=4, target_modules=["q_proj", "v_proj"])
    _, infos = launch_standins(model_dir, n=2, dtype="bfloat16", lora=lora)
    first, second = (i.address for i in infos)
    client = SGLangInferenceEngine([first, second], SGLangProtocol(dtype="bfloat16"))
    said: list[str] = []
    mon = WeightsMonitor(action="error", tensors_per_update=100, elements_per_tensor=64, warn=said.append)
    train = _AdapterWeights(_adapter_tensors(1))
    for version in (1, 2):
        client.load_adapter(ADAPTER, _adapter_dir(tmp_path, version), version)
        out = mon.check(version, train, client)
        # One comparison per server (the served directory), on both servers.
        assert out["weights_mismatch"] == 0 and out["weights_checked"] == 2 and out["weights_servers"] == 2, said
        mon.raise_if_alarmed()
    # Said once, in the run's output: the bytes are not compared.
    assert len(said) == 1 and "not its bytes" in said[0] and "cannot read an adapter's weights back" in said[0], said

    # Negative control: the second server refuses the unload that starts
    # update 3 (so it keeps serving version 2's directory); the first loads it.
    post_json(f"http://{second}/_standin/fail_next", {"n": 1, "status": 400, "route": "/unload_lora_adapter"})
    v3 = _adapter_dir(tmp_path, 3)
    client.load_adapter(ADAPTER, v3, 3)  # a failure on one server is logged, not raised (control_all)
    out = mon.check(3, train, client)
    assert out["weights_mismatch"] == 1 and out["weights_checked"] == 2, mon.mismatches
    with pytest.raises(WeightDeliveryError) as e:
        mon.raise_if_alarmed()
    msg = str(e.value)
    assert f"at version 3: server {second}: tensor '*' at version 3: the server reports serving weight version 2" in msg
    assert f"adapter '{ADAPTER}' from '{tmp_path / 'policy-v2'}'" in msg, msg
    assert f"server {first}:" not in msg, msg

    # The second server refuses the load itself, after the unload went through: it serves no adapter.
    post_json(f"http://{second}/_standin/fail_next", {"n": 1, "status": 400, "route": "/load_lora_adapter"})
    client.load_adapter(ADAPTER, _adapter_dir(tmp_path, 4), 4)
    mon.check(4, train, client)
    with pytest.raises(WeightDeliveryError, match=f"server {second}: tensor '\\*' at version 4: the server does not "
                       f"report serving version 4 \\(it serves no adapter '{ADAPTER}'"):  # fmt: skip
        mon.raise_if_alarmed()
    # The first server went through all four versions.
    assert [m.server for m in mon.mismatches] == [second, second]
    client.destroy()
