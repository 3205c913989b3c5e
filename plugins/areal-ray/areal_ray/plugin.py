"""Entry point of areal-ray (group ``areal.plugins``, name ``ray``).

Imports only ``areal_kernel``: ray itself is imported when the scheduler is
selected.
"""

from __future__ import annotations

from typing import Any

from areal_kernel.hookspecs import hookimpl


@hookimpl
def areal_register_schedulers(register: Any) -> None:
    register(
        "ray",
        "areal_ray.scheduler:RayScheduler",
        config_model="areal_ray.config:RaySettings",
        description="roles placed on a Ray cluster (a placement group per role)",
    )
