"""Configuration of the built-in ``TorchTrainEngine`` (pydantic v2, no torch)."""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from areal_kernel.errors import ConfigError


# Adapter names travel in URLs, JSON bodies and directory names of every backend.
ADAPTER_NAME_PATTERN = r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$"


class LoraConfig(BaseModel):
    """A LoRA adapter trained instead of the full model (``lora:`` of a train
    engine's section). The base weights stay frozen; only the adapter's
    matrices are in the optimizer, in recovery checkpoints and in weight
    updates to the inference servers."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(8, ge=1, le=1024, description="rank r of each low-rank update B @ A")
    alpha: int = Field(
        16, ge=1, description="the update is scaled by alpha / rank (an integer, as peft and the servers read it)"
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input while training")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="linear layers that get an adapter, by name or name suffix (e.g. q_proj, mlp.up_proj)",
    )
    export: Literal["adapter", "merged"] = Field(
        "adapter",
        description="save_hf writes a peft adapter directory ('adapter') or the base model with the adapter "
        "merged into its weights ('merged', loads with from_pretrained alone)",
    )
    name: str = Field(
        "policy",
        pattern=ADAPTER_NAME_PATTERN,
        description="the name the inference servers serve the adapter under (requests name it); two runs "
        "sharing servers give their adapters different names",
    )


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
    lora: LoraConfig | None = Field(None, description="train a LoRA adapter instead of every weight")
    adapters: list[LoraConfig] | None = Field(
        None,
        min_length=1,
        description="several LoRA adapters on one frozen base, one per policy (each with its own name, "
        "optimizer, lr-schedule step, export and weight updates; the engine hands out one view per adapter: "
        "engine.policy(name)); not together with lora",
    )

    @field_validator("adapters")
    @classmethod
    def _distinct_adapter_names(cls, adapters: list[LoraConfig] | None) -> list[LoraConfig] | None:
        # The name keys everything per policy (views, checkpoints, the servers' adapters).
        seen: dict[str, int] = {}
        for i, a in enumerate(adapters or []):
            if a.name in seen:
                raise ValueError(
                    f"entries {seen[a.name]} and {i} are both named {a.name!r}; give each adapter its own name"
                )
            seen[a.name] = i
        return adapters

    @model_validator(mode="after")
    def _lora_or_adapters(self) -> Self:
        if self.lora is not None and self.adapters is not None:
            raise ValueError(
                "lora and adapters are both set: use lora for one adapter, or adapters (a list) for several"
            )
        return self

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
