"""Settings of the built-in rewards (``reward.math: {...}`` and so on).

Importable without sympy or math-verify: the config loader validates these
in the controller, and the reward receives the fields as keyword arguments
in its worker process (see docs/plugin-authoring.md, "Rewards").
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from areal_kernel.reward.char_share import DEFAULT_CHARS


class MathRewardSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    numeric_needs_number: bool = Field(
        True, description="A plain-number gold answer needs a plain-number prediction (echoing '3+5' scores 0)."
    )


class ExactMatchRewardSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    strict: bool = Field(False, description="Compare stripped strings only (no number or \\boxed{} parsing).")


class CodeExecRewardSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    timeout_s: float = Field(5.0, gt=0, description="Wall time of the sandboxed program.")
    memory_mb: int = Field(512, ge=16, description="Address-space limit per process.")
    max_processes: int = Field(8, ge=1, description="Processes the program may run at once.")


class CharShareRewardSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    chars: str = Field(
        DEFAULT_CHARS,
        min_length=1,
        description="The characters that count; the reward is the share of the completion's characters among them.",
    )
