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
