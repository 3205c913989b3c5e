"""The scheduler contract (``areal_register_schedulers``, ``scheduler.type``).

A scheduler decides *where* each process of a run lives and starts it there.
The kernel builds the registered class once per run, in the controller
process, as ``Scheduler.from_context(SchedulerContext(...))`` (through
``Registry.build("scheduler", name, context)``; the default calls
``Scheduler(config)``) and uses it in this order
(``areal_kernel.trainer.components.Rollout`` and the train engines):

1. ``plan() -> SchedulePlan``: roles -> placements (node, host, devices).
   Nothing starts; ``areal plan CONFIG`` prints it. Raises ``ArealError``
   when the run cannot fit.
2. ``start_inference(backend, model_dir, run_dir) -> addresses``: the
   inference servers of the ``rollout`` role, each started on its node
   through ``spawn`` by the backend's launcher (a ``SubprocessLauncher``),
   bound to its node's ``host``.
3. ``start_train_ranks(argv, log_dir, env) -> [ProcessHandle]``: one process
   per actor rank on its node, with the torch.distributed environment whose
   ``MASTER_ADDR``/``MASTER_PORT`` come from ``rendezvous("actor")`` (on the
   rank-0 node).
4. While the run goes on, the server supervisor polls each server's
   ``ProcessHandle``: a process that exited, or a node that was lost
   (``poll()`` returns ``NODE_LOST``), is reported there and restarted on
   its placement.
5. ``stop()``: end everything it started, leaving no process (and, for
   cluster schedulers, no actor or reservation) behind. Safe to call twice.

``Scheduler`` implements 2, 3 and the bookkeeping on top of four methods a
scheduler writes: ``plan``, ``spawn``, ``free_port`` and ``release``. The
built-in ``local`` scheduler (``areal_kernel.scheduling.local``) is the
reference implementation; ``areal-ray`` places the same roles on a Ray
cluster.
"""

from __future__ import annotations

import abc
import os
import subprocess
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from areal_kernel.api.kinds import KindContract, from_context
from areal_kernel.utils import prefork
from areal_kernel.utils.procs import tail_file, wait_group_gone

if TYPE_CHECKING:
    from areal_kernel.config.models import ExperimentConfig
    from areal_kernel.platforms import Platform
    from areal_kernel.utils.network import PortReservation

# ``ProcessHandle.poll()`` of a process whose node is gone (its exit code is
# unknowable). Negative like a signal exit, outside the signal range.
NODE_LOST = -1000

# Set by every ``spawn`` to the pid of the process that started this one (the
# scheduler's agent on that node, or the controller for ``local``). Servers and
# ranks watch it and exit once orphaned, so a killed controller leaves nothing.
PARENT_PID_ENV = "AREAL_PARENT_PID"

# The roles a run places, in the order ``plan()`` lists them.
ACTOR = "actor"
ROLLOUT = "rollout"


@dataclass(frozen=True)
class Placement:
    """Where one process of a role runs.

    - ``role``: ``"actor"`` (train ranks) or ``"rollout"`` (inference servers).
    - ``index``: the rank, or the server's index, within the role.
    - ``node``: the scheduler's name for the node (``"local"`` for this
      machine; a Ray node id; a Slurm host name).
    - ``host``: the address processes on that node bind and others dial.
      A server bound beyond loopback requires an admin token (the kernel's
      launchers generate one).
    - ``devices``: device ids on that node the process may use (empty where
      host cores are shared, as on CPU).
    """

    role: str
    index: int
    node: str
    host: str
    devices: tuple[int, ...] = ()


@dataclass(frozen=True)
class SchedulePlan:
    """What ``plan()`` decided: every role's placements, in index order."""

    scheduler: str
    platform: str
    roles: dict[str, list[Placement]]
    notes: list[str] = field(default_factory=list)

    def nodes(self) -> list[str]:
        """The distinct nodes used, in first-use order."""
        seen: dict[str, None] = {}
        for placements in self.roles.values():
            for p in placements:
                seen.setdefault(p.node, None)
        return list(seen)

    def to_dict(self) -> dict[str, Any]:
        return {
            "scheduler": self.scheduler,
            "platform": self.platform,
            "roles": {
                role: [{"index": p.index, "node": p.node, "host": p.host, "devices": list(p.devices)} for p in ps]
                for role, ps in self.roles.items()
            },
            "notes": list(self.notes),
        }


