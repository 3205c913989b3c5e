"""The ``rollout.sglang`` config section (validated by the kernel against this model)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from areal_kernel.config.sections import RoleEnvironment

# Flags the launcher sets itself; passing them again through extra_args would
# silently fight the launcher (SGLang's argparse keeps the last one).
MANAGED_FLAGS = frozenset(
    {
        "--model-path",
        "--model",
        "--host",
        "--port",
        "--tp-size",
        "--tensor-parallel-size",
        "--dtype",
        "--context-length",
        "--mem-fraction-static",
        "--attention-backend",
        "--disable-radix-cache",
        "--random-seed",
        "--weight-version",
        "--api-key",
        "--enable-memory-saver",
        "--skip-server-warmup",
        "--log-level",
        "--base-gpu-id",
        "--device",
        "--enable-lora",
        "--max-lora-rank",
        "--lora-target-modules",
        "--max-loras-per-batch",
    }
)


class SGLangLoraSettings(BaseModel):
    """LoRA serving (``rollout.sglang.lora``); adapters are loaded at run time
    through ``/load_lora_adapter`` and replaced by unload + load."""

    model_config = ConfigDict(extra="forbid")

    max_rank: int = Field(16, ge=1, description="largest adapter rank served (--max-lora-rank)")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="modules any adapter may target (--lora-target-modules); SGLang sizes its buffers from them",
    )
    max_loras_per_batch: int = Field(2, ge=1, description="adapters in one batch, the base included")


class SGLangServerConfig(RoleEnvironment):
    """Settings of SGLang servers (``rollout.sglang``). ``None`` leaves SGLang's own default.
    ``python`` (from ``RoleEnvironment``): the interpreter the servers run
    from; unset, this one when it has SGLang, else the managed environment
    ``sglang`` (``areal env create sglang``)."""

    model_config = ConfigDict(extra="forbid")
    environment: ClassVar[str] = "sglang"

    model_path: str | None = Field(
        None, description="Serve this path/hub id instead of the resolved model.path (e.g. a pre-converted checkpoint)."
    )
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] | None = Field(
        None, description="--dtype; default: model.dtype of the run."
    )
    context_length: int | None = Field(None, ge=1, description="--context-length")
    mem_fraction_static: float | None = Field(None, gt=0, lt=1, description="--mem-fraction-static")
    tp_size: int | None = Field(
        None, ge=1, description="--tp-size; default: devices per server from rollout.backend (e.g. sglang:d2t4 -> 4)."
    )
    attention_backend: str | None = Field(
        None,
        min_length=1,
        description="--attention-backend (e.g. flashinfer, fa3, triton); default: SGLang's choice, or the "
        "platform's (ascend on the npu platform).",
    )
    device: str | None = Field(
        None,
        min_length=1,
        description="--device (cuda, npu, xpu, ...); default: SGLang's auto-detection, or the platform's "
        "(npu on the npu platform).",
    )
    radix_cache: bool = Field(True, description="false adds --disable-radix-cache")
    seed: int | None = Field(None, ge=0, description="--random-seed; default: the experiment seed.")
    log_level: Literal["debug", "info", "warning", "error", "critical"] = "info"
    skip_server_warmup: bool = False
    enable_memory_saver: bool = Field(
        False, description="--enable-memory-saver: needed for release/resume_memory_occupation (colocated setups)."
    )
    api_key: str | None = Field(
        None,
        description="--api-key; the client sends it as a Bearer token. Unset: generated when a server binds "
        "beyond loopback (the kernel's admin-token rule), none on loopback.",
    )
    pause_mode: Literal["abort", "retract", "in_place"] = Field(
        "abort",
        description="/pause_generation mode for weight updates. 'abort' returns partial outputs that the client "
        "resumes on the new weights; 'retract'/'in_place' keep requests inside SGLang.",
    )
    extra_args: list[str] = Field(default_factory=list, description="Appended verbatim to the launch command.")
    extra_env: dict[str, str] = Field(default_factory=dict)
    lora: SGLangLoraSettings | None = Field(
        None, description="Serve LoRA adapters (set from the actor's adapter when it trains one and this is unset)."
    )
    host: str = "127.0.0.1"
    startup_timeout_s: float = Field(900.0, gt=0, description="Model load + CUDA graph capture can take minutes.")
    stop_grace_s: float = Field(15.0, ge=0)
    port_retries: int = Field(2, ge=0, description="Relaunch on a new port when the chosen one was taken.")

    @field_validator("extra_args")
    @classmethod
    def _no_managed_flags(cls, v: list[str]) -> list[str]:
        for a in v:
            if not isinstance(a, str):
                raise ValueError(f"every extra argument must be a string, got {a!r}")
            flag = a.split("=", 1)[0]
            if flag in MANAGED_FLAGS:
                raise ValueError(
                    f"{flag} is set by the launcher; use the matching rollout.sglang field instead "
                    f"(managed flags: {', '.join(sorted(MANAGED_FLAGS))})"
                )
        return v
