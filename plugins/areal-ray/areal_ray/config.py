"""Settings of the ``ray`` scheduler (``scheduler.ray`` section)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Strategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


class RaySettings(BaseModel):
    """``scheduler.ray: {...}``."""

    model_config = ConfigDict(extra="forbid")

    address: str | None = Field(
        None,
        description="Cluster to join: 'auto', 'host:port' of its head, or 'ray://host:port'. "
        "Unset: start a local one-node cluster for the run and end it with the run.",
    )
    node_ip_address: str = Field(
        "127.0.0.1",
        description="This machine's address in the cluster: where train ranks reach the controller, "
        "and the local cluster's address.",
    )
    num_cpus: int | None = Field(
        None,
        ge=1,
        description="CPUs of a local cluster (unset: this machine's cores, or as many as the run's processes "
        "when there are more: on CPU hosts they are single-threaded and share cores).",
    )
    namespace: str = Field("areal", min_length=1, description="Ray namespace of the run's actors.")
    actor_strategy: Strategy = Field("PACK", description="Placement-group strategy of the train ranks.")
    rollout_strategy: Strategy = Field("SPREAD", description="Placement-group strategy of the inference servers.")
    cpus_per_process: float = Field(
        1.0, gt=0, description="CPUs reserved per process (each is single-threaded on CPU hosts)."
    )
    timeout_s: float = Field(60.0, gt=0, description="Limit of every call into the cluster (each ray.get).")
    placement_timeout_s: float = Field(
        120.0, gt=0, description="How long to wait for a role's placement group to be placed."
    )
