"""The ``ray`` scheduler: each role of a run gets a Ray placement group.

- It joins the cluster at ``scheduler.ray.address`` or, when unset, starts a
  local one-node cluster for the run (ended with it).
- ``plan()`` reserves one placement group per role (``actor``, ``rollout``),
  one bundle per process, of the platform's Ray resource (``GPU``, ``NPU``;
  ``CPU`` bundles where host cores are shared), and puts a small agent actor
  (``areal_ray.agent.NodeAgent``) in every bundle: the node Ray chose is the
  placement's node, its address the placement's host, the accelerator ids
  Ray gave the agent its devices. Server and rank processes start later,
  through the kernel's contract (``spawn``), from that agent.
- Every call into the cluster has a timeout (``scheduler.ray.timeout_s``): a
  lost node never hangs the controller; its processes poll as ``NODE_LOST``
  and the kernel's server supervisor takes over.
- ``extra_placement()`` (an elastic fleet growing, ``rollout.elastic``)
  reserves a placement group of one bundle for each server started mid-run,
  shaped like the role's bundles, with its own agent.
- ``stop()`` ends every process (through its agent), then kills the agents
  and removes the placement groups (the mid-run ones too); nothing of the
  run is left on the cluster.
"""

from __future__ import annotations

import math
import os
import subprocess
import threading
import time
import uuid
from typing import Any

from areal_kernel.api.scheduler import ACTOR, NODE_LOST, ROLLOUT, Placement, ProcessHandle, SchedulePlan, Scheduler
from areal_kernel.errors import ArealError
from areal_kernel.utils.procs import tail_file
from areal_kernel.logging import get_logger
from areal_kernel.utils.network import is_loopback

from areal_ray.config import RaySettings

log = get_logger(__name__)


def _ray() -> Any:
    import ray

    return ray


def _lost_errors() -> tuple[type[BaseException], ...]:
    """What a call to an agent raises when the agent or its node is gone."""
    from ray import exceptions as rx

    return tuple(
        getattr(rx, n) for n in ("RayActorError", "ActorDiedError", "ActorUnavailableError", "NodeDiedError")
        if hasattr(rx, n)
    )  # fmt: skip


class RayProcess(ProcessHandle):
    """A server or rank started by its placement's agent."""

    def __init__(self, sched: "RayScheduler", agent: Any, placement: Placement, pid: int, log_path: str) -> None:
        self._sched = sched
        self._agent = agent
        self.placement = placement
        self.pid = pid
        self.log_path = log_path
        self.returncode = None

    def _call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        ray = _ray()
        ref = getattr(self._agent, method).remote(*args)
        return ray.get(ref, timeout=timeout if timeout is not None else self._sched.settings.timeout_s)

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        from ray.exceptions import GetTimeoutError

        try:
            self.returncode = self._call("poll", self.pid)
        except _lost_errors():
            self.returncode = NODE_LOST  # the agent died: its node (or the agent process) is gone
        except GetTimeoutError:
            return None  # the cluster is slow to answer: still counted as running
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.poll() is not None:
                assert self.returncode is not None
                return self.returncode
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"pid {self.pid} on {self.placement.node}", timeout or 0)
            step = min(1.0, left) if left is not None else 1.0
            try:
                rc = self._call("wait", self.pid, step, timeout=step + self._sched.settings.timeout_s)
            except _lost_errors():
                rc = NODE_LOST
            except Exception:  # noqa: BLE001 - a slow answer: poll again
                rc = None
            if rc is not None:
                self.returncode = rc

    def signal_group(self, sig: int) -> None:
        if self.returncode == NODE_LOST:
            return
        try:
            self._call("signal_group", self.pid, sig)
        except Exception as e:  # noqa: BLE001 - a lost node has nothing left to signal
            log.info("could not signal a process on its node", node=self.placement.node, pid=self.pid, error=str(e))

    def log_tail(self, n: int) -> str:
        try:
            return str(self._call("log_tail", self.log_path, n))
        except Exception:  # noqa: BLE001 - the node is gone: what this machine can see
            return tail_file(self.log_path, n)


