"""Train-engine state shared by every torch-based engine: the optimizer it
builds, the RNG states and the ``engine_state.json`` of its checkpoints.

The built-in ``TorchTrainEngine`` and distributed engines (areal-fsdp's
ranks) use these so that a setting means the same thing in both and a
checkpoint's bookkeeping is written and checked one way. Optimizer moments
are saved by ``areal_kernel.engine.optimizer_state`` (single process) or by
the engine's own sharded format; model weights likewise.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any, Iterable

from areal_kernel.errors import DataError

STATE_FILE = "engine_state.json"
STATE_FORMAT = 1


def torch_dtype(name: str | None) -> Any:
    """``"float32"`` -> ``torch.float32``; ``None`` stays ``None``."""
    import torch

    return None if name is None else getattr(torch, name)


def make_optimizer(params: Iterable[Any], config: Any) -> Any:
    """AdamW over ``params`` with the settings section's ``lr``, ``adam_beta1``,
    ``adam_beta2``, ``adam_eps`` and ``weight_decay`` (``TorchEngineConfig``
    fields). The lr is overwritten before every step by the schedule
    (``areal_kernel.engine.lr_schedule.scheduled_lr``)."""
    import torch

    return torch.optim.AdamW(
        params,
        lr=config.lr,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
    )


def set_lr(optimizer: Any, lr: float) -> float:
    """Set ``lr`` on every param group of ``optimizer``; returns it."""
    for g in optimizer.param_groups:
        g["lr"] = lr
    return lr


def save_rng_state(path: str) -> None:
    """The torch CPU RNG and the platform's device RNG (if it has one) as one
    safetensors file: what dropout or sampling inside a step draws from."""
    import torch
    from safetensors.torch import save_file

    from areal_kernel.platforms import current_platform

    rng = {"torch_cpu": torch.get_rng_state()}
    dev_rng = current_platform().device_rng_state()
    if dev_rng is not None:
        rng["device"] = dev_rng
    save_file(rng, path)


def load_rng_state(path: str) -> None:
    """Restore what ``save_rng_state`` wrote."""
    import torch
    from safetensors.torch import load_file

    from areal_kernel.platforms import current_platform

    rng = load_file(path)
    torch.set_rng_state(rng["torch_cpu"])
    current_platform().set_device_rng_state(rng.get("device"))


def python_random_state() -> list:
    """Python's ``random`` state as JSON data (for ``engine_state.json``)."""
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def set_python_random_state(data: list) -> None:
    """Restore what ``python_random_state`` returned."""
    version, internal, gauss = data
    random.setstate((version, tuple(internal), gauss))


def write_engine_state(directory: str, engine: str, meta: dict[str, Any]) -> None:
    """Write ``engine_state.json`` (``format``, ``engine`` and ``meta``) into
    the checkpoint ``directory``."""
    with open(os.path.join(directory, STATE_FILE), "w") as f:
        json.dump({"format": STATE_FORMAT, "engine": engine, **meta}, f, indent=1)


def read_engine_state(path: str, engine: str) -> dict[str, Any]:
    """The ``engine_state.json`` of the checkpoint ``path``, checked to be one
    ``engine`` wrote in this format; ``DataError`` naming the file otherwise.
    A file without ``engine`` (written before the field existed) counts as
    the ``torch`` engine's."""
    meta_path = os.path.join(path, STATE_FILE)
    if not os.path.isfile(meta_path):
        raise DataError(f"{path!r} is not an engine checkpoint (no {STATE_FILE})")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta.get("format") != STATE_FORMAT or meta.get("engine", "torch") != engine:
        raise DataError(
            f"{meta_path}: not a {engine} engine checkpoint of format {STATE_FORMAT} "
            f"(engine={meta.get('engine', 'torch')!r}, format={meta.get('format')!r})"
        )
    return meta


def check_param_names(path: str, saved: list[str], current: list[str]) -> None:
    """``DataError`` when the checkpoint ``path`` lists other parameter names
    than the model it is loaded into."""
    if saved != current:
        raise DataError(f"{path!r} was saved from a different model architecture (parameter names differ)")
