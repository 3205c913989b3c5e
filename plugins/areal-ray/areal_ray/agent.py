"""The node agent: one Ray actor per placement, living in its role's
placement-group bundle on the node Ray chose. It starts the placement's
process there (``spawn_local``: its own session, ``AREAL_PARENT_PID`` set to
the agent, so the process exits if the agent dies with the controller) and
answers poll, signal and log calls for it.
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any

from areal_kernel.api.scheduler import LocalProcess, Placement, spawn_local
from areal_kernel.utils.procs import tail_file
from areal_kernel.utils.network import find_free_port


class NodeAgent:
    """Built by ``RayScheduler`` as a Ray actor (``ray.remote`` applied there)."""

    def __init__(self, resource: str | None) -> None:
        self.resource = resource
        self.procs: dict[int, LocalProcess] = {}

    def where(self) -> dict[str, Any]:
        """The node this agent runs on, its address, and the devices Ray gave it."""
        import ray

        ctx = ray.get_runtime_context()
        devices: list[int] = []
        if self.resource:
            devices = [int(i) for i in ctx.get_accelerator_ids().get(self.resource, [])]
        return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "devices": devices}  # fmt: skip

    def free_port(self, host: str) -> int:
        return find_free_port(host)

    def spawn(self, placement: Placement, argv: list[str], env: dict[str, str], log_path: str) -> int:
        h = spawn_local(argv, env, log_path, placement)
        self.procs[h.pid] = h
        return h.pid

    def poll(self, pid: int) -> int | None:
        return self.procs[pid].poll()

    def wait(self, pid: int, timeout: float) -> int | None:
        try:
            return self.procs[pid].wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def signal_group(self, pid: int, sig: int) -> None:
        self.procs[pid].signal_group(sig)

    def log_tail(self, path: str, n: int) -> str:
        return tail_file(path, n)

    def stop_all(self, grace_s: float) -> list[int]:
        """Kill every group this agent started (SIGTERM, then SIGKILL); the pids."""
        for h in self.procs.values():
            if h.poll() is None:
                h.signal_group(signal.SIGTERM)
        for h in self.procs.values():
            try:
                h.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
            h.kill()  # children may outlive the leader
            try:
                h.wait(5)
            except subprocess.TimeoutExpired:
                pass
        return list(self.procs)
