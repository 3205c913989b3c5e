"""The ``monitor:`` section: checks that watch a run for silent failures.

``monitor.mismatch`` compares, every step, the log-probabilities the
inference servers reported for the tokens they sampled with the trainer's
own log-probabilities of the same tokens, taken before the step's first
optimizer update (``areal_kernel.monitor.mismatch`` computes the numbers;
``docs/monitoring.md`` says what normal values look like and what to check
when the alarm fires).

``monitor.weights`` checks after every weight update that each inference
server serves the weights the trainer sent (``areal_kernel.monitor.weights``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from areal_kernel.config.sections import StrictModel


def _yaml_off(v: Any) -> Any:
    # YAML reads a bare `off` as false.
    return "off" if v is False else v


# What an alarm of any monitor does; each monitor picks its own default.
MonitorAction = Annotated[Literal["warn", "error", "off"], BeforeValidator(_yaml_off)]


class MismatchMonitorConfig(StrictModel):
    action: MonitorAction = Field(
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


class WeightsMonitorConfig(StrictModel):
    # Default error: the comparison is exact (bit patterns of the same
    # elements, after the one rounding a server's load does), so a mismatch is
    # never numerical noise but a server sampling from weights the trainer did
    # not send; a warning in a log is how such runs went unnoticed for weeks.
    action: MonitorAction = Field(
        "error",
        description="What a weight-delivery mismatch does: error (stop the run naming the server, tensor and "
        "version), warn (log it and go on), off (no check).",
    )
    # 40: on SmolLM2-135M (272 tensors) every tensor is checked within 7
    # updates for ~4% of a disk update's time (bench/bench_weight_check.py);
    # the check's cost grows with the number of tensors, not their size.
    tensors_per_update: int = Field(
        40,
        ge=1,
        description="Tensors checked after each update; they rotate, so every tensor is checked at least once "
        "in any ceil(n_tensors / tensors_per_update) consecutive updates.",
    )
    elements_per_tensor: int = Field(
        64, ge=1, description="Element positions sampled per checked tensor (new positions every version)."
    )


class MonitorConfig(StrictModel):
    mismatch: MismatchMonitorConfig = Field(default_factory=MismatchMonitorConfig)
    weights: WeightsMonitorConfig = Field(default_factory=WeightsMonitorConfig)
