"""The test cluster itself (``areal_slurm.localcluster``): both simulated
nodes run steps, and a cancelled job leaves no process behind."""

from __future__ import annotations

import time
import uuid

from areal_kernel.testing.procs import live_processes, wait_gone


def test_srun_reaches_both_nodes(slurm_cluster):
    out = slurm_cluster.run("srun", "-N2", "-n2", "--label", "printenv", "SLURMD_NODENAME").stdout.split()
    assert sorted(out) == ["0:", "1:", "n1", "n2"]


def test_scancel_of_a_job_leaves_no_process(slurm_cluster, tmp_path):
    marker = f"AREAL_SLURM_TEST_MARKER={uuid.uuid4().hex}"
    script = tmp_path / "job.sh"
    # A task that starts a child of its own: both must go with the job.
    script.write_text(f"#!/bin/sh\nexport {marker}\nsleep 600 &\nsrun -n1 sleep 600\n")
    job = slurm_cluster.run("sbatch", "--parsable", "-n1", f"--output={tmp_path / 'job.out'}", str(script)).stdout
    job = job.strip().split(";")[0]
    mine = lambda: live_processes(lambda p: p.environ_has(marker))  # noqa: E731
    deadline = time.monotonic() + 30
    while len(mine()) < 2:  # the batch script's sleep and the step's
        assert time.monotonic() < deadline, slurm_cluster.run("squeue", "-s", check=False).stdout
        time.sleep(0.2)
    slurm_cluster.run("scancel", job)
    for p in mine():
        assert wait_gone(p.pid, 30), f"{p.argv} (pid {p.pid}) outlived scancel {job}"
    # A cancelled job is listed (state CG, completing) until slurmd has cleaned it up.
    deadline = time.monotonic() + 30
    while slurm_cluster.run("squeue", "-h", "-j", job, check=False).stdout.strip():
        assert time.monotonic() < deadline, slurm_cluster.run("squeue", check=False).stdout
        time.sleep(0.2)
