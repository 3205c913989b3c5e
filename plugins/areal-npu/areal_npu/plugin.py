"""Entry points of areal-npu: the ``npu`` plugin (group ``areal.plugins``)
and the platform probe (group ``areal.platforms``).

Imports only ``areal_kernel`` and the standard library: the probe runs in
every process that resolves its platform, on machines with and without NPUs.
"""

from __future__ import annotations

from typing import Any

from areal_kernel.hookspecs import hookimpl

from areal_npu.detect import torch_npu_installed

PLATFORM_TARGET = "areal_npu.platform:NPUPlatform"


@hookimpl
def areal_register_platforms(register: Any) -> None:
    register("npu", PLATFORM_TARGET, description="Ascend NPUs (torch_npu, hccl collectives)")


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
