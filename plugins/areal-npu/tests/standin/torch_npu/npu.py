"""Stand-in ``torch_npu.npu`` (test-only; see the package docstring): the
device API on the host, recording each call in ``calls``."""

from __future__ import annotations

import os
import types
from typing import Any

import torch

calls: list[tuple[Any, ...]] = []
_current = 0
_generators: dict[int, torch.Generator] = {}


def reset() -> None:
    global _current
    calls.clear()
    _generators.clear()
    _current = 0


def device_count() -> int:
    return int(os.environ.get("AREAL_NPU_STANDIN_DEVICES", "8"))


def is_available() -> bool:
    return device_count() > 0


def is_initialized() -> bool:
    return True


def _is_in_bad_fork() -> bool:
    # torch.manual_seed asks the privateuse1 device module this before seeding it.
    return False


def current_device() -> int:
    return _current


def set_device(index: int) -> None:
    global _current
    index = int(getattr(index, "index", index) or 0)
    if not 0 <= index < device_count():
        raise RuntimeError(f"stand-in NPU: invalid device {index} of {device_count()}")
    calls.append(("set_device", index))
    _current = index


def synchronize(device: Any = None) -> None:
    calls.append(("synchronize",))


def memory_allocated(device: Any = None) -> int:
    calls.append(("memory_allocated",))
    return 0  # tensors live in host memory


def max_memory_allocated(device: Any = None) -> int:
    calls.append(("max_memory_allocated",))
    return 0


def empty_cache() -> None:
    calls.append(("empty_cache",))


def get_device_properties(device: Any = None) -> Any:
    return types.SimpleNamespace(name="Ascend stand-in (host)", total_memory=64 << 30)


def _generator(index: int | None = None) -> torch.Generator:
    i = _current if index is None else index
    if i not in _generators:
        _generators[i] = torch.Generator().manual_seed(0)
    return _generators[i]


def manual_seed(seed: int) -> None:
    calls.append(("manual_seed", seed))
    _generator().manual_seed(seed)


def manual_seed_all(seed: int) -> None:
    calls.append(("manual_seed_all", seed))
    for i in range(device_count()):
        _generator(i).manual_seed(seed)


def get_rng_state(device: Any = None) -> torch.Tensor:
    return _generator().get_state()


def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
    _generator().set_state(state)


def random_draw() -> float:
    """Not torch_npu API: a draw from the current device's generator, so
    tests can see that seeding and RNG state reach it."""
    return float(torch.rand(1, generator=_generator())[0])
