"""The contract of an inference backend (``areal_register_inference_engines``).

The kernel builds the registered target once per run, in the controller
process, and calls it in this order (``areal_kernel.trainer.components.Rollout``):

1. ``Backend.from_context(context)`` (an ``InferenceBackendContext`` of
   ``areal_kernel.api.inference_engine``; the default calls
   ``Backend(config)``): ``config`` is the validated ``ExperimentConfig``; the
   backend's own section (``rollout.<name>``, validated against its
   ``config_model``) is ``config.rollout.plugin_config`` (``None`` without one).
2. ``place(scheduler, placements)`` then ``launch(model_dir, device_plan,
   run_dir) -> list[str]`` (both from the scheduler's ``start_inference``):
   the launcher starts server ``i`` on ``placements[i]`` (its node, bind
   host and devices) through ``scheduler.spawn``; one server per entry of
   ``device_plan`` (the device ids each server may use; empty lists on hosts
   whose cores are shared) and return their ``host:port`` addresses once all
   are healthy. Servers log under ``run_dir``.
3. ``make_client(addresses) -> RemoteInferenceEngine``: the client the
   rollout, the weight transports and the supervisor use (generation runs on
   the rollout thread's event loop, control calls on the controller thread).
4. If ``launcher`` is a ``SubprocessLauncher`` and ``rollout.restart_servers``
   is on, a supervisor thread restarts a server whose process dies
   (``launcher.exited`` / ``launcher.restart``) and brings it to the current
   weights through the client (``resync_server``).
5. ``stop()`` when the run ends (completed, failed or interrupted): stop
   every server process this backend started.

``InferenceBackend`` implements 2 and 5 on top of ``make_launcher``; a
backend normally writes ``__init__`` (read its section), ``make_launcher``
and ``make_client``.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

from areal_kernel.api.scheduler import Placement
from areal_kernel.inference.client import RemoteInferenceEngine
from areal_kernel.inference.launcher import SubprocessLauncher

if TYPE_CHECKING:
    from areal_kernel.api.inference_engine import InferenceBackendContext


class InferenceBackend(abc.ABC):
    """Base class of inference backends; see the module docstring for when
    the kernel calls what."""

    @classmethod
    def from_context(cls, context: "InferenceBackendContext") -> "InferenceBackend":
        """The factory the kernel calls (``Registry.build``); the default is
        ``cls(context.config)``, so a subclass writes that constructor."""
        return cls(context.config)

    def __init__(self, config: Any) -> None:
        self.config = config
        # Set by ``launch``; the supervisor restarts servers through it.
        self.launcher: SubprocessLauncher | None = None
        # Set by ``place`` (the scheduler, before ``launch``).
        self.scheduler: Any = None
        self.placements: list[Placement] | None = None

    def place(self, scheduler: Any, placements: list[Placement]) -> None:
        """Where the servers of the next ``launch`` run, and the scheduler
        (``areal_kernel.api.scheduler.Scheduler``) that starts them there."""
        self.scheduler = scheduler
        self.placements = list(placements)

    @abc.abstractmethod
    def make_launcher(self, run_dir: str) -> SubprocessLauncher:
        """A launcher for this run's servers (logs and scratch under ``run_dir``)."""

    @abc.abstractmethod
    def make_client(self, addresses: list[str]) -> RemoteInferenceEngine:
        """The client of the servers at ``addresses`` (those ``launch`` returned)."""

    def launch(self, model_dir: str, device_plan: list[list[int]], run_dir: str) -> list[str]:
        self.launcher = self.make_launcher(run_dir)
        if self.placements is not None:
            self.launcher.place(self.scheduler, self.placements)
        per_server = len(device_plan[0]) if device_plan else 0
        infos = self.launcher.launch(model_dir, n_servers=max(1, len(device_plan)), devices_per_server=per_server)
        return [i.address for i in infos]

    def stop(self) -> None:
        if self.launcher is not None:
            self.launcher.stop()
