"""The ``vllm`` inference backend as the kernel sees it: launcher + wire format.

Built by the kernel from the experiment config (``rollout.backend: vllm``,
settings under ``rollout.vllm``); the scheduler calls ``launch`` with one
device list per server, then the trainer uses ``make_client``.
"""
from __future__ import annotations

from typing import Any

from areal_kernel.errors import ConfigError


class VLLMBackend:
    def __init__(self, config: Any) -> None:
        from areal_vllm.config import VLLMServerConfig

        self.config = config
        section = config.rollout.plugin_config or VLLMServerConfig()
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
        self.launcher: Any = None

    def launch(self, model_dir: str, device_plan: list[list[int]], run_dir: str) -> list[str]:
        import os

        from areal_vllm.launcher import VLLMLauncher

        self.launcher = VLLMLauncher(self.server_config, run_dir=os.path.join(run_dir, "vllm"))
        devices_per_server = len(device_plan[0]) if device_plan else 0
        infos = self.launcher.launch(model_dir, n_servers=len(device_plan), devices_per_server=devices_per_server)
        return [i.address for i in infos]

    def make_client(self, addresses: list[str]) -> Any:
        from areal_vllm.protocol import VLLMInferenceEngine, VLLMProtocol

        r = self.config.rollout
        engine = VLLMInferenceEngine(
            addresses,
            VLLMProtocol(tp_size=self.server_config.tensor_parallel_size or 1),
            request_timeout_s=r.request_timeout_s,
            retries=r.request_retries,
            schedule_policy=r.schedule_policy,
        )
        # Label the served weights as version 0 (vLLM starts at "default").
        engine.set_version(0)
        return engine

    def stop(self) -> None:
        if self.launcher is not None:
            self.launcher.stop()
