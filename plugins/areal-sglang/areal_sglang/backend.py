"""The ``sglang`` inference backend: launcher + SGLang's wire format + the kernel's generic client."""

from __future__ import annotations

import concurrent.futures
from typing import Any

from areal_kernel.config.policies import served_adapters
from areal_kernel.inference.backend import InferenceBackend
from areal_kernel.inference.client import RemoteInferenceEngine, client_options

from areal_sglang.config import SGLangServerConfig
from areal_sglang.protocol import SGLangProtocol


class SGLangInferenceEngine(RemoteInferenceEngine):
    """The kernel's client (retries, affinity, failover, interruption,
    restarts, weight-group ranks) plus SGLang's own control calls, all
    through the client's public ``control_all`` / ``control_async``."""

    protocol: SGLangProtocol

    def __init__(
        self, addresses: list[str], protocol: SGLangProtocol | None = None, *, tp_size: int | None = None, **kw: Any
    ) -> None:
        protocol = protocol or SGLangProtocol()
        if tp_size is not None:
            protocol.tp_size = tp_size
        super().__init__(addresses, protocol, **kw)

    @property
    def tp_size(self) -> int:
        return self.protocol.tp_size

    def set_version(self, version: int) -> None:
        """Set the version locally and on every server (``/update_weight_version``),
        so tokens generated from now on report it."""
        self.control_all(lambda a: self.protocol.set_version(version))
        super().set_version(version)

    # -- in-memory updates (areal_sglang.weights.SGLangBroadcastTransport) ----------
    def begin_weight_update(self) -> None:
        # A collective weight update cannot leave one server behind: every server must succeed.
        self.control_all(self.protocol.begin_weight_update(), require_all=True)

    def end_weight_update(self) -> None:
        self.control_all(self.protocol.end_weight_update(), require_all=True)

    def update_bucket_async(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str, version: int | None
    ) -> list[concurrent.futures.Future]:
        return self.control_async(self.protocol.update_weights_bucket(names, dtypes, shapes, group_name, version))

    def destroy_weight_group(self, group_name: str) -> None:
        self.control_all(lambda a: self.protocol.destroy_weight_group(group_name))

    def note_version(self, version: int) -> None:
        """The servers already switched (the last bucket carried the version): local only."""
        super().set_version(version)

    def flush_cache(self) -> None:
        self.control_all(lambda a: self.protocol.flush_cache())

    def abort(self, rid: str | None = None) -> None:
        """Abort one request by id, or every running request on every server."""
        self.control_all(lambda a: self.protocol.abort_request(rid))

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Free weights and/or KV cache (``tags``: "weights", "kv_cache") for a colocated trainer."""
        self.control_all(lambda a: self.protocol.release_memory(tags))

    def resume_memory(self, tags: list[str] | None = None) -> None:
        self.control_all(lambda a: self.protocol.resume_memory(tags))


class SGLangBackend(InferenceBackend):
    """Built from the experiment config; the scheduler calls ``launch``."""

    def __init__(self, config: Any, launch_prefix: list[str] | None = None) -> None:
        super().__init__(config)
        from areal_kernel.platforms import current_platform

        section = config.rollout.plugin_config or SGLangServerConfig()
        # The platform's variant of SGLang (e.g. --device npu and the ascend
        # attention backend) fills the fields the user left unset.
        self.server_config: SGLangServerConfig = current_platform().apply_server_defaults("sglang", section)
        served = served_adapters(config)
        if served is not None and self.server_config.lora is None:
            from areal_sglang.config import SGLangLoraSettings

            # The run trains adapters (the actor's, or one per policy): serve
            # adapters of their largest rank on every module one targets, all
            # of them and the base in one batch.
            lora = SGLangLoraSettings(
                max_rank=served.max_rank,
                target_modules=list(served.target_modules),
                max_loras_per_batch=max(2, len(served.names) + 1),
            )
            self.server_config = self.server_config.model_copy(update={"lora": lora})
        self.launch_prefix = launch_prefix
        self.tp_size = 1

    def make_launcher(self, run_dir: str) -> Any:
        from areal_sglang.launcher import SGLangLauncher

        return SGLangLauncher(
            self.server_config, run_dir=run_dir, dtype=self.config.model.dtype, seed=self.config.seed,
            launch_prefix=self.launch_prefix,
        )  # fmt: skip

    def launch(self, model_dir: str, device_plan: list[list[int]], run_dir: str) -> list[str]:
        per_server = len(device_plan[0]) if device_plan else 0
        self.tp_size = self.server_config.tp_size or max(1, per_server)
        return super().launch(model_dir, device_plan, run_dir)

    def make_client(self, addresses: list[str]) -> SGLangInferenceEngine:
        return SGLangInferenceEngine(
            addresses,
            SGLangProtocol(
                self.server_config.pause_mode,
                tp_size=self.tp_size,
                dtype=self.server_config.dtype or self.config.model.dtype,
            ),  # fmt: skip
            **client_options(self.config.rollout),
            # The launcher's token (the kernel's rule: generated beyond loopback).
            admin_token=self.launcher.admin_token if self.launcher is not None else self.server_config.api_key,
        )