class ProcessHandle(abc.ABC):
    """A process a scheduler started on a node, leading its own session (so
    one signal reaches everything it spawned). The subset of
    ``subprocess.Popen`` the kernel and engines use, valid for a process on
    another machine too."""

    placement: Placement
    pid: int  # on its node
    log_path: str  # where its output goes, on its node
    returncode: int | None = None

    @abc.abstractmethod
    def poll(self) -> int | None:
        """The exit code once it ended (``NODE_LOST`` when its node is gone), else ``None``."""

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> int:
        """Wait for the end; raise ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""

    @abc.abstractmethod
    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the process's whole group (nothing if it is gone)."""

    @abc.abstractmethod
    def log_tail(self, n: int) -> str:
        """The last ``n`` lines of its log, read on its node."""

    def kill(self) -> None:
        """SIGKILL the whole group."""
        import signal

        self.signal_group(signal.SIGKILL)

    def wait_group_gone(self, timeout: float) -> bool:
        """After the group was killed: wait until none of its processes runs
        (a killed process that held GBs takes a moment to free them); False
        if one still does after ``timeout`` seconds. This default returns
        True at once: a handle that cannot see the group's members (a
        process on another node) has nothing to wait on."""
        return True


@dataclass(frozen=True)
class ProcessStatus:
    """One started process as ``Scheduler.health()`` reports it."""

    placement: Placement
    pid: int
    returncode: int | None  # None: running; NODE_LOST: its node is gone
    log_path: str

    @property
    def alive(self) -> bool:
        return self.returncode is None


class LocalProcess(ProcessHandle):
    """A ``ProcessHandle`` over a ``subprocess.Popen`` on this machine (started
    with ``start_new_session=True``)."""

    def __init__(self, popen: subprocess.Popen, placement: Placement, log_path: str) -> None:
        self.popen = popen
        self.placement = placement
        self.pid = popen.pid
        self.log_path = log_path

    def poll(self) -> int | None:
        self.returncode = self.popen.poll()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self.returncode = self.popen.wait(timeout)
        return self.returncode

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def wait_group_gone(self, timeout: float) -> bool:
        return wait_group_gone(self.pid, timeout)

    def log_tail(self, n: int) -> str:
        return tail_file(self.log_path, n)


