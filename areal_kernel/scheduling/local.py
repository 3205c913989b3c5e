"""The ``local`` scheduler: every role runs as processes on this machine.

It hands out device ids per role (accelerators are never shared between
roles; on CPU every process is single-threaded and cores are shared) and
starts inference servers through their backend's launcher.
"""
from __future__ import annotations

from typing import Any

from areal_kernel.config.models import ExperimentConfig
from areal_kernel.errors import ArealError


class LocalScheduler:
    def __init__(self, config: ExperimentConfig) -> None:
        from areal_kernel.platforms import current_platform

        self.config = config
        self.platform = current_platform()
        self._launchers: list[Any] = []

    def device_plan(self) -> dict[str, list[list[int]]]:
        """Device ids per process: ``{"actor": [[0], [1]], "rollout": [[2, 3]]}``."""
        actor = self.config.actor.allocation
        rollout = self.config.rollout.allocation
        if self.platform.device_type == "cpu":
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

    def stop(self) -> None:
        for backend in self._launchers:
            backend.stop()
        self._launchers.clear()
