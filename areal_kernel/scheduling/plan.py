"""``areal plan``: the processes and devices each role needs, and whether they fit."""

from __future__ import annotations

from typing import Any

from areal_kernel.config.models import ExperimentConfig


def make_plan(cfg: ExperimentConfig) -> dict[str, Any]:
    from areal_kernel.platforms import current_platform

    plat = current_platform()
    # Without exclusive devices a "device" is a host core: every process runs
    # single-threaded and processes may share cores.
    shared = not plat.exclusive_devices
    available = plat.compute_units()
    actor = cfg.actor.allocation
    rollout = cfg.rollout.allocation
    roles: list[dict[str, Any]] = [
        {
            "role": "actor",
            "allocation": str(actor),
            "processes": actor.world_size,
            "devices_per_process": 1,
            "devices": actor.world_size,
        },
    ]
    if not _offline(cfg):  # SFT/DPO/RM train from a dataset: no inference servers
        roles.append(
            {
                "role": "rollout",
                "allocation": str(rollout),
                "processes": rollout.d,
                "devices_per_process": rollout.devices_per_replica,
                "devices": rollout.d * rollout.devices_per_replica,
            }
        )
    needed = sum(r["devices"] for r in roles)
    notes = []
    if shared and needed > available:
        notes.append(f"{needed} single-threaded processes on {available} core(s): they will share cores and run slower")
    if actor.e > 1 and actor.world_size % actor.e:
        notes.append(f"actor expert parallel e{actor.e} does not divide the world size {actor.world_size}")
    return {
        "platform": plat.name,
        "device_unit": plat.compute_unit_name,
        "available_devices": available,
        "roles": roles,
        "devices_needed": needed,
        # Shared cores can be oversubscribed; exclusive devices cannot.
        "fits": True if shared else needed <= available,
        "notes": notes,
    }


def _offline(cfg: ExperimentConfig) -> bool:
    """The selected trainer runs no inference servers (no ``rollout`` capability)."""
    from areal_kernel.trainer.common import uses_rollout

    return not uses_rollout(cfg)
