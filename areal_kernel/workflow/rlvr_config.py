"""Settings of the ``rlvr`` workflow (``workflow.rlvr``), importable without torch."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class RLVRConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    use_chat_template: bool = True
    system_prompt: str | None = Field(None, description="Optional system message before the user prompt.")
    prompt_template: str = Field("{prompt}", description="Python format string over the record's fields.")
