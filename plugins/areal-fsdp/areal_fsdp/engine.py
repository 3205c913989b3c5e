"""``FSDPTrainEngine``: the controller-side face of N FSDP rank processes.

It implements the kernel's ``TrainEngine`` API in the controller process
(which imports torch but never holds the model), and drives the ranks
(``areal_fsdp.rank``) through the kernel's rank plumbing (``areal_kernel.engine.ranks``): every call is sent to
every rank, each with its share of the batch, and the answers are merged.

Why this shape: the kernel's trainer is a single controller that calls
``train_batch`` / ``compute_logprobs`` / ``send_weights`` on one object; the
ranks are real processes with the torch.distributed environment, started by
the scheduler (``LocalScheduler.start_train_ranks``), so the same engine
works under any scheduler that can start ranks.

Data parallelism: a batch is split into N parts balanced by tokens (whole
GRPO groups stay together when prompt sharing is on and there are enough
groups). Losses follow the kernel's loss contract: each micro-batch returns
its share of the *batch* loss (normalised by ``batch_loss_tokens`` /
``batch_n_seqs`` of the whole batch), the ranks sum their gradients (FSDP's
averaging is turned off), so a step equals the single-process step however
the batch is split across ranks and micro-batches.

Failure handling: a rank that raises reports its traceback; if the other
ranks also answer, the engine stays usable and the error is re-raised
(same type for kernel errors). If a rank dies or the others hang in a
collective, every rank is stopped and the engine refuses further calls.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any, Callable

from areal_kernel.api.engine import AdapterSpec, TrainEngine, TrainEngineContext, WeightUpdateMeta
from areal_kernel.api.io import TrajectoryBatch
from areal_kernel.config.allocation import Allocation, parse_allocation
from areal_kernel.engine.lr_schedule import scheduled_lr
from areal_kernel.engine.microbatch import check_batch, count_loss_tokens, merge_stats
from areal_kernel.engine.ranks import RankError, RankGroup
from areal_kernel.engine.state import check_param_names, read_engine_state, write_engine_state
from areal_kernel.errors import ArealError, ConfigError
from areal_kernel.logging import get_logger
from areal_kernel.utils.fs import atomic_dir

from areal_fsdp.config import FSDPEngineConfig

log = get_logger(__name__)
_ERROR_GRACE_S = 20.0  # after one rank failed, how long the others get to answer


__all__ = ["FSDPTrainEngine", "RankError"]


class FSDPTrainEngine(TrainEngine):
    """FSDP2 train engine over ``world_size`` rank processes.

    The kernel builds it with ``FSDPTrainEngine.from_context(context)``: the
    allocation (``actor.backend: fsdp:d2``) gives the rank count, the run's
    scheduler starts the ranks, their logs go to
    ``<run_dir>/fsdp-ranks`` (``fsdp-ranks-<role>`` for a reference model).
    Built directly (tests, scripts): ``allocation`` is ``"fsdp:d2"`` or an
    ``Allocation``, ``world_size`` a shortcut for ``fsdp:d<world_size>``
    (default one rank), and a ``local`` scheduler of its own starts the ranks.
    """

    def __init__(
        self,
        config: FSDPEngineConfig | dict[str, Any] | None = None,
        allocation: Allocation | str | None = None,
        *,
        world_size: int | None = None,
        log_dir: str | None = None,
        scheduler: Any = None,
        run_config: Any = None,
    ) -> None:
        self.config = FSDPEngineConfig.parse(config)
        if allocation is None and world_size is not None:
            allocation = f"fsdp:d{int(world_size)}"
        self.allocation = (
            parse_allocation(allocation) if isinstance(allocation, str) else (allocation or parse_allocation("fsdp"))
        )
        if (self.allocation.t, self.allocation.p, self.allocation.c) != (1, 1, 1):
            raise ConfigError(
                f"actor.backend: {self.allocation} asks for tensor/pipeline/context parallelism, which the fsdp "
                "engine does not do; use data-parallel dims only (e.g. 'fsdp:d2')"
            )
        self.world_size = self.allocation.world_size
        self.log_dir = log_dir
        self.run_config = run_config  # the run's ExperimentConfig (scheduler choice) when built by the kernel
        self.model_path: str | None = None
        self.total_train_steps = 0
        self._step = 0
        self._transfer_meta: list[dict[str, Any]] = []
        self._adapter_config: dict[str, Any] | None = None
        # The run's scheduler is used, never stopped (the run owns it); one made
        # here is this engine's own and is stopped with the ranks.
        self._scheduler: Any = scheduler
        self._owns_scheduler = False
        self._ranks: RankGroup | None = None

    @classmethod
    def from_context(cls, context: TrainEngineContext) -> "FSDPTrainEngine":
        """The kernel's factory: settings, allocation, scheduler and log
        directory from the run (docs/plugin-authoring.md, Train engines)."""
        sub = "fsdp-ranks" if context.role == "actor" else f"fsdp-ranks-{context.role}"
        return cls(
            context.settings,
            context.allocation,
            log_dir=os.path.join(context.run_dir, sub),
            scheduler=context.scheduler,
            run_config=context.config,
        )

    # ----------------------------------------------------------- properties
    @property
    def temperature(self) -> float:
        return self.config.temperature

    @property
    def step(self) -> int:
        return self._step

    def current_lr(self) -> float:
        return scheduled_lr(self.config, self._step, self.total_train_steps)

    # ---------------------------------------------------------- rank control
    def _get_scheduler(self) -> Any:
        """The scheduler that starts the ranks: the run's when the kernel gave
        one, else a new one (``scheduler.type`` of the run config, or ``local``
        with an actor allocation of this engine's shape)."""
        from areal_kernel.plugins import get_plugin_manager, get_registry

        if self._scheduler is not None:
            sched, name = self._scheduler, type(self._scheduler).__name__
        else:
            cfg = self.run_config
            if cfg is None:
                from areal_kernel.config.models import ExperimentConfig

                cfg = ExperimentConfig.model_validate({"actor": {"backend": str(self.allocation)}})
                name = "local"
            else:
                name = cfg.scheduler.type
                if name == "auto":
                    name = get_plugin_manager().hook.areal_select_scheduler(config=cfg) or "local"
            sched = get_registry().get("scheduler", name).load()(cfg)
            self._scheduler, self._owns_scheduler = sched, True
        if not hasattr(sched, "start_train_ranks"):
            raise ConfigError(
                f"scheduler.type: scheduler '{name}' cannot start train-engine ranks (it has no "
                "start_train_ranks); the fsdp engine needs one that does, e.g. 'local'"
            )
        return sched

    @property
    def _procs(self) -> list[Any]:
        """The rank processes (empty before ``initialize`` and after ``destroy``)."""
        return self._ranks.procs if self._ranks is not None else []

    def _start_ranks(self) -> None:
        # The kernel's rank plumbing (areal_kernel.engine.ranks) starts, drives and stops the ranks.
        plugin_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        group = RankGroup(
            "fsdp", "areal_fsdp.rank", self.world_size, self._get_scheduler(),
            self.log_dir or tempfile.mkdtemp(prefix="areal-fsdp-"), owns_scheduler=self._owns_scheduler,
            startup_timeout_s=self.config.startup_timeout_s, dist_timeout_s=self.config.dist_timeout_s,
            error_grace_s=_ERROR_GRACE_S, pythonpath=[plugin_root],
        )  # fmt: skip
        self.log_dir = group.log_dir
        group.start()
        self._ranks = group

    def _stop_ranks(self) -> None:
        if self._ranks is not None:
            self._ranks.stop()

    def _call(self, cmd: str, kwargs: dict[str, Any] | list[dict[str, Any]] | None = None) -> list[Any]:
        """Run ``cmd`` on every rank (``kwargs`` per rank when a list) and
        return the answers in rank order."""
        if self._ranks is None:
            raise ArealError("FSDPTrainEngine is not initialized: call initialize(model_path, total_train_steps)")
        return self._ranks.call(cmd, kwargs)

    # ---------------------------------------------------------------- setup
    def initialize(self, model_path: str, total_train_steps: int) -> None:
        if not os.path.isfile(os.path.join(model_path, "config.json")):
            raise ConfigError(
                f"model_path {model_path!r} is not an HF model directory (no config.json); "
                "pass a local directory written by save_pretrained"
            )
        if total_train_steps < 1:
            raise ConfigError(f"total_train_steps must be >= 1, got {total_train_steps}")
        if self._ranks is not None:
            raise ArealError("FSDPTrainEngine.initialize was already called")
        self._start_ranks()
        try:
            self._call("create", {"config": self.config.model_dump()})
            out = self._call("initialize", {"model_path": model_path, "total_train_steps": total_train_steps})
        except BaseException:
            self._stop_ranks()
            raise
        self._transfer_meta = out[0]["transfer_meta"]
        self._adapter_config = out[0].get("adapter_config")
        self.model_path = os.path.abspath(model_path)
        self.total_train_steps = int(total_train_steps)
        self._step = 0
        log.info("fsdp engine ready", ranks=self.world_size, logs=self.log_dir, wrapped_blocks=out[0]["wrapped_blocks"])

    # -------------------------------------------------------------- batching
    def _partition(self, batch: TrajectoryBatch) -> list[list[int]]:
        """Trajectory indices per rank, balanced by tokens (largest first onto
        the least-loaded rank). Whole groups stay on one rank when prompt
        sharing is on and there are at least as many groups as ranks."""
        trajs = batch.trajectories
        units: list[list[int]]
        if getattr(self.config, "share_prompts", False):
            by_group: dict[str, list[int]] = {}
            for i, t in enumerate(trajs):
                by_group.setdefault(t.group_id or f"__single_{i}", []).append(i)
            units = list(by_group.values())
            if len(units) < self.world_size:
                units = [[i] for i in range(len(trajs))]
        else:
            units = [[i] for i in range(len(trajs))]
        size = [sum(len(trajs[i].input_ids) for i in u) for u in units]
        order = sorted(range(len(units)), key=lambda k: (-size[k], units[k][0]))
        loads = [0] * self.world_size
        parts: list[list[int]] = [[] for _ in range(self.world_size)]
        for k in order:
            r = min(range(self.world_size), key=lambda j: (loads[j], j))
            parts[r].extend(units[k])
            loads[r] += size[k]
        return [sorted(p) for p in parts]

    @staticmethod
    def _sub(batch: TrajectoryBatch, idx: list[int]) -> TrajectoryBatch:
        return TrajectoryBatch([batch.trajectories[i] for i in idx])

    def _score(self, batch: TrajectoryBatch, only_loss_tokens: bool, with_entropy: bool) -> tuple[list, list | None]:
        check_batch(batch)
        parts = self._partition(batch)
        answers = self._call(
            "score_part",
            [
                {"part": self._sub(batch, p), "only_loss_tokens": only_loss_tokens, "with_entropy": with_entropy}
                for p in parts
            ],
        )
        lps: list[list[float]] = [[] for _ in range(len(batch))]
        ents: list[list[float]] = [[] for _ in range(len(batch))]
        for p, (lp, ent) in zip(parts, answers):
            for k, i in enumerate(p):
                lps[i] = lp[k]
                if with_entropy:
                    ents[i] = ent[k]
        return lps, (ents if with_entropy else None)

    def compute_logprobs(self, batch: TrajectoryBatch, only_loss_tokens: bool = False) -> list[list[float]]:
        """Per-token logprobs under the current weights (see ``TorchTrainEngine``)."""
        return self._score(batch, only_loss_tokens, False)[0]

    def compute_logprobs_and_entropy(self, batch: TrajectoryBatch) -> tuple[list[list[float]], list[list[float]]]:
        lps, ents = self._score(batch, False, True)
        return lps, ents  # type: ignore[return-value]

    def train_batch(
        self,
        batch: TrajectoryBatch,
        loss_fn: Callable[..., Any],
        extra: dict[str, list[list[float]]] | None = None,
    ) -> dict[str, float]:
        """One optimizer step over ``batch`` on all ranks; the loss contract and
        the returned keys are those of ``TorchTrainEngine.train_batch``. Sums
        (loss, stats, entropy) are reduced over ranks, ``*_max``/``*_min``
        stats by max/min; ``grad_norm`` is the global norm of the sharded
        gradients before clipping."""
        t0 = time.perf_counter()
        check_batch(batch, extra)
        trajs = batch.trajectories
        n_loss_tokens = count_loss_tokens(batch)
        parts = self._partition(batch)
        kwargs = [
            {
                "part": self._sub(batch, p),
                "global_index": p,
                "loss_fn": loss_fn,
                "extra": {k: [rows[i] for i in p] for k, rows in (extra or {}).items()},
                "batch_loss_tokens": n_loss_tokens,
                "batch_n_seqs": len(trajs),
            }
            for p in parts
        ]
        answers = self._call("train_part", kwargs)
        self._step += 1
        stats: dict[str, float] = {}
        for a in answers:
            merge_stats(stats, a["stats"])
        first = answers[0]
        out = dict(stats)
        out.update(
            loss=sum(a["loss"] for a in answers),
            grad_norm=first["grad_norm"],
            lr=first["lr"],
            skipped=first["skipped"],
            entropy=sum(a["entropy_sum"] for a in answers) / n_loss_tokens,
            n_seqs=float(len(trajs)),
            n_tokens=float(batch.n_tokens),
            n_loss_tokens=float(n_loss_tokens),
            n_mbs=sum(a["n_mbs"] for a in answers),
            n_model_tokens=sum(a["n_model_tokens"] for a in answers),
            n_ranks=float(self.world_size),
            step_time_s=time.perf_counter() - t0,
        )
        return out

    # --------------------------------------------------------------- weights
    def adapter_spec(self) -> AdapterSpec | None:
        """The LoRA adapter the ranks train (``actor.fsdp.lora``), or ``None``."""
        lora = self.config.lora
        if lora is None:
            return None
        self._require_init()
        return AdapterSpec(lora.name, dict(self._adapter_config or {}))

    def named_weights_for_transfer(self) -> list[tuple[str, Any]]:
        """``(HF name, tensor)`` in send order, as the single-process engine
        lists them, but as *meta* tensors (shape and dtype, no data): the
        weights live sharded in the ranks. Enough for ``tensor_meta`` and
        byte counts; the data travels with ``send_weights``."""
        import torch

        from areal_kernel.weights.broadcast import parse_dtype

        self._require_init()
        return [
            (m["name"], torch.empty(m["shape"], dtype=parse_dtype(m["dtype"]), device="meta"))
            for m in self._transfer_meta
        ]

    def weight_transfer_meta(self) -> list[dict[str, Any]]:
        self._require_init()
        return [dict(m) for m in self._transfer_meta]

    def full_weights(self) -> dict[str, Any]:
        """Gather every weight into this process (small models, tests)."""
        return dict(self._call("full_weights")[0])

    def _require_init(self) -> None:
        if self._ranks is None:
            raise ArealError("FSDPTrainEngine is not initialized: call initialize(model_path, total_train_steps)")

    def save_hf(self, path: str, max_shard_bytes: int | None = None) -> None:
        """Write an HF directory (config, safetensors in files of at most
        ``max_shard_bytes``, default ``export_shard_mb``, tokenizer files),
        atomically: rank 0 gathers and writes one file at a time into a
        temporary sibling that is renamed onto ``path`` once complete."""
        self._require_init()
        shard_bytes = int(max_shard_bytes or (self.config.export_shard_mb << 20))
        if shard_bytes <= 0:
            raise ConfigError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
        with atomic_dir(path) as tmp:
            # The controller's settings decide the LoRA export form (adapter or merged).
            lora_export = self.config.lora.export if self.config.lora is not None else None
            self._call("export_hf", {"tmp_dir": tmp, "shard_bytes": shard_bytes, "lora_export": lora_export})

    def init_weight_group(
        self,
        master_addr: str,
        master_port: int,
        world_size: int,
        rank: int = 0,
        group_name: str = "areal_weights",
        backend: str | None = None,
        timeout_s: float = 300,
    ) -> None:
        """Rank 0 joins the weight-broadcast group as the sender (the servers
        are ranks 1..n); the other ranks only help gather."""
        self._call(
            "init_weight_group",
            dict(master_addr=master_addr, master_port=master_port, world_size=world_size, rank=rank,
                 group_name=group_name, backend=backend, timeout_s=timeout_s),
        )  # fmt: skip

    def send_weights(self, meta: WeightUpdateMeta) -> None:
        self._require_init()
        if meta.kind == "disk":
            if not meta.path:
                raise ConfigError("WeightUpdateMeta.path is required for kind='disk'")
            if self.config.lora is not None:
                # The adapter alone: what the servers load beside their base weights.
                with atomic_dir(meta.path) as tmp:
                    self._call("write_adapter", {"tmp_dir": tmp})
            else:
                self.save_hf(meta.path)
        elif meta.kind == "broadcast":
            if "group" in meta.extra:
                raise ConfigError(
                    "WeightUpdateMeta.extra['group'] cannot be used with the fsdp engine (the group lives in "
                    "rank 0's process): call engine.init_weight_group(...) instead"
                )
            self._call("broadcast_weights", {"bucket_bytes": meta.bucket_bytes})
        else:
            raise ConfigError(f"WeightUpdateMeta.kind={meta.kind!r} is not supported; valid: 'disk', 'broadcast'")

    # ------------------------------------------------------------ checkpoint
    def save_state(self, path: str) -> None:
        """Model and optimizer as a ``torch.distributed.checkpoint`` (each rank
        writes its shards), per-rank RNG states, and the step/version in
        ``engine_state.json``; written atomically."""
        self._require_init()
        with atomic_dir(path) as tmp:
            self._call("dcp_save", {"tmp_dir": tmp})
            write_engine_state(tmp, "fsdp", {
                "step": self._step,
                "version": self.get_version(),
                "total_train_steps": self.total_train_steps,
                "world_size": self.world_size,
                "param_names": [m["name"] for m in self._transfer_meta],
                "config": self.config.model_dump(),
            })  # fmt: skip

    def load_state(self, path: str) -> None:
        """Restore what ``save_state`` wrote (any rank count: DCP reshards)."""
        self._require_init()
        meta = read_engine_state(path, "fsdp")
        check_param_names(path, meta["param_names"], [m["name"] for m in self._transfer_meta])
        self._call("dcp_load", {"path": os.path.abspath(path), "step": int(meta["step"])})
        self._step = int(meta["step"])
        self.set_version(int(meta["version"]))

    def destroy(self) -> None:
        """Stop the rank processes (politely first, then their process groups)."""
        if self._ranks is not None:
            self._ranks.shutdown()

    def __del__(self) -> None:  # last resort: never leave ranks behind
        try:
            if self._ranks is not None and self._ranks.procs:
                self._ranks.stop()
        except Exception:  # noqa: BLE001
            pass
