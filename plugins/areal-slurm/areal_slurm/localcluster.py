"""A real Slurm cluster on this machine, for tests and trying the plugin out.

``LocalSlurmCluster`` writes a ``slurm.conf`` in a directory of its own,
starts ``munged`` (its own key and socket), ``slurmctld`` and one
``slurmd`` per simulated node (Slurm's multiple-slurmd mode: every node is
this machine, each slurmd on its own port, all on 127.0.0.1), waits until
every node is idle, and stops exactly the processes it started (by PID),
cancelling its jobs first. Nothing system-wide is touched: no
``/etc/slurm``, no system munge socket, no cgroups (``proctrack/linuxproc``,
``task/none``), so it needs no service manager and can run beside another
cluster. Commands reach it through ``env`` (``SLURM_CONF``).

It needs the ``slurm-wlm`` and ``munge`` packages and root (the daemons run
as root here); ``unavailable_reason()`` says what is missing.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from areal_kernel.testing.procs import live_processes
from areal_kernel.utils.network import find_free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "salloc", "scancel", "squeue", "sinfo", "scontrol")


def unavailable_reason() -> str | None:
    """Why a local cluster cannot start here (``None``: it can)."""
    missing = [b for b in (*DAEMONS, *CLIENTS) if _which(b) is None]
    if missing:
        return (
            f"Slurm is not installed (missing {', '.join(missing)}): install the Debian/Ubuntu packages "
            "slurm-wlm and munge (`make install` does it as root where apt-get exists)"
        )
    if os.geteuid() != 0:
        return "a local Slurm cluster runs its daemons as root; this process is not root"
    return None


def _which(name: str) -> str | None:
    # The daemons live in sbin, which a non-login PATH may lack.
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin:/usr/local/sbin"
    return shutil.which(name, path=path)


class LocalSlurmCluster:
    """``nodes`` simulated nodes named ``n1..nN`` of ``cpus_per_node`` CPUs
    each (configured, not detected: ``SlurmdParameters=config_overrides``),
    one partition ``debug``. Use as a context manager or ``start``/``stop``."""

    def __init__(self, root: str | os.PathLike[str], *, nodes: int = 2, cpus_per_node: int = 4) -> None:
        self.root = Path(root)
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.cpus_per_node = cpus_per_node
        self.conf = self.root / "slurm.conf"
        self._procs: list[subprocess.Popen] = []
        self._names: dict[int, str] = {}  # pid -> daemon name, for messages

    # -- the environment commands need ---------------------------------------------------------
    @property
    def env(self) -> dict[str, str]:
        """The calling environment pointed at this cluster: ``SLURM_CONF`` set,
        and the ``SLURM_*`` variables of any enclosing job removed (a test run
        inside a real allocation must not attach to it)."""
        e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_"))}
        e["SLURM_CONF"] = str(self.conf)
        e["PATH"] = e.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
        return e

    def run(self, *argv: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        """Run a Slurm command against this cluster; its output as text."""
        proc = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}"
            )
        return proc

    # -- life cycle -----------------------------------------------------------------------------------
    def __enter__(self) -> "LocalSlurmCluster":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout_s: float = 60.0) -> None:
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)  # munged refuses keys and sockets in open directories
        (self.root / "state").mkdir(exist_ok=True)
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(128))
        os.chmod(key, 0o600)
        self._write_conf()
        try:
            r = self.root
            self._spawn("munged", [
                _which("munged") or "munged", "-F", "--force", f"--socket={r / 'munge.sock'}",
                f"--key-file={key}", f"--pid-file={r / 'munged.pid'}", f"--log-file={r / 'munged.log'}",
                f"--seed-file={r / 'munged.seed'}",
            ])  # fmt: skip
            self._wait(lambda: (r / "munge.sock").exists(), timeout_s, "munged to create its socket")
            self._spawn("slurmctld", [_which("slurmctld") or "slurmctld", "-D", "-i", "-f", str(self.conf)])
            for node in self.nodes:
                self._spawn(f"slurmd-{node}", [_which("slurmd") or "slurmd", "-D", "-f", str(self.conf), "-N", node])
            self._wait(self._all_idle, timeout_s, f"nodes {', '.join(self.nodes)} to be idle")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Cancel every job of this cluster, stop its daemons, and kill any
        step daemon (``slurmstepd``) of theirs still running. Safe to call twice."""
        if not self._procs:
            return
        if all(p.poll() is None for p in self._procs):
            self.run("scancel", "--full", "--user", str(os.geteuid()), check=False, timeout=20)
            try:
                self._wait(lambda: not self.run("squeue", "-h", check=False).stdout.strip(), 15, "jobs to end")
            except TimeoutError:
                pass
        for p in reversed(self._procs):  # slurmd first, munged last
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self._procs.clear()
        # Step daemons outlive slurmd; they carry this cluster's SLURM_CONF.
        marker = f"SLURM_CONF={self.conf}"
        for leftover in live_processes(lambda q: q.runs("slurmstepd") and q.environ_has(marker)):
            try:
                os.kill(leftover.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # -- internals --------------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / f"{name}.out", "ab")
        try:
            p = subprocess.Popen(
                argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        finally:
            log.close()
        self._procs.append(p)
        self._names[p.pid] = name

    def _all_idle(self) -> bool:
        for p in self._procs:
            if p.poll() is not None:
                raise RuntimeError(
                    f"{self._names.get(p.pid, p.pid)} exited with {p.returncode} while starting:\n{self._log_tails()}"
                )
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split()
        states = dict(zip(out[::2], out[1::2]))
        return all(states.get(n) == "idle" for n in self.nodes)

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout_s:.0f}s for {what}\n{self._log_tails()}")
            time.sleep(0.2)

    def _log_tails(self) -> str:
        out = []
        for f in sorted(self.root.glob("*.out")) + sorted(self.root.glob("*.log")):
            lines = f.read_text(errors="replace").splitlines()[-8:]
            out.append(f"--- {f.name}\n" + "\n".join(lines))
        return "\n".join(out)

    def _write_conf(self) -> None:
        r = self.root
        host = socket.gethostname()
        lines = [
            "ClusterName=areal",
            f"SlurmctldHost={host}(127.0.0.1)",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"SlurmctldPort={find_free_port()}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={r / 'munge.sock'}",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool-%n'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={r / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'slurmd-%n.log'}",
            # No cgroups: processes are tracked by parentage, tasks not bound.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "MailProg=/bin/true",
            # Heterogeneous jobs are started only by the backfill scheduler: every second.
            "SchedulerType=sched/backfill",
            "SchedulerParameters=bf_interval=1",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "InactiveLimit=0",
            "KillWait=2",
            "MinJobAge=2",
        ]
        for node in self.nodes:
            lines.append(
                f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={find_free_port()} "
                f"CPUs={self.cpus_per_node} RealMemory=4000 State=UNKNOWN"
            )
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
