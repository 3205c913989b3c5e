"""The wire format of one inference-server backend, as the generic client sees it.

A backend plugin (embedded, vLLM, SGLang, ...) describes its HTTP routes and
bodies by subclassing ``ServerProtocol``; retries, affinity, failover,
interruption and version stamping live once, in ``RemoteInferenceEngine``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from areal_kernel.api.io import GenerationConfig, StopReason


@dataclass
class HttpCall:
    method: str
    path: str
    json: dict[str, Any] | None = None
    # Control calls that load weights may take long; None = client default.
    timeout_s: float | None = None


@dataclass
class GenerateChunk:
    """What one ``/generate``-style call returned."""

    output_ids: list[int]
    output_logprobs: list[float]
    stop_reason: StopReason
    version: int | None = None  # weight version that produced these tokens
    extra: dict[str, Any] = field(default_factory=dict)


class ServerProtocol:
    """Routes and bodies of a server backend. Override what differs."""

    health_path: str = "/health"

    def generate(self, rid: str, input_ids: list[int], gconfig: GenerationConfig, max_new_tokens: int) -> HttpCall:
        raise NotImplementedError

    def parse_generate(self, data: Any) -> GenerateChunk:
        raise NotImplementedError

    def pause(self, mode: str = "abort") -> HttpCall:
        raise NotImplementedError

    def resume(self) -> HttpCall:
        raise NotImplementedError

    def update_weights_from_disk(self, path: str, version: int) -> HttpCall:
        raise NotImplementedError

    def init_weight_group(
        self, master_addr: str, master_port: int, world_size: int, rank: int, group_name: str, backend: str
    ) -> HttpCall:
        raise NotImplementedError

    def update_weights_from_distributed(
        self, tensors: list[dict[str, Any]], version: int, bucket_bytes: int, group_name: str
    ) -> HttpCall:
        raise NotImplementedError

    def set_version(self, version: int) -> HttpCall:
        raise NotImplementedError
