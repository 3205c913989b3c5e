"""The embedded server's adapter hooks on a batch whose rows use different
adapters (and the base), on a tiny random Llama in this process."""

from __future__ import annotations

from collections import Counter

import pytest

torch = pytest.importorskip("torch")

from areal_kernel.inference.embedded.lora import AdapterSet  # noqa: E402
from areal_kernel.models.tiny import make_tiny_llama  # noqa: E402
from areal_kernel.testing.noise import assert_within_noise, measure_noise_floor  # noqa: E402
from trained_engine import random_adapter  # noqa: E402

TARGETS = ("q_proj", "v_proj", "down_proj")  # random_adapter's layers


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"), layers=2)


@pytest.fixture(scope="module")
def served(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    adapters = AdapterSet(model)
    for i, name in enumerate(("a", "b")):
        adapters.load(name, {"r": 4, "lora_alpha": 8}, random_adapter(model, i), version=1)
    # "c": another rank and scale, on v_proj alone (the other layers' stacks leave it out).
    c = [
        (n, t[:2] if n.endswith("lora_A.weight") else t[:, :2]) for n, t in random_adapter(model, 2) if ".v_proj." in n
    ]
    adapters.load("c", {"r": 2, "lora_alpha": 6}, c, version=1)
    return model, adapters


def _logits(model, adapters, rows, ids):
    adapters.rows = rows
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_a_mixed_batch_gives_each_row_its_own_adapters_output(served):
    model, adapters = served
    ids = torch.randint(0, 256, (7, 5), generator=torch.Generator().manual_seed(0))
    rows = ["a", None, "b", "a", "c", "b", None]
    mixed = _logits(model, adapters, rows, ids)
    # Each row alone, in a batch of one adapter (the hooks' one-adapter path: peft's expression).
    alone = torch.cat([_logits(model, adapters, [r], ids[i : i + 1]) for i, r in enumerate(rows)])
    # Floor: the same one-adapter path with each row in a batch of two (another matmul shape).
    paired = torch.cat([_logits(model, adapters, [r, r], ids[[i, i]])[:1] for i, r in enumerate(rows)])
    floor = measure_noise_floor("logits, one row alone vs in a pair", alone, paired)
    assert_within_noise(mixed, alone, floor, 4, what="mixed batch vs each row alone")
    # The adapters matter (the control): row 0 under "b" and under no adapter
    # differ, and so does row 4 ("c", on v_proj only) from the base.
    for other in ("b", None):
        assert (alone[0] - _logits(model, adapters, [other], ids[:1])[0]).abs().max().item() > 1e-3
    assert (alone[4] - _logits(model, adapters, [None], ids[4:5])[0]).abs().max().item() > 1e-3


def test_one_adapters_rows_beside_the_bases_in_one_batch(model_dir):
    """With one adapter loaded, a batch of its rows and the base's is mixed
    too: each row gets its own output."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    adapters = AdapterSet(model)
    adapters.load("a", {"r": 4, "lora_alpha": 8}, random_adapter(model, 0), version=1)
    ids = torch.randint(0, 256, (4, 5), generator=torch.Generator().manual_seed(3))
    rows = ["a", None, None, "a"]
    mixed = _logits(model, adapters, rows, ids)
    alone = torch.cat([_logits(model, adapters, [r], ids[i : i + 1]) for i, r in enumerate(rows)])
    paired = torch.cat([_logits(model, adapters, [r, r], ids[[i, i]])[:1] for i, r in enumerate(rows)])
    floor = measure_noise_floor("logits, one row alone vs in a pair", alone, paired)
    assert_within_noise(mixed, alone, floor, 4, what="one adapter's rows and the base's vs each alone")
    # The control: the adapter changes row 0's output.
    assert (alone[0] - _logits(model, adapters, [None], ids[:1])[0]).abs().max().item() > 1e-3


def _ops(model, adapters, rows, ids) -> list[str]:
    """The aten operations one forward runs (each a kernel launch on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ran: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ran.append(str(func))
            return func(*args, **(kwargs or {}))

    adapters.rows = rows
    with torch.no_grad(), Record():
        model(input_ids=ids)
    return ran


def test_a_mixed_batch_runs_the_operations_of_a_one_adapter_batch(served):
    """A layer computes every adapter of a mixed batch at once: the forward
    runs the same operations for two or three adapters as for one (adapter
    by adapter, each one added seven per adapted layer and the batch a copy),
    plus the per-row masks, made once per forward for each set of adapters
    sharing layers rather than in every layer (on a GPU each is a copy from
    host memory that waits for the queued kernels); the adapters are stacked
    when loaded, never in a forward."""
    model, adapters = served
    ids = torch.randint(0, 256, (6, 3), generator=torch.Generator().manual_seed(1))
    two_rows = ["a", "b", None, "a", "b", "b"]
    # A weight update right before: the stacks are rebuilt by the load, not
    # in the next mixed forward (tensors made amid a forward's activations
    # kept their memory resident: about 0.8 GB more in a SmolLM2 server).
    adapters.load("b", {"r": 4, "lora_alpha": 8}, random_adapter(model, 1), version=2)
    base = Counter(_ops(model, adapters, [None] * 6, ids))
    one = Counter(_ops(model, adapters, ["a"] * 6, ids))
    two = Counter(_ops(model, adapters, two_rows, ids))
    three = Counter(_ops(model, adapters, ["a", "b", None, "a", "c", "b"], ids))
    # The control: the adapters run (a one-adapter forward adds operations to the base's).
    assert one.total() >= base.total() + 2 * len(TARGETS) * 4
    # Two sets of layers share adapters: v_proj ({a, b, c}) and the rest ({a, b}):
    # a mask each, a copy from the host and a view.
    masks = Counter({"aten.lift_fresh.default": 2, "aten.view.default": 2})
    assert two == one + masks, (two - one, one - two)
    assert three == two
