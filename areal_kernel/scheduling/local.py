"""The ``local`` scheduler: every role runs as processes on this machine.

It hands out device ids per role (accelerators are never shared between
roles; on CPU every process is single-threaded and cores are shared) and
starts inference servers through their backend's launcher.
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any

from areal_kernel.config.models import ExperimentConfig
from areal_kernel.errors import ArealError


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


class LocalScheduler:
    def __init__(self, config: ExperimentConfig) -> None:
        from areal_kernel.platforms import current_platform

        self.config = config
        self.platform = current_platform()
        self._launchers: list[Any] = []
        self._train_procs: list[subprocess.Popen] = []

    def device_plan(self) -> dict[str, list[list[int]]]:
        """Device ids per process: ``{"actor": [[0], [1]], "rollout": [[2, 3]]}``."""
        actor = self.config.actor.allocation
        rollout = self.config.rollout.allocation
        if not self.platform.exclusive_devices:  # shared host cores: no ids to hand out
            return {"actor": [[] for _ in range(actor.world_size)], "rollout": [[] for _ in range(rollout.d)]}
        need = actor.world_size + rollout.d * rollout.devices_per_replica
        have = self.platform.device_count()
        if need > have:
            raise ArealError(
                f"the run needs {need} {self.platform.device_type} devices (actor {actor}, rollout {rollout}) "
                f"but this machine has {have}; see `areal plan`"
            )
        ids = iter(range(need))
        return {
            "actor": [[next(ids)] for _ in range(actor.world_size)],
            "rollout": [[next(ids) for _ in range(rollout.devices_per_replica)] for _ in range(rollout.d)],
        }

    def start_inference(self, backend: Any, model_dir: str, run_dir: str) -> list[str]:
        plan = self.device_plan()["rollout"]
        addresses = backend.launch(model_dir, plan, run_dir)
        self._launchers.append(backend)
        return addresses

    def start_train_ranks(
        self, argv: list[str], log_dir: str, env: dict[str, str] | None = None
    ) -> list[subprocess.Popen]:
        """Start one process per actor rank (``actor.allocation.world_size``,
        e.g. 2 for ``fsdp:d2``) running ``argv``, with the torch.distributed
        environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
        ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), the rank's
        devices made visible through the platform, and ``OMP_NUM_THREADS=1``.
        Each rank runs in its own session (``stop`` kills the whole group) and
        logs to ``<log_dir>/rank-<r>.log``."""
        from areal_kernel.utils.network import find_free_port

        plan = self.device_plan()["actor"]
        os.makedirs(log_dir, exist_ok=True)
        master_port = find_free_port()
        procs: list[subprocess.Popen] = []
        for rank, devices in enumerate(plan):
            e = dict(os.environ)
            e.update(env or {})
            e.update(
                OMP_NUM_THREADS="1",
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(len(plan)),
                LOCAL_WORLD_SIZE=str(len(plan)),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(master_port),
            )
            e.update(self.platform.visible_devices_env_for(devices))
            with open(os.path.join(log_dir, f"rank-{rank}.log"), "ab") as logf:
                p = subprocess.Popen(
                    argv,
                    env=e,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            # Tracked at once: if a later rank fails to start, stop() still finds this one.
            self._train_procs.append(p)
            procs.append(p)
        return procs

    def stop(self) -> None:
        for backend in self._launchers:
            backend.stop()
        self._launchers.clear()
        procs, self._train_procs = self._train_procs, []
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
