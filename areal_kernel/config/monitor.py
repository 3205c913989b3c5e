"""The ``monitor:`` section: checks that watch a run for silent failures.

``monitor.mismatch`` compares, every step, the log-probabilities the
inference servers reported for the tokens they sampled with the trainer's
own log-probabilities of the same tokens, taken before the step's first
optimizer update (``areal_kernel.monitor.mismatch`` computes the numbers;
``docs/monitoring.md`` says what normal values look like and what to check
when the alarm fires).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from areal_kernel.config.sections import StrictModel


class MismatchMonitorConfig(StrictModel):
    action: Literal["warn", "error", "off"] = Field(
        "warn",
        description="What a mismatch alarm does: warn (log it and go on), error (stop the run with what to check), "
        "off (no alarm; the mismatch/* metrics are still logged).",
    )
    bound: float = Field(
        0.01,
        gt=0,
        description="A step counts as mismatched when mismatch/fresh_k3 (the per-token k3 estimate of the KL "
        "divergence between the servers' sampling distribution and the trainer's, on tokens sampled with the "
        "trainer's current weights) is above this; steps without such tokens are not checked.",
    )
    patience: int = Field(3, ge=1, description="Consecutive mismatched steps before the alarm.")
    token_threshold: float = Field(
        0.5,
        gt=0,
        description="A token counts in mismatch/frac_over when its two log-probabilities differ by more than this.",
    )

    @field_validator("action", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        # YAML reads a bare `off` as false.
        return "off" if v is False else v


class MonitorConfig(StrictModel):
    mismatch: MismatchMonitorConfig = Field(default_factory=MismatchMonitorConfig)
