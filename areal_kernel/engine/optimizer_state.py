"""An optimizer's state as safetensors + JSON (no pickle), for engine checkpoints.

``torch.optim`` state dicts mix tensors (moments) with scalars (step counts,
hyper-parameters in the param groups); tensors go to one safetensors file
keyed ``"<param index>.<name>"``, the rest into a JSON-able dict.
"""

from __future__ import annotations

from typing import Any


def save_optimizer_state(optimizer: Any, tensors_path: str) -> dict[str, Any]:
    """Write the tensors of ``optimizer.state_dict()`` to ``tensors_path``;
    return the JSON-able rest (to store beside it)."""
    import torch
    from safetensors.torch import save_file

    osd = optimizer.state_dict()
    tensors: dict[str, Any] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, st in osd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{idx}.{k}"] = v.detach().contiguous()
            else:
                scalars.setdefault(str(idx), {})[k] = v
    save_file(tensors, tensors_path)
    return {"param_groups": osd["param_groups"], "scalars": scalars}


def load_optimizer_state(optimizer: Any, tensors_path: str, rest: dict[str, Any], device: str) -> None:
    """Restore what ``save_optimizer_state`` wrote into ``optimizer``."""
    from safetensors.torch import load_file

    state: dict[int, dict[str, Any]] = {}
    for key, v in load_file(tensors_path, device=device).items():
        idx, k = key.split(".", 1)
        state.setdefault(int(idx), {})[k] = v
    for idx, kv in rest["scalars"].items():
        state.setdefault(int(idx), {}).update(kv)
    groups = rest["param_groups"]
    for g in groups:
        if "betas" in g:
            g["betas"] = tuple(g["betas"])  # JSON made the tuple a list
    optimizer.load_state_dict({"state": state, "param_groups": groups})
