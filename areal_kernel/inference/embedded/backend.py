"""The ``embedded`` inference backend as the kernel sees it: launcher + wire format.

Registered by the builtin plugin exactly like an external backend would be.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from areal_kernel.api.io import GenerationConfig, ImageInputs, StopReason
from areal_kernel.errors import ServerError
from areal_kernel.inference.backend import InferenceBackend
from areal_kernel.inference.client import RemoteInferenceEngine, client_options
from areal_kernel.inference.wire import GenerateChunk, HttpCall, ServerProtocol

if TYPE_CHECKING:
    from areal_kernel.inference.embedded.launcher import EmbeddedLauncher

_FINISH = {"stop": StopReason.STOP, "length": StopReason.LENGTH, "abort": StopReason.ABORT}


class EmbeddedProtocol(ServerProtocol):
    health_path = "/health"
    adapter_broadcast = True
    # The engine aborts that adapter's rows only (EmbeddedEngine.load_adapter).
    adapter_update_scoped = True
    supports_images = True

    def add_images(self, call: HttpCall, images: ImageInputs) -> HttpCall:
        # The server takes the token ids as they are (placeholders expanded)
        # and the encoded files, base64 in the JSON body.
        assert call.json is not None
        return HttpCall(call.method, call.path, {**call.json, "images": images.b64()}, call.timeout_s, call.parse)

    def generate(self, rid: str, input_ids: list[int], gconfig: GenerationConfig, max_new_tokens: int) -> HttpCall:
        return HttpCall(
            "POST",
            "/generate",
            {
                "rid": rid,
                "input_ids": input_ids,
                "sampling_params": {
                    "max_new_tokens": max_new_tokens,
                    "temperature": gconfig.temperature,
                    "top_p": gconfig.top_p,
                    "top_k": gconfig.top_k,
                    "greedy": gconfig.greedy,
                    "stop_token_ids": list(gconfig.stop_token_ids),
                    "seed": gconfig.seed,
                    "stop": list(gconfig.stop),
                },
                "adapter": gconfig.adapter,
            },
        )

    def parse_generate(self, data: Any) -> GenerateChunk:
        try:
            reason = _FINISH[data["finish_reason"]]
            ids = [int(x) for x in data["output_ids"]]
            lps = [float(x) for x in data["output_logprobs"]]
        except (KeyError, TypeError, ValueError) as e:
            raise ServerError(
                f"embedded server answered /generate with an unexpected body ({e}): {str(data)[:300]}"
            ) from None
        if len(ids) != len(lps):
            raise ServerError(f"embedded server returned {len(ids)} tokens but {len(lps)} logprobs")
        matched = data.get("matched_stop")
        return GenerateChunk(
            ids,
            lps,
            reason,
            version=data.get("weight_version"),
            matched_stop=matched if isinstance(matched, str) else None,
        )

    def pause(self, mode: str = "abort") -> HttpCall:
        return HttpCall("POST", "/pause", {"mode": mode})

    def resume(self) -> HttpCall:
        return HttpCall("POST", "/resume", {})

    def update_weights_from_disk(self, path: str, version: int) -> HttpCall:
        return HttpCall("POST", "/update_weights_from_disk", {"path": path, "version": version})

    def init_weight_group(
        self, master_addr: str, master_port: int, world_size: int, rank: int, group_name: str, backend: str
    ) -> HttpCall:
        return HttpCall(
            "POST",
            "/init_weights_group",
            {
                "master_addr": master_addr,
                "master_port": master_port,
                "world_size": world_size,
                "rank": rank,
                "group_name": group_name,
                "backend": backend,
            },
        )

    def update_weights_from_distributed(
        self, tensors: list[dict[str, Any]], version: int, bucket_bytes: int, group_name: str
    ) -> HttpCall:
        return HttpCall(
            "POST",
            "/update_weights_from_distributed",
            {"version": version, "tensors": tensors, "bucket_bytes": bucket_bytes},
        )

    def server_info(self) -> HttpCall:
        return HttpCall("GET", "/info", timeout_s=10.0)

    def set_version(self, version: int) -> HttpCall:
        return HttpCall("POST", "/set_version", {"version": version})

    def weight_fingerprint(self, spec: dict[str, Any]) -> HttpCall:
        return HttpCall("POST", "/weight_fingerprint", spec)

    def load_adapter(self, name: str, path: str, version: int, replace: bool) -> HttpCall:
        # The server replaces an adapter of the same name itself.
        return HttpCall("POST", "/load_adapter", {"name": name, "path": path, "version": version})

    def unload_adapter(self, name: str) -> HttpCall:
        return HttpCall("POST", "/unload_adapter", {"name": name})

    def update_adapter_from_distributed(
        self,
        name: str,
        config: dict[str, Any],
        tensors: list[dict[str, Any]],
        version: int,
        bucket_bytes: int,
        group_name: str,
    ) -> HttpCall:
        return HttpCall(
            "POST",
            "/update_adapter_from_distributed",
            {"name": name, "version": version, "config": config, "tensors": tensors, "bucket_bytes": bucket_bytes},
        )


class EmbeddedBackend(InferenceBackend):
    """Built from the experiment config; the scheduler calls ``launch``."""

    protocol_cls = EmbeddedProtocol
    launcher: EmbeddedLauncher | None  # what make_launcher made, once launched

    def __init__(self, config: Any) -> None:
        from areal_kernel.inference.embedded.launcher import EmbeddedServerConfig

        super().__init__(config)
        server_cfg = config.rollout.plugin_config or EmbeddedServerConfig()
        # model.dtype is the run-wide choice of inference precision.
        self.server_config = server_cfg.model_copy(update={"dtype": config.model.dtype})

    def make_launcher(self, run_dir: str) -> EmbeddedLauncher:
        from areal_kernel.inference.embedded.launcher import EmbeddedLauncher

        return EmbeddedLauncher(self.server_config, run_dir=run_dir)

    def make_client(self, addresses: list[str]) -> RemoteInferenceEngine:
        return RemoteInferenceEngine(
            addresses,
            self.protocol_cls(),
            **client_options(self.config.rollout),
            # The launcher's token: it generates one when binding beyond loopback.
            admin_token=self.launcher.admin_token if self.launcher is not None else self.server_config.admin_token,
        )
