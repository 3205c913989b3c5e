"""What ``areal agent run`` asked for (``run.json``) and the service's files.

Files under ``$AREAL_HOME/agent`` (default ``~/.areal/agent``):

- ``run.json``: the validated ``AgentRunSpec`` the service was started with;
- ``service.json``: the running service (pid, start time, address, admin
  token, process ids of its model replicas and workers); written by the
  service, removed when it stops; a file whose pid is gone is stale;
- ``service.log``, ``workers/worker-<i>.log``, ``model/``: logs;
- ``sessions.jsonl``: one line per finished session (``SESSION_LOG``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from areal_kernel.services.detached import DetachedService
from areal_kernel.utils.network import is_loopback

SPEC_NAME = "run.json"
STATE_NAME = "service.json"
LOG_NAME = "service.log"
SESSION_LOG = "sessions.jsonl"
RECORDS_NAME = "records.jsonl"
WORKER_TOKEN_ENV = "AREAL_AGENT_WORKER_TOKEN"
ADMIN_TOKEN_ENV = "AREAL_AGENT_ADMIN_TOKEN"


AGENT = DetachedService(
    command="agent",
    title="the agent service",
    process="the agent service",
    short="service",
    pid_label="pid",
    not_started="the agent service did not start",
    exited="the agent service exited with code {rc} while starting; its log: {log}",
    state_name=STATE_NAME,
    log_name=LOG_NAME,
    token_env=ADMIN_TOKEN_ENV,
)


class AgentRunSpec(BaseModel):
    """One agent service: the agent, its workers, the model and the records."""

    model_config = ConfigDict(extra="forbid")

    agent: str = Field(
        description="'pkg.module:Class' or 'file.py:Class' with async run(record, *, base_url, api_key)."
    )
    agent_kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the agent class.")
    workers: int = Field(1, ge=1, le=256, description="Worker processes, each running one session at a time.")
    model_name: str = Field("areal", description="The model id the proxy answers as (what agents pass as model).")
    # Local mode: the service starts the model (as `areal inf register` does).
    backend: str | None = Field(None, description="Inference backend and replicas: embedded, embedded:d2, vllm:d1t2.")
    model_path: str | None = Field(None, description="HF model directory or a registered model name.")
    dtype: Literal["float32", "bfloat16"] | None = None
    args: dict[str, Any] = Field(default_factory=dict, description="The backend's settings (its config section).")
    max_restarts: int = Field(3, ge=0, description="Restarts allowed per model replica.")
    max_new_tokens: int = Field(256, ge=1, description="Cap on one answer's length.")
    # Online RL mode: the proxy of a training run (`areal agent serve`).
    proxy_url: str | None = Field(None, description="Root URL of a running `areal agent serve` proxy.")
    proxy_token: str | None = Field(None, description="That proxy's admin token (when it has one).")
    records: str | None = Field(None, description="A .jsonl file of records (one JSON object a line).")
    dataset: str | None = Field(None, description="A config file whose dataset section supplies the records.")
    epochs: int = Field(1, ge=0, description="Passes over the records; 0: repeat them until stopped.")
    session_timeout_s: float = Field(600.0, gt=0, description="One session's time limit in a worker.")
    cwd: str = Field(".", description="Where `areal agent run` ran: workers start there (relative imports, files).")
    host: str = Field("127.0.0.1", description="Control address; beyond loopback control routes need a token.")
    port: int = Field(8100, ge=0, le=65535, description="Control port (0: a free one).")

    @model_validator(mode="after")
    def _one_backend(self) -> "AgentRunSpec":
        if self.proxy_url and (self.backend or self.model_path):
            raise ValueError("--proxy: give either --proxy (online RL) or --backend/--model-path (a model), not both")
        if not self.proxy_url and not (self.backend and self.model_path):
            raise ValueError("--model-path: the service needs a model (--model-path, --backend) or --proxy URL")
        if self.records and self.dataset:
            raise ValueError("--records: give either --records or --dataset, not both")
        if not self.records and not self.dataset:
            raise ValueError("--records: where do records come from? --records FILE.jsonl, --records - or --dataset")
        return self

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)