def spawn_local(argv: list[str], env: dict[str, str], log_path: str, placement: Placement) -> LocalProcess:
    """Start ``argv`` on this machine in its own session, output appended to
    ``log_path``. The building block of ``LocalScheduler.spawn`` (and of a
    cluster scheduler's agent on its node)."""
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    env = {**env, PARENT_PID_ENV: str(os.getpid())}
    with open(log_path, "ab") as logf:
        # Through a prefork server when the environment names one (PREFORK_ENV):
        # a Python program then starts without re-importing torch.
        popen = prefork.popen(
            argv, env=env, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    return LocalProcess(popen, placement, log_path)


@dataclass(frozen=True)
class SchedulerContext:
    """What a scheduler is built with: the selected ``name`` (``scheduler.type``,
    ``auto`` resolved) and the whole validated ``config``; its
    ``scheduler.<name>`` section is ``config.scheduler.section(name)``.
    ``roles``: the roles it places; a train engine used outside a run (the
    scheduler it makes for its own ranks) asks for ``(ACTOR,)``, so no
    device is held for inference servers it never starts."""

    name: str
    config: "ExperimentConfig"
    roles: tuple[str, ...] = (ACTOR, ROLLOUT)


class Scheduler(abc.ABC):
    """Base class of schedulers; see the module docstring for the order of calls.

    A subclass sets ``name`` and implements ``plan``, ``spawn``, ``free_port``
    and ``release``; it may override ``role_env``, ``controller_host`` and
    ``stop``. ``self.config`` is the validated ``ExperimentConfig``;
    ``self.settings`` its ``scheduler.<name>`` section (validated against the
    registered ``config_model``; ``None`` without one); ``self.platform`` the
    platform the roles run on.
    """

    name: ClassVar[str] = "scheduler"
    # The roles ``plan`` places (``SchedulerContext.roles``).
    roles: tuple[str, ...] = (ACTOR, ROLLOUT)
    # Whether ``plan`` honours ``rollout.share_devices`` (inference servers on
    # the train ranks' devices); a scheduler that does not is refused such a
    # run when built, rather than placing the servers apart unasked.
    shares_devices: ClassVar[bool] = False

    @classmethod
    def from_context(cls, context: "SchedulerContext") -> "Scheduler":
        """The factory the kernel calls (``Registry.build``); the default is
        ``cls(context.config)``, so a subclass writes that constructor;
        ``roles`` is set from the context after it."""
        scheduler = cls(context.config)
        scheduler.roles = tuple(context.roles)
        return scheduler

    def __init__(self, config: "ExperimentConfig") -> None:
        from areal_kernel.platforms import current_platform

        if config.rollout.share_devices and not type(self).shares_devices:
            from areal_kernel.errors import ArealError

            raise ArealError(
                f"rollout.share_devices: the scheduler {self.name!r} cannot place inference servers on the train "
                "ranks' devices; use scheduler.type: local, or give the servers devices of their own "
                "(rollout.share_devices: false)"
            )
        self.config = config
        self.settings: Any = config.scheduler.section(self.name)
        self.platform: "Platform" = current_platform()
        self._procs: dict[str, list[ProcessHandle]] = {}
        self._launchers: list[Any] = []
        self._plan: SchedulePlan | None = None
        self._extra: list[Placement] = []  # placements given out mid-run (extra_placement)
        self._held_ports: list["PortReservation"] = []  # rendezvous ports held until stop

    # -- what a scheduler writes --------------------------------------------------
    @abc.abstractmethod
    def plan(self) -> SchedulePlan:
        """Roles -> placements, deciding only (no process starts). Must give
        ``actor.allocation.world_size`` actor placements and, when the run has
        inference servers, ``rollout.allocation.d`` rollout placements."""

    @abc.abstractmethod
    def spawn(self, placement: Placement, argv: list[str], env: dict[str, str], log_path: str) -> ProcessHandle:
        """Start ``argv`` on ``placement.node`` in its own session with ``env``
        as its environment plus ``PARENT_PID_ENV`` (the pid of the process
        starting it there), output to ``log_path``; return at once."""

    @abc.abstractmethod
    def free_port(self, placement: Placement) -> int:
        """A TCP port free on ``placement.host`` right now."""

    @abc.abstractmethod
    def release(self) -> None:
        """Give back what ``plan``/``spawn`` reserved on the cluster (actors,
        reservations, connections). Called by ``stop`` after every process
        is gone."""

    # -- defaults ---------------------------------------------------------------------
    def extra_placement(self, role: str, index: int) -> Placement:
        """A placement for one more process of ``role`` (index ``index``)
        while the run goes on: an elastic fleet growing (``rollout.elastic``).
        A scheduler that can start servers mid-run overrides it (reserving
        what the new process needs); this default says it cannot."""
        from areal_kernel.errors import ArealError

        raise ArealError(
            f"scheduler {self.name!r} cannot start {role} processes while a run goes on (it does not "
            "implement Scheduler.extra_placement); add servers with `areal fleet add` instead"
        )

    def controller_host(self) -> str:
        """The address processes on other nodes dial to reach the controller
        (train ranks report back to it). Default loopback."""
        return "127.0.0.1"

    def on_this_machine(self, placement: Placement) -> bool:
        """Whether ``placement`` is on the controller's machine (its ports can
        be probed from here). Default: its host is a loopback address."""
        from areal_kernel.utils.network import is_loopback

        return is_loopback(placement.host)

    def role_env(self, role: str) -> dict[str, str]:
        """Environment every process of ``role`` gets on top of the
        controller's: single-threaded OpenMP (each process is one worker)."""
        return {"OMP_NUM_THREADS": "1"}

    def placements(self, role: str) -> list[Placement]:
        """``plan()``'s placements of ``role`` (planned once until ``stop``)."""
        if self._plan is None:
            self._plan = self.plan()
        return list(self._plan.roles.get(role, []))

    def rendezvous(self, role: str = ACTOR) -> tuple[str, int]:
        """``(MASTER_ADDR, MASTER_PORT)`` for ``role``'s ranks: rank 0's host
        and a port free there (``free_port``). When rank 0 runs on this
        machine the port is held (``areal_kernel.utils.network.PortReservation``)
        until ``stop``: rank 0 binds it only after its imports, seconds later,
        and any other bind or connection on the machine could take it first."""
        from areal_kernel.utils.network import PortReservation

        first = self.placements(role)[0]
        port = self.free_port(first)
        if not self.on_this_machine(first):
            return first.host, port
        for _ in range(8):
            try:
                self._held_ports.append(PortReservation(first.host, port))
                return first.host, port
            except OSError:  # taken since free_port looked: ask again
                port = self.free_port(first)
        return first.host, port  # not held: as before, rank 0's bind decides

    def device_plan(self) -> dict[str, list[list[int]]]:
        """Device ids per process, per role (``{"actor": [[0], [1]], "rollout": [[2, 3]]}``)."""
        return {role: [list(p.devices) for p in self.placements(role)] for role in (ACTOR, ROLLOUT)}

    def start_inference(self, backend: Any, model_dir: str, run_dir: str) -> list[str]:
        """Start the rollout role's servers through ``backend.launch`` on their
        placements and return their ``host:port`` addresses."""
        placements = self.placements(ROLLOUT)
        backend.place(self, placements)
        self._launchers.append(backend)
        return backend.launch(model_dir, [list(p.devices) for p in placements], run_dir)

    def start_train_ranks(self, argv: list[str], log_dir: str, env: dict[str, str] | None = None) -> list[Any]:
        """One process per actor rank running ``argv`` on its node, with
        ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
        ``MASTER_ADDR``, ``MASTER_PORT`` (``rendezvous``), ``role_env``,
        ``env`` and the rank's devices made visible; output in
        ``<log_dir>/rank-<r>.log``. Returns the ranks' ``ProcessHandle``."""
        placements = self.placements(ACTOR)
        master_addr, master_port = self.rendezvous(ACTOR)
        per_node: dict[str, int] = {}
        for p in placements:
            per_node[p.node] = per_node.get(p.node, 0) + 1
        seen: dict[str, int] = {}
        handles: list[ProcessHandle] = []
        for p in placements:
            local_rank = seen.get(p.node, 0)
            seen[p.node] = local_rank + 1
            e = dict(os.environ)
            e.update(env or {})
            e.update(self.role_env(ACTOR))
            e.update(
                RANK=str(p.index),
                LOCAL_RANK=str(local_rank),
                WORLD_SIZE=str(len(placements)),
                LOCAL_WORLD_SIZE=str(per_node[p.node]),
                MASTER_ADDR=master_addr,
                MASTER_PORT=str(master_port),
            )
            e.update(self.platform.visible_devices_env_for(list(p.devices)))
            h = self.spawn(p, argv, e, os.path.join(log_dir, f"rank-{p.index}.log"))
            # Tracked at once: if a later rank fails to start, stop() still ends this one.
            self._procs.setdefault(ACTOR, []).append(h)
            handles.append(h)
        return handles

    def track(self, role: str, handle: ProcessHandle) -> None:
        """Record a process of ``role`` (``health``, ``logs`` and ``stop`` see it)."""
        self._procs.setdefault(role, []).append(handle)

    def health(self) -> list[ProcessStatus]:
        """Every process this scheduler started (servers and ranks), and whether it runs."""
        out: list[ProcessStatus] = []
        for backend in self._launchers:
            launcher = getattr(backend, "launcher", None)
            for h in getattr(launcher, "handles", []) if launcher is not None else []:
                out.append(ProcessStatus(h.placement, h.pid, h.poll(), h.log_path))
        for role, handles in self._procs.items():
            out.extend(ProcessStatus(h.placement, h.pid, h.poll(), h.log_path) for h in handles)
        return out

    def logs(self) -> dict[str, list[str]]:
        """Role -> log paths of every process started (one per process)."""
        out: dict[str, list[str]] = {}
        for s in self.health():
            out.setdefault(s.placement.role, []).append(s.log_path)
        return out

    def stop(self) -> None:
        """Stop the servers (through their backend), kill every rank's group,
        then ``release``. Safe to call twice."""
        launchers, self._launchers = self._launchers, []
        for backend in launchers:
            backend.stop()
        procs, self._procs = self._procs, {}
        for handles in procs.values():
            for h in handles:
                if h.poll() != NODE_LOST:
                    h.kill()  # the leader may be gone while its children live on
                try:
                    h.wait(10)
                except subprocess.TimeoutExpired:
                    pass
        self.release()
        held, self._held_ports = self._held_ports, []
        for reservation in held:
            reservation.release()
        self._plan = None  # what was reserved is given back: a later start plans again


def _old_shape(target: Any, ctx: SchedulerContext) -> Any:
    return target(ctx.config)


def _construct(target: Any, ctx: SchedulerContext, spec: Any) -> Scheduler:
    return from_context(target, ctx, spec, _old_shape, "areal_kernel.api.scheduler.Scheduler")


KIND = KindContract(
    kind="scheduler",
    context=SchedulerContext,
    contract=Scheduler,
    construct=_construct,
    contract_name="areal_kernel.api.scheduler.Scheduler",
    members=("plan", "start_inference", "start_train_ranks", "health", "stop", "platform"),
)
