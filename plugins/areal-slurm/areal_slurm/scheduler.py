"""The ``slurm`` scheduler: a run's roles as Slurm job steps.

Two ways to get nodes (``scheduler.slurm.mode``):

- **allocation**: the controller runs inside a job (``salloc ... areal train``,
  or ``areal train`` in an sbatch script; or ``job_id`` names one) and every
  process is one ``srun`` step of that job, on the node its placement names;
- **submit**: the controller runs outside (a login node) and submits a job
  that holds the nodes (``sbatch``; a heterogeneous job, one component per
  role, when the roles ask for different resources), waits until it runs,
  starts the processes as steps of it, and cancels it when the run ends or
  fails.

Placements come from the job's node list and what it holds on each node
(``scontrol show job -d``): actor ranks first (rank 0 on the first node:
the rendezvous address is its node's ``NodeAddr``), then the inference
servers. Each process's output goes to one log file per process on the
controller's machine (srun relays it), named after its role and index.
A process's ``signal_group`` signals its step (``scancel --signal``), and
``stop`` cancels every step of the run (and a submitted job), so a run
leaves nothing on the nodes; ``scancel`` of the job from outside ends every
process too (the steps go with the job).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from areal_kernel.api.scheduler import (
    ACTOR,
    NODE_LOST,
    PARENT_PID_ENV,
    ROLLOUT,
    Placement,
    ProcessHandle,
    SchedulePlan,
    Scheduler,
)
from areal_kernel.errors import ArealError, ConfigError
from areal_kernel.utils.network import find_free_port, is_loopback
from areal_slurm import commands
from areal_slurm.config import SlurmRoleResources, SlurmSettings

_FINAL_STATES = ("CANCELLED", "COMPLETED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "DEADLINE")
# What the holding job of submit mode runs: nothing, until it is cancelled.
HOLD_SCRIPT = (
    "#!/bin/sh\n# Holds the nodes of an areal run; the run cancels this job when it ends.\nexec sleep 2147483647\n"
)


@dataclass(frozen=True)
class RoleRequest:
    """What one role asks of Slurm."""

    role: str
    processes: int
    cpus: int
    gpus: int
    resources: SlurmRoleResources


# First line a step writes to its log: the process's pid on its node and its step name.
PID_MARK = "=== areal-step pid"


def node_side_argv(argv: list[str], step: str) -> list[str]:
    """``argv`` as its step runs it. ``setsid -w`` gives the process a session
    of its own (one signal reaches everything it spawns) and waits for it;
    the inner shell writes ``PID_MARK <pid> <step>`` to the log (how the
    controller learns the pid on the node), sets ``PARENT_PID_ENV`` to its
    parent (the waiting ``setsid``, which Slurm ends with the step) and
    becomes the process (``exec``). Servers and ranks exit once orphaned; the
    controller's end still ends them, since srun dies with the controller and
    Slurm then cancels the step."""
    inner = f'echo "{PID_MARK} $$ {step}"; {PARENT_PID_ENV}="$PPID" exec "$@"'
    return ["setsid", "-w", "/bin/sh", "-c", inner, "areal-step", *argv]


def _term_with_parent() -> None:
    """In the srun child: receive SIGTERM when the controller dies (even by
    SIGKILL). srun answers SIGTERM by cancelling its step, so no process of
    the run outlives the controller on any node. The kernel delivers this
    when the *thread* that started srun ends, so every srun is started from
    one thread that lives as long as the process (``_popen``), never from the
    short-lived threads that restart servers."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        pass


