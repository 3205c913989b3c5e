"""Several adapters of one torch engine (``adapters:``) on the real embedded
server: each policy's view sends its own adapter, and after training one
policy only its adapter is sent and changes what the server says."""

from __future__ import annotations

from test_embedded_lora import PROMPT, SERVER_MULTIPLE, _batch, _loss, _recompute

from areal_kernel.engine.torch_engine import TorchTrainEngine
from areal_kernel.inference.client import RemoteInferenceEngine
from areal_kernel.inference.embedded.backend import EmbeddedProtocol
from areal_kernel.trainer.weight_sync import DiskTransport
from areal_kernel.testing.noise import assert_within_noise, measure_noise_floor

ADAPTERS = [
    {"name": "multi-a", "rank": 4, "alpha": 8},
    {"name": "multi-b", "rank": 2, "alpha": 4, "target_modules": ["up_proj", "o_proj"]},
]


def _engine(model_dir: str, **cfg) -> TorchTrainEngine:
    e = TorchTrainEngine({"lr": 5e-2, "seed": 5, "adapters": ADAPTERS, **cfg})
    e.initialize(model_dir, 10)
    return e


def test_training_one_adapter_updates_only_it_on_the_server(servers, tmp_path, tiny_model_dir):
    srv = servers[0]
    m = _engine(tiny_model_dir)
    a, b = m.policy("multi-a"), m.policy("multi-b")
    for s in range(2):
        a.train_batch(_batch(500 + s), _loss)
        b.train_batch(_batch(600 + s), _loss)

    # The kernel's disk transport, one per policy, each driving its view as
    # the train engine: the transports need nothing new for several policies.
    client = RemoteInferenceEngine([srv.address], EmbeddedProtocol(), admin_token=srv.token)
    transports = {v.name: DiskTransport(v, client, str(tmp_path / v.name)) for v in (a, b)}

    def send(view, version: int) -> None:
        transports[view.name].setup()
        stats = transports[view.name].update(version)
        assert srv.info()["adapters"][view.name] == version
        sent = sum(t.numel() * t.element_size() for _, t in view.named_weights_for_transfer())
        assert stats["weights/mb"] * 2**20 < 2 * sent  # the adapter's tensors (and a small config), nothing else

    def generate(tag: str) -> dict[str, dict]:
        return {
            n: srv.ok("/generate", {"rid": f"{tag}-{n}", "input_ids": PROMPT, "adapter": n,
                                    "sampling_params": {"max_new_tokens": 16, "greedy": True}})
            for n in ("multi-a", "multi-b")
        }  # fmt: skip

    def check(out: dict, name: str) -> None:
        """The server's logprobs against the view's recompute, on the floor of
        the same weights with the other attention kernel."""
        twin = _engine(tiny_model_dir, attn_implementation="eager")
        twin.model.load_state_dict(m.model.state_dict())
        want = _recompute(m.policy(name), PROMPT, out)
        floor = measure_noise_floor("logprobs", want, _recompute(twin.policy(name), PROMPT, out))
        print(assert_within_noise(out["output_logprobs"], want, floor, SERVER_MULTIPLE, what=name))

    try:
        send(a, 1)
        send(b, 1)
        before = generate("v1")
        for name, out in before.items():
            assert out["weight_version"] == 1
            check(out, name)
        # Each adapter is its own: they make the model say different things.
        assert before["multi-a"]["output_logprobs"] != before["multi-b"]["output_logprobs"]

        a.train_batch(_batch(700), _loss)
        send(a, 2)  # only the policy that trained
        assert srv.info()["adapters"] == {"multi-a": 2, "multi-b": 1}
        after = generate("v2")
        # B: the same weights on the same server, the same greedy generation.
        for key in ("output_ids", "output_logprobs", "weight_version"):
            assert after["multi-b"][key] == before["multi-b"][key], key
        # A: the new version, scoring like the trained view (and unlike before).
        assert after["multi-a"]["weight_version"] == 2
        assert after["multi-a"]["output_logprobs"] != before["multi-a"]["output_logprobs"]
        check(after["multi-a"], "multi-a")
    finally:
        for name in ("multi-a", "multi-b"):
            srv.call("/unload_adapter", {"name": name})
        for t in transports.values():
            t.close()
        client.destroy()
