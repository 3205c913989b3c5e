"""Engine protocols: what the kernel expects of train and inference backends.

Backends implement these; the trainer, rollout executor and workflows only
talk to these interfaces. Nothing here imports torch.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from areal_kernel.api.io import ModelRequest, ModelResponse, TrajectoryBatch

if TYPE_CHECKING:
    from areal_kernel.api.scheduler import Scheduler
    from areal_kernel.config.allocation import Allocation
    from areal_kernel.config.models import ExperimentConfig
    from areal_kernel.platforms.base import Platform


@dataclass
class WeightUpdateMeta:
    """How new weights travel from the train engine to inference servers.

    ``kind``: ``"disk"`` (safetensors directory at ``path``) or
    ``"broadcast"`` (in-memory over a torch.distributed group whose rendezvous
    is ``master_addr:master_port``).

    ``adapter``: set when the train engine trains a LoRA adapter
    (``TrainEngine.adapter_spec``): only the adapter travels, ``path`` is then
    a peft adapter directory, and servers serve it under this name beside the
    unchanged base weights.
    """

    kind: str
    version: int
    path: str | None = None
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    group_name: str = "areal_weights"
    bucket_bytes: int = 256 << 20
    extra: dict[str, Any] = field(default_factory=dict)
    adapter: str | None = None


@dataclass(frozen=True)
class AdapterSpec:
    """The LoRA adapter a train engine trains (``TrainEngine.adapter_spec``).

    ``name``: what the inference servers serve it under and what requests
    name (``GenerationConfig.adapter``). ``config``: its peft
    ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``, ...),
    what a server needs beside the tensors to apply it.
    """

    name: str
    config: dict[str, Any]


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

    async def aclose(self, current_loop_only: bool = False) -> None:
        """Close what ``agenerate`` opened on the running event loop (its HTTP
        sessions) before that loop ends (``areal check`` runs its own loop)."""

    # -- what the kernel's weight transports, supervisor and trainer also use --
    # ``RemoteInferenceEngine`` (the client every built-in backend's
    # ``make_client`` returns) implements all of them; the defaults say which
    # feature an engine without them cannot serve.

    #: The LoRA adapter requests generate with when they name none (the RL
    #: trainer sets it to the adapter its train engine trains).
    default_adapter: str | None = None
    #: Set by the server supervisor: control calls that miss a server being
    #: restarted are not fatal.
    supervised: bool = False
    #: Counters the trainer logs (``failovers``, ``requests``, ``resyncs``, ...).
    stats: dict[str, int]

    def set_version(self, version: int) -> None:
        """The weight version the servers now serve (after an update the engine
        did not make itself, e.g. a broadcast)."""
        raise self._unsupported("set_version", "weight updates")

    def load_adapter(self, name: str, path: str, version: int) -> None:
        """Every server serves the peft adapter directory ``path`` as ``name``
        (the disk transport of an adapter-only update)."""
        raise self._unsupported("load_adapter", "LoRA adapter updates")

    @property
    def weight_group_world_size(self) -> int:
        """Ranks of the broadcast weight group: the trainer (rank 0) plus every
        server rank. The default raises ``AttributeError`` (an engine without a
        weight group has no such attribute, for ``hasattr``)."""
        raise AttributeError(str(self._unsupported("weight_group_world_size", "weight_update.mode: broadcast")))

    def init_weight_group_async(self, master_addr: str, master_port: int, group_name: str, backend: str) -> list[Any]:
        """Ask every server to join the broadcast weight group; one future per
        server, done once the trainer joined too (``BroadcastTransport.setup``)."""
        raise self._unsupported("init_weight_group_async", "weight_update.mode: broadcast")

    def update_from_distributed_async(
        self, tensors: list[dict[str, Any]], version: int, bucket_bytes: int, group_name: str
    ) -> list[Any]:
        """Start a broadcast update on every server (``tensors``: the
        metadata of ``tensor_meta``); one future per server."""
        raise self._unsupported("update_from_distributed_async", "weight_update.mode: broadcast")

    def update_adapter_from_distributed_async(
        self,
        name: str,
        config: dict[str, Any],
        tensors: list[dict[str, Any]],
        version: int,
        bucket_bytes: int,
        group_name: str,
    ) -> list[Any]:
        """Start an in-memory adapter update on every server; one future per server."""
        raise self._unsupported("update_adapter_from_distributed_async", "broadcast LoRA adapter updates")

    def weight_fingerprints(self, spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
        """Ask every server for the fingerprint of the weights it serves
        (``spec``: ``areal_kernel.monitor.weights.FingerprintSpec.to_json()``);
        returns ``(replies by address, errors by address)`` for the servers
        that answered and those that could not. Used by the weight-delivery
        check (``monitor.weights``); raises ``NotImplementedError`` when the
        backend has no such route."""
        raise self._unsupported("weight_fingerprints", "the weight-delivery check (monitor.weights)")

    def hold(self, address: str) -> None:
        """Send nothing to ``address`` (its server is being restarted) until ``release``."""
        raise self._unsupported("hold", "rollout.restart_servers")

    def release(self, address: str) -> None:
        """``address`` is back with the current weights: schedule on it again."""
        raise self._unsupported("release", "rollout.restart_servers")

    def resync_server(self, address: str) -> int | None:
        """Bring a restarted server to the current weights; returns their
        version, or ``None`` when the weight transport will deliver them
        (an in-memory weight group: the server stays held until then)."""
        raise self._unsupported("resync_server", "rollout.restart_servers")

    def fail(self, error: BaseException) -> None:
        """Make every generation from now on raise ``error`` (a server is lost for good)."""
        raise self._unsupported("fail", "rollout.restart_servers")

    def _unsupported(self, member: str, feature: str) -> NotImplementedError:
        return NotImplementedError(
            f"{type(self).__name__} does not implement InferenceEngine.{member}, which {feature} needs "
            "(areal_kernel.inference.client.RemoteInferenceEngine implements every member)"
        )


class ServerLauncher(abc.ABC):
    """Starts and stops inference server processes for one backend."""

    @abc.abstractmethod
    def launch(self, model_path: str, n_servers: int, devices_per_server: int) -> list[ServerInfo]: ...

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop every server this launcher started (whole process groups)."""


