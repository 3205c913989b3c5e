"""Settings of the agent proxy and the ``agent`` workflow (importable without torch)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from areal_kernel.utils.network import LOOPBACK_HOSTS, is_loopback


class ProxyConfig(BaseModel):
    """The OpenAI-compatible proxy (``workflow.agent.proxy``)."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field(
        "127.0.0.1",
        description="Bind address. Anything but a loopback name needs admin_token (who may open sessions).",
    )
    port: int = Field(0, ge=0, le=65535, description="0: a free port.")
    admin_token: str | None = Field(
        None,
        description="Bearer token required to open sessions (POST /sessions). Required off loopback; "
        "without it (loopback only) anyone on this machine may open sessions.",
    )
    model_name: str = Field("areal", description="The model id /v1/models lists and responses carry.")
    tool_parser: str | None = Field(
        "hermes", description="Tool-call parser applied to every answer (registry kind tool_parser); null: none."
    )
    sampling: Literal["request", "run"] = Field(
        "request",
        description="'request': a request's temperature/top_p/seed are used; 'run': the configured generation "
        "settings are (what RL training needs: the sampler must be the one the loss assumes).",
    )
    max_tokens: int | None = Field(
        None, ge=1, description="Cap on a request's max_tokens (default: rollout.gconfig.max_new_tokens)."
    )
    session_wait_s: float = Field(
        60.0,
        gt=0,
        description="How long POST /sessions waits for a free rollout slot under the staleness budget (online).",
    )

    @model_validator(mode="after")
    def _token_off_loopback(self) -> "ProxyConfig":
        if not is_loopback(self.host) and not self.admin_token:
            raise ValueError(
                f"proxy.host {self.host!r} is not a loopback address ({', '.join(sorted(LOOPBACK_HOSTS))}); "
                "set proxy.admin_token: anyone who can reach the port could otherwise open sessions"
            )
        return self


class AgentWorkflowConfig(BaseModel):
    """``workflow.type: agent`` (``workflow.agent``): an agent that talks to
    the proxy with an OpenAI client is the workflow."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["inline", "subprocess", "online"] = Field(
        "inline",
        description="inline: the agent class runs in the controller; subprocess: a command runs per session; "
        "online: no dataset, external clients open sessions.",
    )
    agent: str | None = Field(
        None, description="'pkg.module:Class' with `async run(record, base_url=..., api_key=...)` (mode inline)."
    )
    agent_kwargs: dict = Field(default_factory=dict, description="Keyword arguments for the agent class.")
    command: list[str] | None = Field(
        None,
        description="argv run once per session (mode subprocess); the record arrives as JSON on stdin and in "
        "AREAL_AGENT_RECORD, the proxy in OPENAI_BASE_URL / OPENAI_API_KEY.",
    )
    timeout_s: float = Field(600.0, gt=0, description="One session's time limit (inline and subprocess).")
    export: Literal["trajectory", "turns"] = Field(
        "trajectory",
        description="trajectory: one row per conversation with every model turn in the loss mask; turns: one "
        "row per model answer.",
    )
    proxy: ProxyConfig = Field(default_factory=lambda: ProxyConfig(sampling="run"))

    @model_validator(mode="after")
    def _mode_needs(self) -> "AgentWorkflowConfig":
        if self.mode == "inline" and not self.agent:
            raise ValueError("agent: mode 'inline' needs the agent class, 'pkg.module:Class'")
        if self.mode == "subprocess" and not self.command:
            raise ValueError("command: mode 'subprocess' needs the command to run, a list of strings")
        return self


class AgentSessionsConfig(BaseModel):
    """``dataset.type: agent_sessions``: the slots of an online run."""

    model_config = ConfigDict(extra="forbid")

    slots: int = Field(
        1000, ge=1, description="Groups of sessions per epoch (trainer.max_steps usually ends the run first)."
    )
