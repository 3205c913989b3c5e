"""Kind ``platform`` (``AREAL_PLATFORM``; hook ``areal_register_platforms``).

The target is a ``Platform`` subclass (``areal_kernel.platforms.base``),
built with no arguments in every process that resolves its platform
(``Registry.build("platform", name, PlatformContext(name))``). Its members
are the table "The Platform interface" of docs/plugin-authoring.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from areal_kernel.api.kinds import KindContract
from areal_kernel.platforms.base import Platform

if TYPE_CHECKING:
    from areal_kernel.plugins.registry import FactorySpec

__all__ = ["Platform", "PlatformContext", "KIND"]


@dataclass(frozen=True)
class PlatformContext:
    """What a platform is built with: nothing but its registered ``name``
    (a platform describes the hardware of the process; it reads no config)."""

    name: str


def _construct(target: Any, ctx: PlatformContext, spec: "FactorySpec") -> Platform:
    return target()


KIND = KindContract(
    kind="platform",
    context=PlatformContext,
    contract=Platform,
    construct=_construct,
    contract_name="areal_kernel.platforms.Platform (docs/plugin-authoring.md, The Platform interface)",
    check=lambda obj: [] if isinstance(obj, Platform) else ["the Platform base class"],
)
