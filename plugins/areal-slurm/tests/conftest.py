"""Fixtures of the areal-slurm tests: a real Slurm cluster on this machine.

``slurm_cluster`` starts one for the whole test session (two simulated
nodes, n1 and n2, both this machine on 127.0.0.1; see
``areal_slurm.localcluster``) and stops it at the end. Where Slurm cannot
run (not installed, not root) the tests that need it are skipped with the
reason; under ``CI=true`` that is a failure instead: CI installs Slurm
(`make install`), so a missing Slurm there is a broken set-up, not a choice.
"""

from __future__ import annotations

import os
from typing import Iterator

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator["LocalSlurmCluster"]:  # noqa: F821
    from areal_slurm.localcluster import LocalSlurmCluster, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true and no Slurm cluster can run here: {reason}", pytrace=False)
        pytest.skip(reason)
    cluster = LocalSlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=2, cpus_per_node=4)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
