"""The ``local`` scheduler: every role runs as processes on this machine.

It hands out device ids per role (accelerators are never shared between
roles; on CPU every process is single-threaded and cores are shared). The
rest (servers through their backend's launcher, train ranks with their
rendezvous environment, health, logs, stop) is the kernel's scheduler
contract, ``areal_kernel.api.scheduler.Scheduler``.
"""

from __future__ import annotations

from typing import Any

from areal_kernel.api.scheduler import (
    ACTOR,
    ROLLOUT,
    Placement,
    ProcessHandle,
    SchedulePlan,
    Scheduler,
    spawn_local,
)
from areal_kernel.errors import ArealError
from areal_kernel.utils.network import find_free_port

LOCAL_NODE = "local"
LOOPBACK = "127.0.0.1"


def replica_device_plan(
    platform: Any, allocation: Any, taken: set[int] | frozenset[int] = frozenset()
) -> list[list[int]]:
    """Device ids for ``allocation.d`` inference replicas of
    ``allocation.devices_per_replica`` devices each, on this machine, skipping
    the ids in ``taken`` (held by other services). On platforms whose cores
    are shared (no exclusive devices) every replica gets an empty list.

    Used by long-running services (``areal inf``) that place several models
    side by side; a training run plans all its roles at once
    (``LocalScheduler.device_plan``)."""
    if not platform.exclusive_devices:
        return [[] for _ in range(allocation.d)]
    per = allocation.devices_per_replica
    free = [i for i in range(platform.device_count()) if i not in taken]
    need = allocation.d * per
    if need > len(free):
        raise ArealError(
            f"{allocation} needs {need} {platform.device_type} device(s) but only {len(free)} of this machine's "
            f"{platform.device_count()} are free" + (f" (in use: {sorted(taken)})" if taken else "")
        )
    return [free[r * per : (r + 1) * per] for r in range(allocation.d)]


class LocalScheduler(Scheduler):
    """Every placement is on this machine (node ``local``, host 127.0.0.1);
    processes are started with ``subprocess`` in their own sessions."""

    name = "local"
    shares_devices = True

    def plan(self) -> SchedulePlan:
        ids = self._device_ids()
        roles = {
            role: [Placement(role, i, LOCAL_NODE, LOOPBACK, tuple(d)) for i, d in enumerate(per_process)]
            for role, per_process in ids.items()
        }
        return SchedulePlan(self.name, self.platform.name, roles)

    def _device_ids(self) -> dict[str, list[list[int]]]:
        actor = self.config.actor.allocation
        rollout = self.config.rollout.allocation
        servers = rollout.d if ROLLOUT in self.roles else 0
        if not self.platform.exclusive_devices:  # shared host cores: no ids to hand out
            return {ACTOR: [[] for _ in range(actor.world_size)], ROLLOUT: [[] for _ in range(servers)]}
        if self.config.rollout.share_devices:
            # The servers go on the ranks' devices, in turn: server r starts
            # where server r-1 ended, wrapping round the ranks' devices.
            have, per = self.platform.device_count(), rollout.devices_per_replica
            if actor.world_size > have or (servers and per > actor.world_size):
                raise ArealError(
                    f"rollout.share_devices: the run needs {actor.world_size} {self.platform.device_type} devices "
                    f"for actor {actor} (this machine has {have}), and each {rollout} server's {per} device(s) "
                    f"among them (at most {actor.world_size}); see `areal plan`"
                )
            return {
                ACTOR: [[i] for i in range(actor.world_size)],
                ROLLOUT: [self._shared_ids(r) for r in range(servers)],
            }
        need = actor.world_size + servers * rollout.devices_per_replica
        have = self.platform.device_count()
        if need > have:
            raise ArealError(
                f"the run needs {need} {self.platform.device_type} devices (actor {actor}, rollout {rollout}) "
                f"but this machine has {have}; see `areal plan`"
            )
        ids = iter(range(need))
        return {
            ACTOR: [[next(ids)] for _ in range(actor.world_size)],
            ROLLOUT: [[next(ids) for _ in range(rollout.devices_per_replica)] for _ in range(servers)],
        }

    def _shared_ids(self, index: int) -> list[int]:
        """Server ``index``'s devices under ``rollout.share_devices``: the
        next ``devices_per_replica`` of the ranks' device ids, wrapping."""
        per, ranks = self.config.rollout.allocation.devices_per_replica, self.config.actor.allocation.world_size
        return [(index * per + k) % ranks for k in range(per)]

    def device_plan(self) -> dict[str, list[list[int]]]:
        """Device ids per process: ``{"actor": [[0], [1]], "rollout": [[2, 3]]}``."""
        return self._device_ids()

    def extra_placement(self, role: str, index: int) -> Placement:
        """One more server on this machine; on exclusive devices it takes
        ``devices_per_replica`` ids no placement of this run holds (the
        devices of a server given back are not handed out again)."""
        devices: tuple[int, ...] = ()
        if self.platform.exclusive_devices and self.config.rollout.share_devices:
            devices = tuple(self._shared_ids(self.config.rollout.allocation.d + len(self._extra)))
        elif self.platform.exclusive_devices:
            taken = {d for ps in self.device_plan().values() for p in ps for d in p}
            taken |= {d for p in self._extra for d in p.devices}
            per = self.config.rollout.allocation.devices_per_replica
            free = [i for i in range(self.platform.device_count()) if i not in taken]
            if len(free) < per:
                raise ArealError(
                    f"no room for another {role} server: it needs {per} {self.platform.device_type} device(s), "
                    f"{len(free)} of this machine's {self.platform.device_count()} are free"
                )
            devices = tuple(free[:per])
        placement = Placement(role, index, LOCAL_NODE, LOOPBACK, devices)
        self._extra.append(placement)
        return placement

    def spawn(self, placement: Placement, argv: list[str], env: dict[str, str], log_path: str) -> ProcessHandle:
        return spawn_local(argv, env, log_path, placement)

    def free_port(self, placement: Placement) -> int:
        return find_free_port(placement.host)

    def on_this_machine(self, placement: Placement) -> bool:
        return True

    def release(self) -> None:
        """Nothing is reserved beyond the processes."""
