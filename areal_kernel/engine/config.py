"""Configuration of the built-in ``TorchTrainEngine`` (pydantic v2, no torch)."""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from areal_kernel.errors import ConfigError


class TorchEngineConfig(BaseModel):
    """Optimizer, schedule, precision and micro-batching of the torch engine."""

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(1e-6, ge=0, description="peak learning rate (0 freezes the weights: a control run)")
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    adam_eps: float = Field(1e-8, gt=0)
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps_proportion: float = Field(
        0.0, ge=0, le=1, description="fraction of total_train_steps spent warming up linearly"
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="final lr / peak lr for linear and cosine decay")
    max_grad_norm: float | None = Field(1.0, description="clip threshold; None or <= 0 disables clipping")
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    autocast_bf16: bool = Field(False, description="bf16 autocast for forward/backward (weights stay param_dtype)")
    gradient_checkpointing: bool = False
    max_tokens_per_mb: int = Field(
        8192, gt=0, description="token budget of one packed micro-batch (a longer sequence gets its own)"
    )
    share_prompts: bool = Field(
        True,
        description="run a group's common prompt through the model once per micro-batch "
        "(exact; saves most of the compute when several samples share a long prompt)",
    )
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    temperature: float = Field(1.0, gt=0, description="logprobs = log_softmax(logits / temperature)")
    seed: int = 1

    @classmethod
    def parse(cls, data: "TorchEngineConfig | dict[str, Any] | None") -> Self:
        """Validate ``data`` (a subclass's ``parse`` returns the subclass,
        e.g. a plugin's engine config) and turn pydantic errors into a ``ConfigError``
        naming the offending field(s)."""
        if isinstance(data, cls):
            return data
        try:
            return cls.model_validate(data or {})
        except ValidationError as e:
            parts = []
            for err in e.errors():
                loc = ".".join(str(x) for x in err["loc"]) or "<root>"
                parts.append(f"{loc}: {err['msg']}")
            raise ConfigError("invalid train engine config: " + "; ".join(parts)) from None
