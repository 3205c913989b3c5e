"""Slurm through its own commands (``scontrol``, ``squeue``, ``sbatch``,
``scancel``, ``sinfo``): no Python bindings, any Slurm that has the CLI.

Every command reads the cluster from the usual place (``SLURM_CONF`` or
``/etc/slurm``). Failures raise ``SlurmError`` with the command and its
error output.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field

from areal_kernel.errors import ArealError

# Options of an enclosing job that srun/sbatch would read from the
# environment as defaults; the commands this plugin runs pass their own.
_JOB_ENV_PREFIXES = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_")
_KEEP = ("SLURM_CONF",)


class SlurmError(ArealError):
    """A Slurm command failed, or Slurm is not installed."""


def command_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) without the variables
    of an enclosing job, so a command acts on exactly what it is told."""
    src = dict(os.environ if base is None else base)
    return {k: v for k, v in src.items() if not k.startswith(_JOB_ENV_PREFIXES) or k in _KEEP}


def which(cmd: str) -> str:
    path = shutil.which(cmd)
    if path is None:
        raise SlurmError(f"the Slurm command {cmd!r} is not on PATH: scheduler.type slurm needs Slurm's client tools")
    return path


def run(argv: list[str], *, timeout: float = 60.0) -> str:
    """Run a Slurm command; its standard output."""
    try:
        proc = subprocess.run(
            [which(argv[0]), *argv[1:]], env=command_env(), capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        raise SlurmError(f"`{' '.join(argv)}` did not answer within {timeout:.0f}s") from None
    if proc.returncode != 0:
        raise SlurmError(f"`{' '.join(argv)}` exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


def expand_hostlist(expr: str) -> list[str]:
    """``n[1-3],gpu7`` -> ``["n1", "n2", "n3", "gpu7"]`` (``scontrol show hostnames``)."""
    if not expr or expr == "(null)":
        return []
    return run(["scontrol", "show", "hostnames", expr]).split()


def node_addresses(nodes: list[str]) -> dict[str, str]:
    """Node name -> its ``NodeAddr`` (what processes there bind and others dial)."""
    if not nodes:
        return {}
    out: dict[str, str] = {}
    for line in run(["scontrol", "show", "node", "-o", ",".join(nodes)]).splitlines():
        fields = _fields(line)
        name = fields.get("NodeName")
        if name:
            out[name] = fields.get("NodeAddr") or name
    return out


def node_state(node: str) -> str:
    """The node's state as ``sinfo`` prints it (``idle``, ``alloc``, ``down*`` ...); ``""`` if unknown."""
    try:
        return run(["sinfo", "-h", "-N", "-n", node, "-o", "%t"], timeout=20).strip().split("\n")[0]
    except SlurmError:
        return ""


def node_lost(node: str) -> bool:
    """Whether Slurm considers the node gone (down, failed, not responding)."""
    state = node_state(node)
    return state.endswith("*") or state.startswith(("down", "fail", "drain", "drng"))


@dataclass
class NodeShare:
    """What one job component holds on one node."""

    node: str
    cpus: int
    gpu_ids: list[int] = field(default_factory=list)


@dataclass
class JobComponent:
    """One job, or one component of a heterogeneous job."""

    job_id: str  # the job's own id (a component's, for a heterogeneous job)
    het_offset: int | None  # None for a plain job
    state: str
    reason: str
    shares: list[NodeShare]

    @property
    def nodes(self) -> list[str]:
        return [s.node for s in self.shares]


def job_components(job_id: str) -> list[JobComponent]:
    """The job's components in offset order (one for a plain job), with the
    CPUs and GPU indices each holds per node (``scontrol show job -d``)."""
    comps = []
    for line in run(["scontrol", "show", "job", "-d", "-o", job_id]).splitlines():
        if not line.strip():
            continue
        tokens = line.split()
        fields = _fields(line)
        shares: list[NodeShare] = []
        for i, tok in enumerate(tokens):
            if not tok.startswith("Nodes="):
                continue
            detail = _fields(" ".join(tokens[i : i + 4]))
            cpus = _count_ids(detail.get("CPU_IDs", ""))
            gpus = _gres_ids(detail.get("GRES", ""))
            for node in expand_hostlist(tok.split("=", 1)[1]):
                shares.append(NodeShare(node, cpus, gpus))
        offset = fields.get("HetJobOffset")
        comps.append(
            JobComponent(
                job_id=fields.get("JobId", job_id),
                het_offset=int(offset) if offset is not None else None,
                state=fields.get("JobState", ""),
                reason=fields.get("Reason", ""),
                shares=shares,
            )
        )
    comps.sort(key=lambda c: c.het_offset or 0)
    return comps


def submit(script: str, args: list[str]) -> str:
    """``sbatch --parsable ARGS`` with ``script`` on standard input; the job id."""
    try:
        proc = subprocess.run(
            [which("sbatch"), "--parsable", *args], input=script, env=command_env(), capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise SlurmError("sbatch did not answer within 60s") from None
    if proc.returncode != 0:
        raise SlurmError(f"sbatch {' '.join(args)} refused the job: {(proc.stderr or proc.stdout).strip()}")
    # --parsable: "jobid" or "jobid;cluster"
    return proc.stdout.strip().split(";")[0]


def cancel(target: str, signal_name: str | None = None) -> None:
    """``scancel`` a job or a step (``JOB.STEP``); with ``signal_name`` only signal it."""
    argv = ["scancel", *([f"--signal={signal_name}"] if signal_name else []), target]
    try:
        run(argv, timeout=30)
    except SlurmError:
        pass  # already gone


def step_ids(job_id: str) -> dict[str, str]:
    """The running steps of a job (``job_id``: one id or several, comma-separated):
    step name -> ``JOB.STEP``."""
    out = {}
    try:
        text = run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i %j"], timeout=20)
    except SlurmError:
        return {}
    for line in text.splitlines():
        parts = line.split(None, 1)
        if len(parts) == 2:
            out[parts[1].strip()] = parts[0]
    return out


def _fields(line: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for tok in line.split():
        if "=" in tok:
            k, v = tok.split("=", 1)
            out.setdefault(k, v)
    return out


def _count_ids(spec: str) -> int:
    """``0-3,6`` -> 5."""
    return len(_ids(spec))


def _ids(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-", 1)
            if a.isdigit() and b.isdigit():
                out.extend(range(int(a), int(b) + 1))
        elif part.isdigit():
            out.append(int(part))
    return out


def _gres_ids(gres: str) -> list[int]:
    """GPU indices of a ``GRES=gpu:a100:2(IDX:0-1)`` detail."""
    ids: list[int] = []
    for item in gres.split("),"):
        if item.startswith("gpu") and "(IDX:" in item:
            ids.extend(_ids(item.split("(IDX:", 1)[1].rstrip(")")))
    return ids
