"""Entry point of areal-slurm (group ``areal.plugins``, name ``slurm``).

Imports only ``areal_kernel``: the scheduler and its settings load when a
run selects ``scheduler.type: slurm``.
"""

from __future__ import annotations

from typing import Any

from areal_kernel.hookspecs import hookimpl


@hookimpl
def areal_register_schedulers(register: Any) -> None:
    register(
        "slurm",
        "areal_slurm.scheduler:SlurmScheduler",
        description="Slurm job steps (srun) in an allocation, or in a job it submits (sbatch)",
        config_model="areal_slurm.config:SlurmSettings",
    )
