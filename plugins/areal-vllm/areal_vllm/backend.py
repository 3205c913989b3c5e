"""The ``vllm`` inference backend as the kernel sees it: launcher + wire format.

Built by the kernel from the experiment config (``rollout.backend: vllm``,
settings under ``rollout.vllm``); the scheduler calls ``launch`` with one
device list per server, then the trainer uses ``make_client``.
"""

from __future__ import annotations

import os
from typing import Any

from areal_kernel.errors import ConfigError
from areal_kernel.config.policies import served_adapters
from areal_kernel.inference.backend import InferenceBackend


class VLLMBackend(InferenceBackend):
    def __init__(self, config: Any) -> None:
        from areal_vllm.config import VLLMServerConfig

        super().__init__(config)
        from areal_kernel.platforms import current_platform

        # A platform may give vLLM settings for its device (fields the user left unset).
        section = current_platform().apply_server_defaults("vllm", config.rollout.plugin_config or VLLMServerConfig())
        # model.dtype is the run-wide inference precision unless the section overrides it.
        dtype = section.dtype or config.model.dtype
        alloc = config.rollout.allocation
        if section.tensor_parallel_size is not None and section.tensor_parallel_size != alloc.t:
            raise ConfigError(
                f"rollout.vllm.tensor_parallel_size={section.tensor_parallel_size} disagrees with "
                f"rollout.backend={alloc} (t={alloc.t}); set one of them"
            )
        if alloc.p != 1 or alloc.c != 1:
            raise ConfigError(
                f"rollout.backend={alloc}: areal-vllm places servers by tensor parallelism only (t); "
                f"pipeline/context dims (p, c) must be 1"
            )
        self.server_config = section.model_copy(update={"dtype": dtype, "tensor_parallel_size": alloc.t})
        served = served_adapters(config)
        if served is not None:
            from areal_vllm.config import VLLMLoraSettings

            # The run trains adapters (the actor's, or one per policy): the
            # servers must serve adapters of their largest rank, all at once.
            n = len(served.names)
            lora = self.server_config.lora or VLLMLoraSettings(max_rank=served.max_rank, max_loras=n)
            if lora.max_rank < served.max_rank:
                raise ConfigError(
                    f"rollout.vllm.lora.max_rank={lora.max_rank} is below the rank of a trained adapter "
                    f"({served.max_rank}: adapters {', '.join(served.names)})"
                )
            if lora.max_loras < n:
                raise ConfigError(
                    f"rollout.vllm.lora.max_loras={lora.max_loras} is below the number of adapters the run trains "
                    f"({n}: {', '.join(served.names)}); every one is served in the same batches"
                )
            self.server_config = self.server_config.model_copy(update={"lora": lora})

    def make_launcher(self, run_dir: str) -> Any:
        from areal_vllm.launcher import VLLMLauncher

        return VLLMLauncher(self.server_config, run_dir=os.path.join(run_dir, "vllm"))

    def launch(self, model_dir: str, device_plan: list[list[int]], run_dir: str) -> list[str]:
        check_context_length(self.server_config, model_dir)
        # The client needs the model's image placeholder layout (vision-language models).
        self.model_dir = model_dir
        return super().launch(model_dir, device_plan, run_dir)

    def make_client(self, addresses: list[str]) -> Any:
        from areal_kernel.inference.client import client_options
        from areal_kernel.models.vision import image_placeholders
        from areal_vllm.protocol import VLLMInferenceEngine, VLLMProtocol

        model_dir = getattr(self, "model_dir", None)
        engine = VLLMInferenceEngine(
            addresses,
            VLLMProtocol(
                tp_size=self.server_config.tensor_parallel_size or 1,
                image_placeholders=image_placeholders(model_dir) if model_dir else None,
            ),
            **client_options(self.config.rollout),
            # The launcher's token (the kernel's rule: generated beyond loopback).
            admin_token=self.launcher.admin_token if self.launcher is not None else self.server_config.admin_token,
        )
        # Label the served weights as version 0 (vLLM starts at "default").
        engine.set_version(0)
        return engine


def check_context_length(server_config: Any, model_dir: str) -> None:
    """``rollout.vllm.max_model_len`` longer than the model's positions is one
    line before any server starts (vLLM would refuse it at start-up, minutes
    in, with a traceback in the server log). Only a plain
    ``max_position_embeddings`` is compared: with rope scaling the usable
    length is vLLM's to derive, and ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` in
    ``rollout.vllm.extra_env`` is vLLM's own way to allow more."""
    import json

    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path) or server_config.extra_env.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN"):
        return
    try:
        with open(path) as f:
            hf = json.load(f)
    except (OSError, ValueError):
        return  # the server reports an unreadable model itself
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf
    limit = text.get("max_position_embeddings")
    rope = text.get("rope_scaling") or text.get("rope_parameters") or {}
    scaled = isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) != "default"
    if isinstance(limit, int) and not scaled and server_config.max_model_len > limit:
        raise ConfigError(
            f"rollout.vllm.max_model_len={server_config.max_model_len} is longer than the model's "
            f"max_position_embeddings={limit} ({path}); set rollout.vllm.max_model_len to {limit} or less"
        )