class RayScheduler(Scheduler):
    """``scheduler.type: ray``; settings in ``scheduler.ray`` (``RaySettings``)."""

    name = "ray"
    settings: RaySettings

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        if self.settings is None:
            self.settings = RaySettings()
        self._pgs: dict[str, Any] = {}
        self._placed: SchedulePlan | None = None  # plan() reserves once, until release()
        self._agents: dict[tuple[str, int], Any] = {}
        self._added: list[Placement] = []  # given out mid-run (extra_placement)
        # Guards _pgs, _agents and _added: extra_placement runs on the fleet's thread.
        self._lock = threading.Lock()
        self._connected_here = False  # this scheduler called ray.init (so it calls ray.shutdown)
        self._tag = f"{config.experiment_name}-{uuid.uuid4().hex[:8]}"

    # -- the cluster ------------------------------------------------------------------
    def connect(self) -> None:
        """Join the cluster (or start a local one); nothing when this process already has."""
        s = self.settings
        if is_loopback(s.node_ip_address):
            # Otherwise Ray swaps a loopback address for the interface address
            # and the driver dials a node that never listened there. Read when
            # ray is first imported: set before that.
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        ray = _ray()
        if ray.is_initialized():
            return
        kwargs: dict[str, Any] = dict(
            namespace=s.namespace, _node_ip_address=s.node_ip_address, log_to_driver=False,
            configure_logging=False, ignore_reinit_error=True,
        )  # fmt: skip
        try:
            if s.address:
                ray.init(address=s.address, **kwargs)
            else:
                # "local": always a new cluster, never one found running on this machine.
                ray.init(address="local", num_cpus=self._local_cpus(), include_dashboard=False, **kwargs)
        except Exception as e:
            where = f"the cluster at {s.address}" if s.address else "a local cluster"
            raise ArealError(f"scheduler.ray.address: cannot reach {where}: {type(e).__name__}: {e}") from None
        self._connected_here = True

    def _local_cpus(self) -> int:
        """CPUs of a local cluster: ``num_cpus``, else this machine's cores, but
        at least what the run's bundles ask for, up to ``rollout.elastic.max``
        servers (on CPU hosts every process is single-threaded and they share
        cores, as under ``local``)."""
        if self.settings.num_cpus is not None:
            return self.settings.num_cpus
        sizes = self._role_sizes()
        elastic = getattr(self.config.rollout, "elastic", None)
        if ROLLOUT in sizes and elastic is not None:  # room for the servers an elastic fleet may add
            sizes[ROLLOUT] = (max(sizes[ROLLOUT][0], elastic.max), sizes[ROLLOUT][1])
        need = sum(n for n, _ in sizes.values()) * self.settings.cpus_per_process
        return max(os.cpu_count() or 1, math.ceil(need))

    @property
    def resource(self) -> str:
        """The platform's Ray resource per device (``GPU``, ``NPU``), ``CPU`` without exclusive devices."""
        if self.platform.exclusive_devices and self.platform.ray_resource_name:
            return self.platform.ray_resource_name
        return "CPU"

    def _role_sizes(self) -> dict[str, tuple[int, int]]:
        """Role -> (processes, devices per process)."""
        from areal_kernel.trainer.common import uses_rollout

        actor = self.config.actor.allocation
        sizes = {ACTOR: (actor.world_size, 1)}
        if uses_rollout(self.config):
            rollout = self.config.rollout.allocation
            sizes[ROLLOUT] = (rollout.d, rollout.devices_per_replica)
        return sizes

    def plan(self) -> SchedulePlan:
        if self._placed is not None:
            return self._placed
        self.connect()  # first: it sets the environment ray reads at import
        ray = _ray()
        from ray.util.placement_group import placement_group, remove_placement_group

        s = self.settings
        strategies = {ACTOR: s.actor_strategy, ROLLOUT: s.rollout_strategy}
        roles: dict[str, list[Placement]] = {}
        try:
            for role, (n, per) in self._role_sizes().items():
                bundle = self._bundle(per)
                pg = placement_group([dict(bundle) for _ in range(n)], strategy=strategies[role],
                                     name=f"areal-{self._tag}-{role}")  # fmt: skip
                with self._lock:
                    self._pgs[role] = pg
                try:
                    ray.get(pg.ready(), timeout=s.placement_timeout_s)
                except Exception:
                    remove_placement_group(pg)
                    with self._lock:
                        del self._pgs[role]
                    raise ArealError(
                        f"scheduler.ray: the {role} role's {n} bundle(s) of {bundle} ({strategies[role]}) were not "
                        f"placed within {s.placement_timeout_s:g} s (scheduler.ray.placement_timeout_s); the "
                        f"cluster has {ray.cluster_resources()}"
                    ) from None
                agents = [self._start_agent(pg, i, role, i, per) for i in range(n)]
                where = ray.get([a.where.remote() for a in agents], timeout=s.placement_timeout_s)
                roles[role] = self._placements_of(role, list(range(n)), where)
        except BaseException:
            self.release()
            raise
        self._placed = SchedulePlan(self.name, self.platform.name, roles)
        return self._placed

    def _bundle(self, per: int) -> dict[str, float]:
        """One process's bundle: its CPUs, and ``per`` devices of the platform's resource."""
        bundle: dict[str, float] = {"CPU": self.settings.cpus_per_process}
        if self.resource != "CPU":
            bundle[self.resource] = per
        return bundle

    def _start_agent(self, pg: Any, bundle_index: int, role: str, index: int, per: int) -> Any:
        """A ``NodeAgent`` in bundle ``bundle_index`` of ``pg``, recorded as
        placement ``(role, index)``'s agent (``spawn`` and ``free_port`` find it)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from areal_ray.agent import NodeAgent

        res = self.resource
        opts: dict[str, Any] = dict(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle_index),
            num_cpus=self.settings.cpus_per_process, max_concurrency=8, name=f"areal-{self._tag}-{role}-{index}",
        )  # fmt: skip
        if res != "CPU":
            opts["resources"] = {res: per}
        agent = _ray().remote(NodeAgent).options(**opts).remote(res if res != "CPU" else None)
        with self._lock:
            self._agents[(role, index)] = agent
        return agent

    def _placements_of(self, role: str, indices: list[int], where: list[dict[str, Any]]) -> list[Placement]:
        """Placements from what the agents report (``NodeAgent.where``): the
        address the cluster knows each node by (what its raylet was started
        with), else what the agent's host reports."""
        known = {n["NodeID"]: n.get("NodeManagerAddress") for n in _ray().nodes() if n.get("Alive")}
        return [
            Placement(role, i, w["node_id"], known.get(w["node_id"]) or w["ip"], tuple(w["devices"]))
            for i, w in zip(indices, where)
        ]

    def extra_placement(self, role: str, index: int) -> Placement:
        """One more process of ``role`` while the run goes on (an elastic
        fleet growing): a placement group of one bundle shaped like the
        role's, named ``areal-<run>-<role>-<index>``, waited for up to
        ``placement_timeout_s``, with an agent in it. ``release`` removes it
        with the others."""
        if self._placed is None:  # never planned, or released: the run is not (or no longer) placed
            raise ArealError(f"scheduler.ray: cannot add a {role} process to a run that is not placed")
        ray = _ray()
        from ray.util.placement_group import placement_group, remove_placement_group

        s = self.settings
        sizes = self._role_sizes()
        if role not in sizes:
            raise ArealError(f"scheduler.ray: this run has no {role} role to add a process to")
        key = f"{role}-{index}"
        with self._lock:
            if key in self._pgs or (role, index) in self._agents:
                raise ArealError(f"scheduler.ray: {role} placement {index} is already reserved")
        per = sizes[role][1]
        bundle = self._bundle(per)
        pg = placement_group([dict(bundle)], strategy="PACK", name=f"areal-{self._tag}-{key}")
        with self._lock:
            self._pgs[key] = pg  # recorded at once: a release meanwhile removes it

        def give_back() -> None:
            with self._lock:
                agent = self._agents.pop((role, index), None)
                self._pgs.pop(key, None)
            if agent is not None:
                try:
                    ray.kill(agent, no_restart=True)
                except Exception:  # noqa: BLE001 - already dead
                    pass
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - already removed
                pass

        try:
            ray.get(pg.ready(), timeout=s.placement_timeout_s)
        except Exception:
            give_back()
            raise ArealError(
                f"scheduler.ray: no room for another {role} process: its bundle {bundle} was not placed within "
                f"{s.placement_timeout_s:g} s (scheduler.ray.placement_timeout_s); the cluster has "
                f"{ray.cluster_resources()}, of which {ray.available_resources()} are free"
            ) from None
        try:
            with self._lock:
                if self._pgs.get(key) is not pg:  # released while it was being placed: the run is ending
                    raise ArealError(f"scheduler.ray: the run ended while {role} placement {index} was reserved")
            agent = self._start_agent(pg, 0, role, index, per)
            (where,) = ray.get([agent.where.remote()], timeout=s.placement_timeout_s)
            (placement,) = self._placements_of(role, [index], [where])
            with self._lock:
                if self._pgs.get(key) is not pg:
                    raise ArealError(f"scheduler.ray: the run ended while {role} placement {index} was started")
        except BaseException:
            give_back()
            raise
        with self._lock:
            self._added.append(placement)
        log.info("placed one more process", role=role, index=index, node=placement.node, host=placement.host)
        return placement

    # -- the contract -----------------------------------------------------------------
    def _agent(self, placement: Placement) -> Any:
        self.plan()
        agent = self._agents.get((placement.role, placement.index))
        if agent is None:
            raise ArealError(f"no {placement.role} placement {placement.index} in this run's plan")
        return agent

    def spawn(self, placement: Placement, argv: list[str], env: dict[str, str], log_path: str) -> ProcessHandle:
        from ray.exceptions import GetTimeoutError

        agent = self._agent(placement)
        failures: tuple[type[BaseException], ...] = (GetTimeoutError, *_lost_errors())
        try:
            pid = _ray().get(agent.spawn.remote(placement, argv, env, log_path), timeout=self.settings.timeout_s)
        except failures as e:
            # The launcher turns OSError into its "cannot start" error (the supervisor retries).
            raise OSError(f"the agent on node {placement.node} did not start the process: {type(e).__name__}") from e
        return RayProcess(self, agent, placement, int(pid), log_path)

    def free_port(self, placement: Placement) -> int:
        agent = self._agent(placement)
        return int(_ray().get(agent.free_port.remote(placement.host), timeout=self.settings.timeout_s))

    def controller_host(self) -> str:
        return self.settings.node_ip_address

    def release(self) -> None:
        ray = _ray()
        if not ray.is_initialized():
            return
        from ray.util.placement_group import remove_placement_group

        with self._lock:
            agents, self._agents = self._agents, {}
            pgs, self._pgs = self._pgs, {}
            self._added = []
        # What the agents started is normally gone already (stop() ended it);
        # this catches a process started outside the launcher and ranks' kin.
        refs = [a.stop_all.remote(5.0) for a in agents.values()]
        for ref in refs:
            try:
                ray.get(ref, timeout=self.settings.timeout_s)
            except Exception:  # noqa: BLE001 - a lost agent has nothing left to stop
                pass
        for a in agents.values():
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
        for pg in pgs.values():
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - already removed
                pass
        self._placed = None
        if self._connected_here:
            self._connected_here = False
            ray.shutdown()
