"""The ``scheduler.slurm`` settings section (validated by the kernel against
``SlurmSettings`` when ``scheduler.type: slurm``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from areal_kernel.config.sections import StrictModel


class SlurmRoleResources(StrictModel):
    """What each process of one role (``actor`` ranks, ``rollout`` servers) asks Slurm for."""

    cpus_per_process: int = Field(1, ge=1, description="CPUs per process (sbatch --cpus-per-task).")
    gpus_per_process: int | None = Field(
        None,
        ge=0,
        description="Accelerators per process (sbatch --gpus-per-task). Default: 1 per actor rank and the "
        "allocation's devices per replica per server on platforms with exclusive devices, 0 on CPU.",
    )
    partition: str | None = Field(None, description="Partition of this role's job component (default: `partition`).")
    sbatch_args: list[str] = Field(
        default_factory=list, description="More sbatch options for this role's job component only."
    )


class SlurmSettings(StrictModel):
    mode: Literal["auto", "allocation", "submit"] = Field(
        "auto",
        description="allocation: run the roles inside an existing job (the one this controller runs in, "
        "`$SLURM_JOB_ID`, or `job_id`) with one srun step per process; submit: sbatch a job for the roles "
        "(heterogeneous when roles need different resources) and cancel it when the run ends; auto: "
        "allocation when there is a job to use, else submit.",
    )
    job_id: str | None = Field(None, description="The job to run in (mode allocation); default `$SLURM_JOB_ID`.")
    partition: str | None = Field(None, description="Partition for a submitted job (default: the cluster's).")
    account: str | None = None
    qos: str | None = None
    time_limit: str = Field("04:00:00", description="Time limit of a submitted job (sbatch --time).")
    job_name: str = Field("areal", description="Name of a submitted job and prefix of every step's name.")
    actor: SlurmRoleResources = Field(default_factory=SlurmRoleResources)
    rollout: SlurmRoleResources = Field(default_factory=SlurmRoleResources)
    sbatch_args: list[str] = Field(default_factory=list, description="More sbatch options for a submitted job.")
    srun_args: list[str] = Field(default_factory=list, description="More srun options for every process's step.")
    start_timeout_s: float = Field(
        600.0, gt=0, description="How long a submitted job may wait in the queue before the run gives up."
    )
    controller_host: str | None = Field(
        None,
        description="The address processes on the job's nodes dial to reach this controller. Default: "
        "127.0.0.1 when every node's address is loopback, else this machine's host name resolved.",
    )
    cancel_job_on_exit: bool | None = Field(
        None,
        description="Cancel the job when the run ends or fails. Default: for a job this scheduler "
        "submitted; a job it only ran in keeps running (its steps of this run are cancelled).",
    )

    @field_validator("time_limit")
    @classmethod
    def _time_limit(cls, v: str) -> str:
        # sbatch's forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S (or UNLIMITED).
        body = v.split("-", 1)[-1]
        parts = body.split(":")
        if v.upper() in ("UNLIMITED", "INFINITE"):
            return v
        if (
            not v
            or len(parts) > 3
            or not all(p.isdigit() for p in parts)
            or ("-" in v and not v.split("-")[0].isdigit())
        ):
            raise ValueError(f"{v!r} is not a Slurm time limit (e.g. 30, 04:00:00, 1-12:00:00)")
        return v
