"""Engine protocols: what the kernel expects of train and inference backends.

Backends implement these; the trainer, rollout executor and workflows only
talk to these interfaces. Nothing here imports torch.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Callable

from areal_kernel.api.io import ModelRequest, ModelResponse, TrajectoryBatch


@dataclass
class WeightUpdateMeta:
    """How new weights travel from the train engine to inference servers.

    ``kind``: ``"disk"`` (safetensors directory at ``path``) or
    ``"broadcast"`` (in-memory over a torch.distributed group whose rendezvous
    is ``master_addr:master_port``).
    """

    kind: str
    version: int
    path: str | None = None
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    group_name: str = "areal_weights"
    bucket_bytes: int = 256 << 20
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class ServerInfo:
    """A running inference server as the client sees it."""

    address: str  # "127.0.0.1:port"
    pid: int | None = None
    log_path: str | None = None
    device_ids: list[int] = field(default_factory=list)


class InferenceEngine(abc.ABC):
    """Client-side view of one or more inference servers.

    Called from the controller process. ``agenerate`` must survive weight
    updates: an interrupted generation resumes from its partial output.
    """

    @abc.abstractmethod
    async def agenerate(self, req: ModelRequest) -> ModelResponse: ...

    @abc.abstractmethod
    def get_version(self) -> int: ...

    @abc.abstractmethod
    def pause(self) -> None:
        """Stop new and running generations (running ones return partial output)."""

    @abc.abstractmethod
    def resume(self) -> None: ...

    @abc.abstractmethod
    def update_weights(self, meta: WeightUpdateMeta) -> None:
        """Make every server load the weights described by ``meta``.

        For ``broadcast``, the call returns once servers joined the group and
        the sender may start; ``finish_weight_update`` waits for completion.
        """

    def finish_weight_update(self, meta: WeightUpdateMeta) -> None:  # pragma: no cover - default
        """Wait for an in-flight update to complete and bump the version."""

    def destroy(self) -> None:
        """Release connections (servers are stopped by their launcher)."""


class ServerLauncher(abc.ABC):
    """Starts and stops inference server processes for one backend."""

    @abc.abstractmethod
    def launch(self, model_path: str, n_servers: int, devices_per_server: int) -> list[ServerInfo]: ...

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop every server this launcher started (whole process groups)."""


class TrainEngine(abc.ABC):
    """A policy (or critic) under training. May span several processes."""

    @abc.abstractmethod
    def initialize(self, model_path: str, total_train_steps: int) -> None: ...

    @abc.abstractmethod
    def compute_logprobs(self, batch: TrajectoryBatch, only_loss_tokens: bool = False) -> list[list[float]]:
        """Per-token logprobs of ``input_ids`` under the current weights
        (entry ``i`` scores token ``i``; position 0 gets 0.0). With
        ``only_loss_tokens`` an engine may leave non-loss entries at 0.0."""

    @abc.abstractmethod
    def train_batch(
        self,
        batch: TrajectoryBatch,
        loss_fn: Callable[..., Any],
        extra: dict[str, list[list[float]]] | None = None,
    ) -> dict[str, float]:
        """One optimizer step over ``batch``. ``loss_fn`` sees per-token
        tensors (see ``areal_kernel.algo``); returns scalar statistics."""

    @abc.abstractmethod
    def save_hf(self, path: str) -> None:
        """Write the weights as an HF directory (safetensors + config)."""

    @abc.abstractmethod
    def send_weights(self, meta: WeightUpdateMeta) -> None:
        """Push weights to inference servers according to ``meta``."""

    def get_version(self) -> int:
        return getattr(self, "_version", 0)

    def set_version(self, version: int) -> None:
        self._version = version

    def destroy(self) -> None:
        """Free resources (process groups, memory)."""
