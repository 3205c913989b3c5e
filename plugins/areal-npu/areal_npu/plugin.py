"""Entry points of areal-npu: the ``npu`` plugin (group ``areal.plugins``)
and the platform probe (group ``areal.platforms``).

Imports only ``areal_kernel`` and the standard library: the probe runs in
every process that resolves its platform, on machines with and without NPUs.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from areal_kernel.hookspecs import hookimpl

PLATFORM_TARGET = "areal_npu.platform:NPUPlatform"


@hookimpl
def areal_register_platforms(register: Any) -> None:
    register("npu", PLATFORM_TARGET, description="Ascend NPUs (torch_npu, hccl collectives)")


def torch_npu_installed() -> bool:
    """Whether a ``torch_npu`` module can be found, without importing it."""
    try:
        return importlib.util.find_spec("torch_npu") is not None
    except (ImportError, ValueError):  # a broken or half-imported entry counts as absent
        return False


def probe() -> str | None:
    """The platform target when this process can use NPUs, else ``None``.

    Without torch_npu it imports nothing. With it, it imports torch_npu (the
    platform is about to be chosen) and asks whether a device is usable, so
    a machine that has torch_npu but no working NPU falls back to the next
    platform instead of failing later."""
    if not torch_npu_installed():
        return None
    from areal_npu.platform import NPUPlatform

    return PLATFORM_TARGET if NPUPlatform.is_available() else None