@dataclass(frozen=True)
class TrainEngineContext:
    """Everything the kernel hands a train-engine factory (``actor.backend``).

    The kernel builds one per engine and calls the registered class as
    ``Engine.from_context(context)`` in the controller process, before
    ``initialize``. Fields:

    - ``settings``: the engine's own validated section (``actor.<name>: {...}``,
      an instance of its registered ``config_model``; ``None`` without one).
      The kernel may have adjusted it for the run (``temperature`` follows
      ``rollout.gconfig.temperature``), so read settings from here, not from
      ``config.actor``.
    - ``config``: the whole validated ``ExperimentConfig`` of the run.
    - ``allocation``: the parsed ``actor.backend`` (``fsdp:d2`` -> ``d=2``);
      ``allocation.world_size`` is the number of processes the engine may use.
    - ``platform``: the current ``Platform`` (device, collective backend).
    - ``run_dir``: the run directory (exists); engines put their logs under it.
    - ``scheduler``: the run's scheduler when one is running (the RL trainer
      starts it for the inference servers), else ``None`` (offline trainers).
      An engine may start its processes with ``scheduler.start_train_ranks``;
      it must not call ``scheduler.stop()``: the run owns the scheduler.
    - ``role``: ``"actor"`` (the policy being trained) or ``"ref"`` (a frozen
      copy of the initial policy, used only for ``compute_logprobs``).
    """

    settings: Any
    config: "ExperimentConfig"
    allocation: "Allocation"
    platform: "Platform"
    run_dir: str
    scheduler: "Scheduler | None" = None
    role: str = "actor"