_spawner: concurrent.futures.ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def _popen(*args: Any, **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen`` on the process-lifetime spawner thread (see ``_term_with_parent``)."""
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="areal-slurm-spawn")
    return _spawner.submit(subprocess.Popen, *args, **kwargs).result()


class SlurmProcess(ProcessHandle):
    """One process as a one-task srun step. ``pid`` is the process's pid on
    its node (read from the first line its step logs; the srun client's pid
    until that line is there, if the step never starts)."""

    def __init__(
        self, popen: subprocess.Popen, placement: Placement, log_path: str, job_id: str, step: str, offset: int = 0
    ) -> None:
        self.popen = popen
        self.placement = placement
        self.log_path = log_path
        self.job_id = job_id
        self.step_name = step
        self._log_offset = offset
        self._pid: int | None = None
        self._step_id: str | None = None

    @property
    def pid(self) -> int:
        deadline = time.monotonic() + 60
        while self._pid is None:
            self._pid = self._logged_pid()
            if self._pid is None:
                if self.popen.poll() is not None or time.monotonic() > deadline:
                    return self.popen.pid
                time.sleep(0.05)
        return self._pid

    @pid.setter
    def pid(self, value: int) -> None:
        self._pid = value

    def _logged_pid(self) -> int | None:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                text = f.read(1 << 20).decode(errors="replace")
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith(PID_MARK) and line.endswith(f" {self.step_name}"):
                return int(line[len(PID_MARK) :].split()[0])
        return None

    def _map(self, rc: int | None) -> int | None:
        # srun ends with an error when the node went away: report it as lost.
        if rc is not None and rc != 0 and commands.node_lost(self.placement.node):
            rc = NODE_LOST
        self.returncode = rc
        return rc

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        return self._map(self.popen.poll())

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        rc = self._map(self.popen.wait(timeout))
        return int(rc if rc is not None else 0)

    def step_id(self) -> str | None:
        """``JOB.STEP`` once Slurm has started the step."""
        if self._step_id is None:
            self._step_id = commands.step_ids(self.job_id).get(self.step_name)
        return self._step_id

    def signal_group(self, sig: int) -> None:
        if self.popen.poll() is not None:
            return
        step = self.step_id()
        if step is None:  # not started yet: srun itself ends the launch
            try:
                os.killpg(self.popen.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            return
        if sig == signal.SIGKILL:
            commands.cancel(step)  # the whole step, every process in it
        else:
            commands.cancel(step, signal.Signals(sig).name.removeprefix("SIG"))

    def log_tail(self, n: int) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(deque(f, maxlen=n))
        except OSError as e:
            return f"(no log: {e})"


class SlurmScheduler(Scheduler):
    """See the module docstring; settings: ``scheduler.slurm`` (``SlurmSettings``)."""

    name = "slurm"

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        if self.settings is None:
            self.settings = SlurmSettings()
        self.job_id: str | None = None  # the job (its leader, for a heterogeneous one)
        self.submitted = False
        self._components: list[commands.JobComponent] | None = None
        self._role_component: dict[str, int] = {}  # role -> het group, when each role has its own
        self._token = secrets.token_hex(3)
        self._spawned = 0
        self._steps: list[SlurmProcess] = []
        self._addrs: dict[str, str] = {}
        self._grown: list[Placement] = []  # servers added mid-run (extra_placement)

    # -- what the run asks for -----------------------------------------------------------------
    @property
    def slurm(self) -> SlurmSettings:
        return self.settings

    def requests(self) -> list[RoleRequest]:
        """Per role: how many processes and what each needs."""
        from areal_kernel.trainer.common import uses_rollout

        exclusive = self.platform.exclusive_devices
        actor, rollout = self.config.actor.allocation, self.config.rollout.allocation
        out = [RoleRequest(ACTOR, actor.world_size, self.slurm.actor.cpus_per_process,
                           self._gpus(self.slurm.actor, 1 if exclusive else 0), self.slurm.actor)]  # fmt: skip
        if uses_rollout(self.config):
            per = rollout.devices_per_replica if exclusive else 0
            out.append(RoleRequest(ROLLOUT, rollout.d, self.slurm.rollout.cpus_per_process,
                                   self._gpus(self.slurm.rollout, per), self.slurm.rollout))  # fmt: skip
        return out

    @staticmethod
    def _gpus(res: SlurmRoleResources, default: int) -> int:
        return default if res.gpus_per_process is None else res.gpus_per_process

    def mode(self) -> str:
        """``allocation`` or ``submit`` (``auto`` resolved)."""
        m = self.slurm.mode
        job = self.slurm.job_id or os.environ.get("SLURM_JOB_ID")
        if m == "allocation" and not job:
            raise ConfigError(
                "scheduler.slurm.mode: 'allocation' needs a job to run in: start the run inside salloc or an "
                "sbatch script, or set scheduler.slurm.job_id"
            )
        if m == "auto":
            return "allocation" if job else "submit"
        return m

    # -- the contract --------------------------------------------------------------------------------
    def plan(self) -> SchedulePlan:
        reqs = self.requests()
        if self.job_id is None and self.mode() == "submit":
            # Nothing is submitted to plan: the nodes are named once the job runs.
            roles = {
                r.role: [Placement(r.role, i, f"({self.slurm.job_name} {r.role} component)", "(pending)", ())
                         for i in range(r.processes)]
                for r in reqs
            }  # fmt: skip
            het = self.heterogeneous(reqs)
            note = (
                f"the roles run in a job submitted when the run starts ({'heterogeneous: one component per role' if het else 'one component'}: "
                + "; ".join(
                    f"{r.role} {r.processes} x {r.cpus} CPU" + (f" + {r.gpus} GPU" if r.gpus else "") for r in reqs
                )
                + ")"
            )
            return SchedulePlan(self.name, self.platform.name, roles, [note])
        job = self.job_id or self.slurm.job_id or os.environ["SLURM_JOB_ID"]
        comps = self._components if self._components is not None else commands.job_components(job)
        if not comps:
            raise ArealError(f"Slurm job {job} does not exist (scontrol show job found nothing)")
        if self.job_id is not None:
            self._components = comps
        return SchedulePlan(self.name, self.platform.name, self._place(job, comps, reqs))

    def placements(self, role: str) -> list[Placement]:
        self.ensure_job()
        return super().placements(role)

    def spawn(self, placement: Placement, argv: list[str], env: dict[str, str], log_path: str) -> ProcessHandle:
        self.ensure_job()
        assert self.job_id is not None
        req = {r.role: r for r in self.requests()}.get(placement.role)
        self._spawned += 1
        step = f"{self.slurm.job_name}-{placement.role}-{placement.index}-{self._token}-{self._spawned}"
        cmd = [
            commands.which("srun"), f"--jobid={self.job_id}",
            *([f"--het-group={self._role_component[placement.role]}"] if placement.role in self._role_component else []),
            "--nodes=1", "--ntasks=1", f"--nodelist={placement.node}",
            # Steps share the job's CPUs (the role's processes were counted into it);
            # one step per process, so each can be signalled and cancelled alone.
            "--overlap", f"--cpus-per-task={req.cpus if req else 1}",
            f"--job-name={step}", "--kill-on-bad-exit=1", "--quiet", *self.slurm.srun_args,
            *node_side_argv(argv, step),
        ]  # fmt: skip
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        with open(log_path, "ab") as logf:
            offset = logf.tell()
            popen = _popen(
                cmd, env=commands.command_env(env), stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=_term_with_parent,
            )  # fmt: skip
        h = SlurmProcess(popen, placement, log_path, self.job_ids(), step, offset)
        self._steps.append(h)
        return h

    def extra_placement(self, role: str, index: int) -> Placement:
        """One more process of ``role`` in the running job (an elastic fleet
        growing): a step of its own, like every process, on the role's node
        holding the fewest of its processes. Steps share the job's CPUs
        (``--overlap``); a role with GPUs cannot grow (every GPU of the job
        was placed at start): one clear error, and `areal fleet add` remains."""
        placed = self.placements(role)
        if not placed:
            raise ArealError(f"scheduler.slurm: the job has no {role} placement to grow from")
        req = {r.role: r for r in self.requests()}.get(role)
        if req is not None and req.gpus:
            raise ArealError(
                f"scheduler.slurm: cannot add a {role} process with {req.gpus} GPU(s) to the running job: every GPU "
                "of the job was placed at start; start the server outside the run and `areal fleet add` it"
            )
        nodes = [p.node for p in placed + self._grown if p.role == role]
        node = min(dict.fromkeys(nodes), key=nodes.count)
        placement = Placement(role, index, node, self._addrs.get(node, node), ())
        self._grown.append(placement)
        return placement

    def job_ids(self) -> str:
        """Every component's job id, comma-separated (a heterogeneous job's
        steps are listed under their component's own id)."""
        comps = self._components or []
        return ",".join(c.job_id for c in comps) or str(self.job_id)

    def free_port(self, placement: Placement) -> int:
        if self.on_this_machine(placement):
            return find_free_port(placement.host)
        # Another machine: ask a process there (a short step) for a port it could bind.
        probe = "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"
        cmd = [
            "srun", f"--jobid={self.job_id}",
            *([f"--het-group={self._role_component[placement.role]}"] if placement.role in self._role_component else []),
            "--nodes=1", "--ntasks=1", f"--nodelist={placement.node}", "--overlap", "--quiet",
            sys.executable, "-c", probe,
        ]  # fmt: skip
        return int(commands.run(cmd, timeout=120).strip().splitlines()[-1])

    def controller_host(self) -> str:
        if self.slurm.controller_host:
            return self.slurm.controller_host
        hosts = [p.host for role in (ACTOR, ROLLOUT) for p in self.placements(role)]
        if all(is_loopback(h) for h in hosts):
            return "127.0.0.1"
        return socket.gethostbyname(socket.gethostname())

    def release(self) -> None:
        """Cancel the run's steps still known to Slurm and, when asked (by
        default: a job it submitted), the job itself; wait until they are gone."""
        if self.job_id is None:
            return
        job, ids = self.job_id, self.job_ids()
        prefix = f"{self.slurm.job_name}-"
        ours = [s for name, s in commands.step_ids(ids).items() if name.startswith(prefix) and self._token in name]
        for step in ours:
            commands.cancel(step)
        cancel_job = self.slurm.cancel_job_on_exit
        if cancel_job is None:
            cancel_job = self.submitted
        if cancel_job:
            commands.cancel(job)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            left = commands.step_ids(ids)
            mine = [n for n in left if self._token in n]
            if not mine and (not cancel_job or not left):
                break
            time.sleep(0.3)
        for h in self._steps:  # the srun clients end with their steps
            try:
                h.popen.wait(10)
            except subprocess.TimeoutExpired:
                h.popen.kill()
                h.popen.wait()
        if cancel_job:
            self.job_id = None

    # -- the job -------------------------------------------------------------------------------------
    @staticmethod
    def heterogeneous(reqs: list[RoleRequest]) -> bool:
        """Whether the roles need a heterogeneous job (different per-process resources or partitions)."""
        shapes = {(r.cpus, r.gpus, r.resources.partition, tuple(r.resources.sbatch_args)) for r in reqs}
        return len(shapes) > 1

    def ensure_job(self) -> None:
        """Resolve (allocation) or submit and wait for (submit) the run's job."""
        if self.job_id is not None:
            return
        if self.mode() == "allocation":
            job = self.slurm.job_id or os.environ["SLURM_JOB_ID"]
            self._components = commands.job_components(job)
            self.job_id = job
            return
        reqs = self.requests()
        script_args = self._sbatch_args(reqs)
        job = commands.submit(HOLD_SCRIPT, script_args)
        self.job_id, self.submitted = job, True
        atexit.register(self._cancel_at_exit, job)
        try:
            self._components = self._wait_running(job)
        except BaseException:
            commands.cancel(job)
            self.job_id = None
            raise
        if len(self._components) > 1:
            self._role_component = {r.role: i for i, r in enumerate(reqs)}

    def _sbatch_args(self, reqs: list[RoleRequest]) -> list[str]:
        s = self.slurm
        common = [f"--job-name={s.job_name}", f"--time={s.time_limit}", "--output=/dev/null", "--no-requeue"]
        common += [f"--account={s.account}"] if s.account else []
        common += [f"--qos={s.qos}"] if s.qos else []

        def component(rs: list[RoleRequest]) -> list[str]:
            r = rs[0]
            part = r.resources.partition or s.partition
            out = [f"--ntasks={sum(x.processes for x in rs)}", f"--cpus-per-task={r.cpus}"]
            out += [f"--gpus-per-task={r.gpus}"] if r.gpus else []
            out += [f"--partition={part}"] if part else []
            return out + list(r.resources.sbatch_args)

        if self.heterogeneous(reqs):
            args: list[str] = []
            for i, r in enumerate(reqs):
                args += ([":"] if i else []) + common + component([r])
            return args + list(s.sbatch_args)
        return common + component(reqs) + list(s.sbatch_args)

    def _wait_running(self, job: str) -> list[commands.JobComponent]:
        deadline = time.monotonic() + self.slurm.start_timeout_s
        while True:
            comps = commands.job_components(job)
            states = {c.state for c in comps}
            if comps and states == {"RUNNING"}:
                return comps
            if states & set(_FINAL_STATES):
                raise ArealError(
                    f"Slurm job {job} ended before the run started ({', '.join(sorted(states))}; reason "
                    f"{', '.join(sorted({c.reason for c in comps}))})"
                )
            if time.monotonic() > deadline:
                raise ArealError(
                    f"Slurm job {job} did not start within scheduler.slurm.start_timeout_s="
                    f"{self.slurm.start_timeout_s:g}s (state {', '.join(sorted(states))}, reason "
                    f"{', '.join(sorted({c.reason for c in comps}))}); it was cancelled"
                )
            time.sleep(0.5)

    @staticmethod
    def _cancel_at_exit(job: str) -> None:
        # A controller that exits without stop() (an unexpected exit path)
        # still gives its nodes back; after stop() this finds nothing.
        commands.cancel(job)

    # -- placement -----------------------------------------------------------------------------------
    def _place(
        self, job: str, comps: list[commands.JobComponent], reqs: list[RoleRequest]
    ) -> dict[str, list[Placement]]:
        """Pack each role's processes onto the nodes in order (a role on the
        component of its own in a heterogeneous job of two or more)."""
        free: dict[tuple[int, str], list[Any]] = {}  # (component, node) -> [cpus left, gpu ids left]
        for ci, c in enumerate(comps):
            for sh in c.shares:
                free[(ci, sh.node)] = [sh.cpus, list(range(len(sh.gpu_ids)))]
        nodes = sorted({n for (_, n) in free})
        missing = [n for n in nodes if n not in self._addrs]
        if missing:
            self._addrs.update(commands.node_addresses(missing))
        by_role: dict[str, list[Placement]] = {}
        per_role_component = len(comps) >= len(reqs) > 1 and all(c.het_offset is not None for c in comps)
        for ri, r in enumerate(reqs):
            allowed = [ri] if per_role_component else list(range(len(comps)))
            placed: list[Placement] = []
            for i in range(r.processes):
                slot = next(
                    (k for k in free if k[0] in allowed and free[k][0] >= r.cpus and len(free[k][1]) >= r.gpus), None
                )
                if slot is None:
                    held = ", ".join(f"{n} {v[0]} CPU(s) free" for (ci, n), v in free.items() if ci in allowed)
                    raise ArealError(
                        f"Slurm job {job} cannot hold the {r.role} role: its process {i} of {r.processes} needs "
                        f"{r.cpus} CPU(s)"
                        + (f" and {r.gpus} GPU(s)" if r.gpus else "")
                        + f" (scheduler.slurm.{r.role}) and the job has left: {held or 'nothing'}; ask Slurm "
                        "for more (salloc/sbatch --ntasks, --cpus-per-task) or lower cpus_per_process"
                    )
                cpus_gpus = free[slot]
                cpus_gpus[0] -= r.cpus
                devices, cpus_gpus[1] = tuple(cpus_gpus[1][: r.gpus]), cpus_gpus[1][r.gpus :]
                node = slot[1]
                placed.append(Placement(r.role, i, node, self._addrs.get(node, node), devices))
            by_role[r.role] = placed
        if self.job_id is not None and per_role_component:
            self._role_component = {r.role: i for i, r in enumerate(reqs)}
        return by_role
