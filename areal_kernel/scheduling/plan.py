"""``areal plan``: the processes and devices each role needs, whether they
fit, and where the run's scheduler would place each one (its ``plan()``:
nothing starts)."""

from __future__ import annotations

from typing import Any

from areal_kernel.api.scheduler import Scheduler, SchedulerContext
from areal_kernel.config.models import ExperimentConfig
from areal_kernel.errors import ArealError


def scheduler_name(cfg: ExperimentConfig) -> str:
    """``scheduler.type``, with ``auto`` resolved by the ``areal_select_scheduler`` hook."""
    from areal_kernel.plugins import get_plugin_manager

    name = cfg.scheduler.type
    if name == "auto":
        name = get_plugin_manager().hook.areal_select_scheduler(config=cfg) or "local"
    return name


def make_scheduler(cfg: ExperimentConfig, name: str | None = None) -> Scheduler:
    """The run's scheduler, built as the trainer builds it (nothing starts):
    ``Registry.build("scheduler", name, SchedulerContext(name, cfg))``."""
    from areal_kernel.plugins import get_registry

    name = name or scheduler_name(cfg)
    return get_registry().build("scheduler", name, SchedulerContext(name=name, config=cfg))


def make_plan(cfg: ExperimentConfig) -> dict[str, Any]:
    from areal_kernel.platforms import current_platform

    plat = current_platform()
    # Without exclusive devices a "device" is a host core: every process runs
    # single-threaded and processes may share cores.
    shared = not plat.exclusive_devices
    available = plat.compute_units()
    on_actor_devices = cfg.rollout.share_devices and not shared  # host cores are shared anyway
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
                # On the actor's devices, they add none (rollout.share_devices).
                "devices": 0 if on_actor_devices else rollout.d * rollout.devices_per_replica,
            }
        )
    needed = sum(r["devices"] for r in roles)
    notes = []
    if on_actor_devices and not _offline(cfg):
        notes.append("rollout.share_devices: the inference servers run on the actor's devices")
    if shared and needed > available:
        notes.append(f"{needed} single-threaded processes on {available} core(s): they will share cores and run slower")
    if actor.e > 1 and actor.world_size % actor.e:
        notes.append(f"actor expert parallel e{actor.e} does not divide the world size {actor.world_size}")
    mesh = _mesh_coords(cfg, notes)
    if mesh is not None:
        roles[0]["mesh"] = mesh
    placement: dict[str, Any] | None = None
    sched_name = scheduler_name(cfg)
    sched = None
    try:
        sched = make_scheduler(cfg, sched_name)
        sp = sched.plan()
        placement = sp.to_dict()
        if mesh is not None:
            for p, coords in zip(placement["roles"].get("actor", []), mesh):
                p["mesh"] = coords
        if _offline(cfg):
            placement["roles"].pop("rollout", None)
        notes.extend(sp.notes)
    except ArealError as e:
        notes.append(f"scheduler '{sched_name}' cannot place this run: {e}")
    finally:
        if sched is not None:
            sched.stop()  # a cluster scheduler's plan may reserve resources: give them back
    return {
        "scheduler": sched_name,
        "placement": placement,
        "platform": plat.name,
        "device_unit": plat.compute_unit_name,
        "available_devices": available,
        "roles": roles,
        "devices_needed": needed,
        # Shared cores can be oversubscribed; exclusive devices cannot.
        "fits": placement is not None and (True if shared else needed <= available),
        "notes": notes,
    }


def _mesh_coords(cfg: ExperimentConfig, notes: list[str]) -> list[dict[str, int]] | None:
    """Each actor rank's coordinates in its engine's device mesh
    (``{"d": 0, "t": 1}``), from the train engine class's optional
    ``mesh_coords(allocation)`` classmethod; None when it has none. Loading
    the class imports the engine's module, not torch (plugin rule)."""
    from areal_kernel.plugins import get_registry

    try:
        cls = get_registry().get("train_engine", cfg.actor.allocation.backend).load()
    except Exception:  # an unknown backend is reported by validation, not here
        return None
    mesh_coords = getattr(cls, "mesh_coords", None)
    if mesh_coords is None:
        return None
    try:
        return [dict(c) for c in mesh_coords(cfg.actor.allocation)]
    except ArealError as e:
        notes.append(f"actor mesh: {e}")
        return None


# The capability a trainer registers when it runs inference servers: the
# rollout role is then planned, placed and started (``areal plan``, the
# schedulers, ``areal train``). Also importable from areal_kernel.trainer.common.
ROLLOUT_CAPABILITY = "rollout"


def uses_rollout(cfg: ExperimentConfig) -> bool:
    """Whether the selected trainer (``algorithm.type``) runs inference servers:
    its registration declares the ``rollout`` capability."""
    from areal_kernel.plugins import get_registry

    spec = get_registry().get("trainer", cfg.algorithm.type, platform="")
    return ROLLOUT_CAPABILITY in spec.capabilities


def _offline(cfg: ExperimentConfig) -> bool:
    """The selected trainer runs no inference servers (no ``rollout`` capability)."""
    return not uses_rollout(cfg)
