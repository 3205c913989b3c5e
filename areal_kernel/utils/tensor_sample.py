"""Reading sampled elements of named tensors: the train engine's side of the
weight-delivery check (``areal_kernel.monitor.weights``). It lives here, at
the bottom layer, because ``TrainEngine.weight_sample``'s default in
``areal_kernel.api.engine`` uses it and the API layer must not import the
monitor. torch is imported only when a tensor is read."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

from areal_kernel.errors import ArealError

if TYPE_CHECKING:
    import torch


def sample(tensor: "torch.Tensor", positions: Sequence[int]) -> "torch.Tensor":
    """The elements at flat ``positions`` of ``tensor``, on its device and in its dtype."""
    import torch

    flat = tensor.detach().reshape(-1)
    idx = torch.tensor(list(positions), dtype=torch.long, device=flat.device)
    return flat.index_select(0, idx)


def sample_named(
    named: Iterable[tuple[str, "torch.Tensor"]], positions: Mapping[str, Sequence[int]]
) -> dict[str, "torch.Tensor"]:
    """``TrainEngine.weight_sample`` over ``(name, tensor)`` pairs: the sampled
    values of each named tensor, copied to the CPU in their own dtype."""
    out: dict[str, "torch.Tensor"] = {}
    for name, t in named:
        pos = positions.get(name)
        if pos is None:
            continue
        if t.device.type == "meta":
            raise NotImplementedError("the train engine's weights are not in this process (meta tensors)")
        out[name] = sample(t, pos).cpu()
    absent = [n for n in positions if n not in out]
    if absent:
        raise ArealError(f"weight sample: the train engine has no tensor {absent[0]!r}")
    return out