class TrainEngine(abc.ABC):
    """A policy under training, driven by the single controller. It may span
    several processes (ranks), but every method below is called in the
    controller process, one call at a time, from the trainer's thread.

    Life cycle: ``from_context`` -> ``initialize`` -> (``compute_logprobs`` /
    ``train_batch`` / weight export / ``save_state`` ...)* -> ``destroy``.
    ``tests/kernel/test_train_engine_api.py`` checks that the kernel calls
    nothing on a train engine that this class does not declare.
    """

    @classmethod
    def from_context(cls, context: TrainEngineContext) -> "TrainEngine":
        """The factory the kernel calls: build (do not yet load) an engine for
        ``context``. The default passes only the settings section, as
        ``cls(context.settings)``; override it to use the allocation, the
        scheduler or the run directory."""
        return cls(context.settings)  # type: ignore[call-arg]

    @abc.abstractmethod
    def initialize(self, model_path: str, total_train_steps: int) -> None:
        """Load the HF model in ``model_path`` and build the optimizer and the
        lr schedule over ``total_train_steps`` optimizer steps. Called once,
        right after ``from_context``; start any rank processes here."""

    @abc.abstractmethod
    def compute_logprobs(self, batch: TrajectoryBatch, only_loss_tokens: bool = False) -> list[list[float]]:
        """Per-token logprobs of ``input_ids`` under the current weights
        (entry ``i`` scores token ``i``; position 0 gets 0.0). With
        ``only_loss_tokens`` an engine may leave non-loss entries at 0.0.
        Called before a step (proximal logprobs, reference-model scores) and
        by the offline trainers' evaluation; must not change any state."""

    @abc.abstractmethod
    def train_batch(
        self,
        batch: TrajectoryBatch,
        loss_fn: Callable[..., Any],
        extra: dict[str, list[list[float]]] | None = None,
    ) -> dict[str, float]:
        """One optimizer step over ``batch`` (``ppo_n_minibatches`` calls per
        trainer step). ``loss_fn`` sees per-token tensors under the loss
        contract (``areal_kernel.api.loss``); ``extra`` holds one
        row per trajectory for keys such as ``advantages``. Returns scalar
        statistics, at least ``loss``, ``grad_norm``, ``lr`` and ``skipped``
        (1.0 when a non-finite loss or gradient left the weights unchanged)."""

    @abc.abstractmethod
    def save_hf(self, path: str) -> None:
        """Write the current weights as an HF directory (safetensors, config,
        tokenizer files of the source model) at ``path``, atomically (see
        ``areal_kernel.utils.fs``). Called for ``checkpoint.save_hf_every`` and
        the final checkpoint; the directory must load with ``from_pretrained``."""

    @abc.abstractmethod
    def send_weights(self, meta: WeightUpdateMeta) -> None:
        """Push the weights to inference servers after each step:
        ``kind="disk"`` writes an HF directory at ``meta.path`` (like
        ``save_hf``); ``kind="broadcast"`` streams ``named_weights_for_transfer``
        over the group joined by ``init_weight_group`` in buckets of
        ``meta.bucket_bytes`` (``areal_kernel.weights.broadcast.send_buckets``),
        while the receivers run ``recv_buckets`` with the same metadata."""

    @abc.abstractmethod
    def named_weights_for_transfer(self) -> list[tuple[str, Any]]:
        """``(HF name, tensor)`` of every weight in send order, tied aliases
        dropped (what ``from_pretrained`` accepts). The broadcast transport
        calls it before each update for the metadata (name, dtype, shape) the
        receivers need and the byte count; an engine whose weights live in
        other processes may return ``device="meta"`` tensors."""

    @abc.abstractmethod
    def save_state(self, path: str) -> None:
        """Write everything exact recovery needs into the directory ``path``
        (weights, optimizer moments, lr-schedule step, ``get_version()``, RNG
        states), atomically. Called at ``checkpoint.save_every`` with the
        rollout drained; ``load_state`` into a fresh engine must continue with
        identical results."""

    @abc.abstractmethod
    def load_state(self, path: str) -> None:
        """Restore what ``save_state`` wrote into this initialized engine
        (same model architecture), version included. Called once when a run
        resumes, after ``initialize``; raise ``DataError`` naming ``path``
        when it is not such a checkpoint."""

    def init_weight_group(
        self,
        master_addr: str,
        master_port: int,
        world_size: int,
        rank: int = 0,
        group_name: str = "areal_weights",
        backend: str | None = None,
        timeout_s: float = 300,
    ) -> Any:
        """Join the torch.distributed group of the broadcast weight transport
        as its sender (``rank`` 0; the inference servers are 1..n). Called
        once, after ``initialize``, when ``weight_update`` resolved to
        ``broadcast``, while the servers join concurrently. The default says
        that this engine cannot broadcast."""
        from areal_kernel.errors import ConfigError

        raise ConfigError(
            f"weight_update.mode: the train engine {type(self).__name__} cannot send weights by broadcast; "
            "use weight_update.mode: disk"
        )

    def weight_sample(self, positions: dict[str, list[int]]) -> dict[str, Any]:
        """For the weight-delivery check (``monitor.weights``): the elements at
        the flat ``positions`` of each named tensor of the last sent weights
        (names as ``named_weights_for_transfer``), as CPU tensors in the
        dtype sent. The default reads ``named_weights_for_transfer``; an
        engine whose weights live in other processes overrides it or raises
        ``NotImplementedError`` (the check is then skipped with a note)."""
        from areal_kernel.utils.tensor_sample import sample_named

        return sample_named(self.named_weights_for_transfer(), positions)

    def adapter_spec(self) -> AdapterSpec | None:
        """The LoRA adapter this engine trains, or ``None`` when it trains every
        weight (the default). With an adapter, ``named_weights_for_transfer``
        returns the adapter's tensors only (peft's file names), ``send_weights``
        with ``kind="disk"`` writes a peft adapter directory, and the kernel's
        weight transports send adapter-only updates (``WeightUpdateMeta.adapter``)."""
        return None

    @property
    def temperature(self) -> float | None:
        """The temperature logits are divided by before the log-softmax, or
        ``None`` when the engine has no such setting. The RL step refuses to
        run when it differs from the sampling temperature."""
        return None

    def get_version(self) -> int:
        """The weight version (number of updates sent to the servers). Read by
        the RL step to date proximal logprobs and stored by ``save_state``."""
        return getattr(self, "_version", 0)

    def set_version(self, version: int) -> None:
        """Called after every weight update and after ``load_state`` with the
        version the servers now serve."""
        self._version = version

    def destroy(self) -> None:
        """Free everything (rank processes, process groups, memory). Called
        once when the run ends, whatever its status; must not raise."""
