"""The embedded server's adapter hooks on a batch whose rows use different
adapters (and the base), on a tiny random Llama in this process."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from areal_kernel.inference.embedded import lora as lora_mod  # noqa: E402
from areal_kernel.inference.embedded.lora import AdapterSet  # noqa: E402
from areal_kernel.models.tiny import make_tiny_llama  # noqa: E402
from areal_kernel.testing.noise import assert_within_noise, measure_noise_floor  # noqa: E402

TARGETS = ("q_proj", "v_proj", "down_proj")


def _adapter(model, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, mod in model.named_modules():
        if name.rsplit(".", 1)[-1] in TARGETS:
            out.append((f"base_model.model.{name}.lora_A.weight", torch.randn(4, mod.in_features, generator=g) * 0.1))
            out.append((f"base_model.model.{name}.lora_B.weight", torch.randn(mod.out_features, 4, generator=g) * 0.1))
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(make_tiny_llama(tmp_path_factory.mktemp("tiny"), layers=2)).eval()
    adapters = AdapterSet(model)
    for i, name in enumerate(("a", "b")):
        adapters.load(name, {"r": 4, "lora_alpha": 8}, _adapter(model, i), version=1)
    return model, adapters


def _logits(model, adapters, rows, ids):
    adapters.rows = rows
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_a_mixed_batch_gives_each_row_its_own_adapters_output(served):
    model, adapters = served
    ids = torch.randint(0, 256, (6, 5), generator=torch.Generator().manual_seed(0))
    rows = ["a", None, "b", "a", "b", None]
    mixed = _logits(model, adapters, rows, ids)
    # Each row alone, in a batch of one adapter (the hooks' one-adapter path).
    alone = torch.cat([_logits(model, adapters, [r], ids[i : i + 1]) for i, r in enumerate(rows)])
    # Floor: the same one-adapter path with each row in a batch of two (another matmul shape).
    paired = torch.cat([_logits(model, adapters, [r, r], ids[[i, i]])[:1] for i, r in enumerate(rows)])
    floor = measure_noise_floor("logits, one row alone vs in a pair", alone, paired)
    assert_within_noise(mixed, alone, floor, 4, what="mixed batch vs each row alone")
    # The adapters matter (the control): row 0 under "b" and under no adapter differ.
    for other in ("b", None):
        assert (alone[0] - _logits(model, adapters, [other], ids[:1])[0]).abs().max().item() > 1e-3


def test_row_indices_are_made_once_per_forward(served, monkeypatch):
    """Index tensors of a mixed batch's rows are made once per forward, not in
    every adapted layer's hook (on a GPU each is a copy from host memory that
    waits for the queued kernels)."""
    model, adapters = served
    made = []
    real = torch.tensor

    class Counting:  # the module's ``torch``, with ``tensor`` counted
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def tensor(*args, **kwargs):
            made.append(args[0])
            return real(*args, **kwargs)

    monkeypatch.setattr(lora_mod, "torch", Counting())
    ids = torch.randint(0, 256, (4, 3), generator=torch.Generator().manual_seed(1))
    _logits(model, adapters, ["a", "b", None, "a"], ids)
    assert sorted(made) == [[0, 3], [1]]  # one per adapter in the batch; 2 layers x 3 targets hooked
    made.clear()
    _logits(model, adapters, ["b", "b", "b", "b"], ids)  # one adapter: no indices at all
    assert made == []
