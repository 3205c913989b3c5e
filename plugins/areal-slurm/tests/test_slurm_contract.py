"""The kernel's scheduler contract suite (``areal_kernel.testing.contracts.
SchedulerContract``) against the ``slurm`` scheduler, inside a real
allocation of the test cluster: two nodes, four one-CPU tasks."""

from __future__ import annotations

import time
from typing import Any, Iterator

import pytest

from areal_kernel.testing.contracts import SchedulerContract


@pytest.fixture(scope="module")
def allocation(slurm_cluster) -> Iterator[str]:
    """A job holding both nodes (its batch script only sleeps): the runs of
    this module use it the way a run inside ``salloc`` uses its job."""
    job = slurm_cluster.run(
        "sbatch", "--parsable", "-N2", "-n4", "--output=/dev/null", "--wrap", "exec sleep 100000"
    ).stdout.strip()
    deadline = time.monotonic() + 60
    while slurm_cluster.run("squeue", "-h", "-j", job, "-o", "%T").stdout.strip() != "RUNNING":
        assert time.monotonic() < deadline, slurm_cluster.run("squeue", check=False).stdout
        time.sleep(0.2)
    yield job
    slurm_cluster.run("scancel", job, check=False)


class TestSlurmSchedulerContract(SchedulerContract):
    @pytest.fixture
    def scheduler_name(self) -> str:
        return "slurm"

    @pytest.fixture
    def scheduler_config(self, allocation: str, slurm_cluster: Any, monkeypatch: pytest.MonkeyPatch) -> dict:
        # The scheduler runs in this process: its Slurm commands find the test cluster.
        monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.conf))
        return {
            "actor": {"backend": "torch:d2"},
            "rollout": {"backend": "embedded", "embedded": {"dtype": "float32"}},
            "scheduler": {"slurm": {"job_id": allocation}},
        }
