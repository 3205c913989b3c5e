"""Copy named tensors into a live model, checking names and shapes first.

Names are HF parameter names (``model.layers.0.mlp.up_proj.weight``). With tied
embeddings ``lm_head.weight`` and ``model.embed_tokens.weight`` are one tensor
in the model; a sender may send either name or both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from areal_kernel.errors import ArealError

if TYPE_CHECKING:
    import torch


def model_tensor_table(model: "torch.nn.Module") -> dict[str, "torch.Tensor"]:
    """Name -> live tensor for every parameter and persistent buffer, tied
    aliases included (``state_dict`` lists both names of a tied weight)."""
    return dict(model.state_dict(keep_vars=True))


def check_meta(table: dict[str, "torch.Tensor"], meta: Iterable[dict]) -> None:
    """Raise ``ArealError`` naming the first unknown name or wrong shape."""
    for m in meta:
        name = m.get("name")
        if name not in table:
            raise ArealError(f"unknown tensor name {name!r}: the model has no such parameter or buffer")
        want = list(table[name].shape)
        if list(m.get("shape", [])) != want:
            raise ArealError(f"tensor {name!r}: shape {list(m.get('shape', []))} does not match the model's {want}")


def copy_into_model(table: dict[str, "torch.Tensor"], named: Iterable[tuple[str, "torch.Tensor"]]) -> list[str]:
    """Copy each tensor into its model slot (dtype and device converted).
    Returns the names copied. Callers validate with ``check_meta`` first so
    that a bad name is rejected before anything changed."""
    import torch

    done = []
    with torch.no_grad():
        for name, t in named:
            dst = table.get(name)
            if dst is None:
                raise ArealError(f"unknown tensor name {name!r}: the model has no such parameter or buffer")
            if tuple(dst.shape) != tuple(t.shape):
                raise ArealError(f"tensor {name!r}: shape {list(t.shape)} does not match the model's {list(dst.shape)}")
            dst.copy_(t)
            done.append(name)
    return done
