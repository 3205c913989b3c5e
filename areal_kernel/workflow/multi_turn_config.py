"""Settings of the ``multi_turn`` workflow (``workflow.multi_turn``), importable without torch."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

WHERE = "workflow.multi_turn"


class MultiTurnConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_turns: int = Field(2, ge=1, description="Model turns per sample (answers and tool calls together).")
    turn_discount: float = Field(
        0.5,
        gt=0,
        le=1,
        description="A sample whose episode ended at turn k (0-based) gets discount**k x that turn's reward.",
    )
    success_threshold: float | None = Field(
        None,
        description="A turn whose reward reaches this ends the episode (default: the reward's declared threshold).",
    )
    feedback: str = Field(
        "Your answer is wrong. Try again.", description="The user message after an answer below the threshold."
    )
    use_chat_template: bool = Field(True, description="Must stay true: turns are appended through the chat template.")
    system_prompt: str | None = Field(
        None, description="Optional system message; '{tools}' in it is replaced by the tools' JSON schemas."
    )
    prompt_template: str = Field("{prompt}", description="Python format string over the record's fields.")
    tools: list[str] = Field(default_factory=list, description="Registered tool names the model may call.")
    tool_settings: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Settings per tool name, validated against that tool's config model."
    )
    tool_parser: str = Field("hermes", description="Registered tool-call parser that finds calls in a turn.")
    tool_timeout_s: float = Field(10.0, gt=0, description="A tool call running longer answers with an error.")
    max_tool_calls_per_turn: int = Field(4, ge=1, description="Calls run per turn; later ones answer with an error.")
    tool_role: str = Field("tool", description="Chat role of tool results (as the model's template names it).")
    max_total_tokens: int = Field(
        2048, ge=8, description="An episode ends before a turn whose prompt would reach this many tokens."
    )

    @model_validator(mode="after")
    def _check(self) -> "MultiTurnConfig":
        from areal_kernel.config.sections import validate_settings
        from areal_kernel.errors import ConfigError
        from areal_kernel.plugins import get_registry

        if not self.use_chat_template:
            raise ConfigError(
                f"{WHERE}.use_chat_template: must be true (each turn's messages are appended as the "
                "chat template renders them)"
            )
        reg = get_registry()
        for key, kind, names in (("tool_parser", "tool_parser", [self.tool_parser]), ("tools", "tool", self.tools)):
            for name in names:
                try:
                    reg.get(kind, name, platform="")
                except ConfigError:
                    raise
                except Exception as e:
                    raise ConfigError(f"{WHERE}.{key}: {e}") from None
        if len(set(self.tools)) != len(self.tools):
            raise ConfigError(f"{WHERE}.tools: {self.tools} names a tool twice")
        for name, raw in self.tool_settings.items():
            if name not in self.tools:
                raise ConfigError(
                    f"{WHERE}.tool_settings.{name}: '{name}' is not in {WHERE}.tools ({self.tools or 'none'})"
                )
            validate_settings(
                f"{WHERE}.tool_settings.{name}", "tool", name, raw, spec=reg.get("tool", name, platform="")
            )
        return self
