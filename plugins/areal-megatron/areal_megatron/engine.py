"""``MegatronTrainEngine``: the controller-side face of d x t x p Megatron ranks.

It implements the kernel's ``TrainEngine`` in the controller process (which
never holds the model) and drives the ranks (``areal_megatron.rank``) through
the kernel's rank plumbing (``areal_kernel.engine.ranks.RankGroup``).

Data parallelism: a batch is split into ``d`` parts balanced by tokens; every
rank receives all parts and keeps its replica's (the tensor and pipeline
ranks of a replica see the same data). Losses follow the kernel's loss
contract (each micro-batch returns its share of the *batch* loss) and the
ranks sum gradients over replicas, so a step equals the single-process step
whatever the layout. One rank per replica (last pipeline stage, tensor rank
0) reports losses, stats and scores.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from areal_kernel.api.engine import TrainEngine, TrainEngineContext, WeightUpdateMeta
from areal_kernel.api.io import TrajectoryBatch
from areal_kernel.config.allocation import Allocation
from areal_kernel.engine.lr_schedule import scheduled_lr
from areal_kernel.engine.microbatch import check_batch, count_loss_tokens, merge_stats
from areal_kernel.engine.ranks import RankGroup
from areal_kernel.engine.state import check_param_names, read_engine_state, write_engine_state
from areal_kernel.errors import ArealError, ConfigError
from areal_kernel.logging import get_logger
from areal_kernel.utils.fs import atomic_dir

from areal_megatron.config import MegatronEngineConfig
from areal_megatron.layout import Layout, layout_of

log = get_logger(__name__)


class MegatronTrainEngine(TrainEngine):
    """Megatron-Core train engine over ``d*t*p`` rank processes.

    Built by the kernel with ``from_context`` (allocation ``megatron:d2t2p1``,
    the run's scheduler, logs in ``<run_dir>/megatron-ranks``); built directly
    (tests, scripts) ``allocation`` is a string or an ``Allocation`` and a
    ``local`` scheduler of its own starts the ranks.
    """

    def __init__(
        self,
        config: MegatronEngineConfig | dict[str, Any] | None = None,
        allocation: Allocation | str | None = None,
        *,
        log_dir: str | None = None,
        scheduler: Any = None,
        run_config: Any = None,
        ranks: RankGroup | None = None,
    ) -> None:
        self.config = MegatronEngineConfig.parse(config)
        self.layout: Layout = layout_of(allocation if allocation is not None else "megatron")
        self.world_size = self.layout.world_size
        self.log_dir = log_dir
        self.run_config = run_config
        self.model_path: str | None = None
        self.total_train_steps = 0
        self._step = 0
        self._transfer_meta: list[dict[str, Any]] = []
        self._reporters: dict[int, int] = {}  # data-parallel rank -> reporting global rank
        self._scheduler = scheduler
        self._ranks: RankGroup | None = None
        # Started rank processes to build on instead of starting new ones
        # (``detach_ranks`` of an engine of the same world size): the ranks
        # drop their old model and re-initialise Megatron's parallel state.
        self._reuse = ranks
        if ranks is not None and ranks.world_size != self.world_size:
            raise ConfigError(f"ranks: {ranks.world_size} rank processes cannot run {self.layout}")

    @classmethod
    def from_context(cls, context: TrainEngineContext) -> "MegatronTrainEngine":
        sub = "megatron-ranks" if context.role == "actor" else f"megatron-ranks-{context.role}"
        return cls(
            context.settings,
            context.allocation,
            log_dir=os.path.join(context.run_dir, sub),
            scheduler=context.scheduler,
            run_config=context.config,
        )

    @property
    def temperature(self) -> float:
        return self.config.temperature

    @property
    def step(self) -> int:
        return self._step

    def current_lr(self) -> float:
        return scheduled_lr(self.config, self._step, self.total_train_steps)

    # ---------------------------------------------------------------- ranks
    def _make_group(self) -> RankGroup:
        from areal_kernel.plugins import get_plugin_manager, get_registry

        owns = False
        sched = self._scheduler
        name = type(sched).__name__
        if sched is None:
            cfg = self.run_config
            if cfg is None:
                from areal_kernel.config.models import ExperimentConfig

                cfg = ExperimentConfig.model_validate({"actor": {"backend": f"megatron:d{self.world_size}"}})
                name = "local"
            else:
                name = cfg.scheduler.type
                if name == "auto":
                    name = get_plugin_manager().hook.areal_select_scheduler(config=cfg) or "local"
            sched = get_registry().get("scheduler", name).load()(cfg)
            owns = True
        if not hasattr(sched, "start_train_ranks"):
            raise ConfigError(
                f"scheduler.type: scheduler '{name}' cannot start train-engine ranks (it has no start_train_ranks); "
                "the megatron engine needs one that does, e.g. 'local'"
            )
        plugin_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return RankGroup(
            "megatron", "areal_megatron.rank", self.world_size, sched, self.log_dir, owns_scheduler=owns,
            startup_timeout_s=self.config.startup_timeout_s, dist_timeout_s=self.config.dist_timeout_s,
            pythonpath=[plugin_root],
        )  # fmt: skip

    def _call(self, cmd: str, kwargs: dict[str, Any] | None = None) -> list[Any]:
        if self._ranks is None:
            raise ArealError("MegatronTrainEngine is not initialized: call initialize(model_path, total_train_steps)")
        return self._ranks.call(cmd, kwargs)

    def initialize(self, model_path: str, total_train_steps: int) -> None:
        if not os.path.isfile(os.path.join(model_path, "config.json")):
            raise ConfigError(
                f"model_path {model_path!r} is not an HF model directory (no config.json); "
                "pass a local directory written by save_pretrained"
            )
        if total_train_steps < 1:
            raise ConfigError(f"total_train_steps must be >= 1, got {total_train_steps}")
        if self._ranks is not None:
            raise ArealError("MegatronTrainEngine.initialize was already called")
        group = self._reuse or self._make_group()
        if not group.started:
            group.start()
        self._ranks = group
        self.log_dir = group.log_dir
        try:
            self._call("create", {"config": self.config.model_dump(), "tp": self.layout.tp, "pp": self.layout.pp})
            out = self._call("initialize", {"model_path": model_path, "total_train_steps": total_train_steps})
        except BaseException:
            group.shutdown()
            self._ranks = None
            raise
        self._transfer_meta = out[0]["transfer_meta"]
        self._reporters = {o["dp_rank"]: r for r, o in enumerate(out) if o["reporter"]}
        self.model_path = os.path.abspath(model_path)
        self.total_train_steps = int(total_train_steps)
        self._step = 0
        log.info("megatron engine ready", layout=str(self.layout), logs=self.log_dir)

    # -------------------------------------------------------------- batching
    def _partition(self, batch: TrajectoryBatch) -> list[list[int]]:
        """Trajectory indices per data-parallel replica, balanced by tokens
        (largest first onto the least-loaded replica). A replica may get
        none (a batch smaller than ``d``): it then adds zero gradients."""
        trajs = batch.trajectories
        d = self.layout.dp
        order = sorted(range(len(trajs)), key=lambda i: (-len(trajs[i].input_ids), i))
        loads = [0] * d
        parts: list[list[int]] = [[] for _ in range(d)]
        for i in order:
            r = min(range(d), key=lambda j: (loads[j], j))
            parts[r].append(i)
            loads[r] += len(trajs[i].input_ids)
        return [sorted(p) for p in parts]

    @staticmethod
    def _sub(batch: TrajectoryBatch, idx: list[int]) -> TrajectoryBatch:
        return TrajectoryBatch([batch.trajectories[i] for i in idx])

    def _score(self, batch: TrajectoryBatch, only_loss_tokens: bool, with_entropy: bool) -> tuple[list, list]:
        check_batch(batch)
        parts = self._partition(batch)
        answers = self._call(
            "score_part",
            {"parts": [self._sub(batch, p) for p in parts], "only_loss_tokens": only_loss_tokens,
             "with_entropy": with_entropy},
        )  # fmt: skip
        lps: list[list[float]] = [[] for _ in range(len(batch))]
        ents: list[list[float]] = [[] for _ in range(len(batch))]
        for d, p in enumerate(parts):
            lp, ent = answers[self._reporters[d]]
            for k, i in enumerate(p):
                lps[i] = lp[k]
                if with_entropy:
                    ents[i] = ent[k]
        return lps, ents

    def compute_logprobs(self, batch: TrajectoryBatch, only_loss_tokens: bool = False) -> list[list[float]]:
        """Per-token logprobs under the current weights (see ``TorchTrainEngine``)."""
        return self._score(batch, only_loss_tokens, False)[0]

    def compute_logprobs_and_entropy(self, batch: TrajectoryBatch) -> tuple[list[list[float]], list[list[float]]]:
        return self._score(batch, False, True)

    def train_batch(
        self,
        batch: TrajectoryBatch,
        loss_fn: Callable[..., Any],
        extra: dict[str, list[list[float]]] | None = None,
    ) -> dict[str, float]:
        """One optimizer step over ``batch``; loss contract and returned keys
        as ``TorchTrainEngine.train_batch`` (``grad_norm``: the global norm
        over every shard before clipping)."""
        t0 = time.perf_counter()
        check_batch(batch, extra)
        n_loss_tokens = count_loss_tokens(batch)
        parts = self._partition(batch)
        answers = self._call(
            "train_part",
            {
                "parts": [self._sub(batch, p) for p in parts],
                "global_index": parts,
                "loss_fn": loss_fn,
                "extra": [{k: [rows[i] for i in p] for k, rows in (extra or {}).items()} for p in parts],
                "batch_loss_tokens": n_loss_tokens,
                "batch_n_seqs": len(batch),
            },
        )
        self._step += 1
        rep = [answers[self._reporters[d]] for d in range(self.layout.dp)]
        stats: dict[str, float] = {}
        for a in rep:
            merge_stats(stats, a["stats"])
        out = dict(stats)
        out.update(
            loss=sum(a["loss"] for a in rep),
            grad_norm=rep[0]["grad_norm"],
            lr=rep[0]["lr"],
            skipped=rep[0]["skipped"],
            entropy=sum(a["entropy_sum"] for a in rep) / n_loss_tokens,
            n_seqs=float(len(batch)),
            n_tokens=float(batch.n_tokens),
            n_loss_tokens=float(n_loss_tokens),
            n_mbs=sum(a["n_mbs"] for a in rep),
            n_model_tokens=sum(a["n_model_tokens"] for a in rep),
            n_ranks=float(self.world_size),
            step_time_s=time.perf_counter() - t0,
        )
        return out

    # --------------------------------------------------------------- weights
    def _require_init(self) -> None:
        if self._ranks is None:
            raise ArealError("MegatronTrainEngine is not initialized: call initialize(model_path, total_train_steps)")

    def named_weights_for_transfer(self) -> list[tuple[str, Any]]:
        """``(HF name, meta tensor)`` in send order: the weights live in the ranks."""
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
        """Every weight as HF tensors in this process (small models, tests)."""
        return dict(self._call("full_weights")[0])

    def save_hf(self, path: str, max_shard_bytes: int | None = None) -> None:
        """An HF directory (config, safetensors files of at most
        ``max_shard_bytes``, default ``export_shard_mb``, tokenizer files),
        written atomically; the Megatron shards are converted back to HF."""
        self._require_init()
        shard_bytes = int(max_shard_bytes or (self.config.export_shard_mb << 20))
        if shard_bytes <= 0:
            raise ConfigError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
        with atomic_dir(path) as tmp:
            self._call("export_hf", {"tmp_dir": tmp, "shard_bytes": shard_bytes})

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
        """Rank 0 joins the weight-broadcast group as the sender; the other
        ranks gather their shards towards it."""
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
            self.save_hf(meta.path)
        elif meta.kind == "broadcast":
            if "group" in meta.extra:
                raise ConfigError(
                    "WeightUpdateMeta.extra['group'] cannot be used with the megatron engine (the group lives in "
                    "rank 0's process): call engine.init_weight_group(...) instead"
                )
            self._call("broadcast_weights", {"bucket_bytes": meta.bucket_bytes})
        else:
            raise ConfigError(f"WeightUpdateMeta.kind={meta.kind!r} is not supported; valid: 'disk', 'broadcast'")

    # ------------------------------------------------------------ checkpoint
    def save_state(self, path: str) -> None:
        """Model through megatron-core's ``dist_checkpointing`` (each rank
        writes its shards), optimizer and RNG per rank, step/version in
        ``engine_state.json``; written atomically."""
        self._require_init()
        with atomic_dir(path) as tmp:
            self._call("dist_save", {"tmp_dir": tmp})
            write_engine_state(tmp, "megatron", {
                "step": self._step,
                "version": self.get_version(),
                "total_train_steps": self.total_train_steps,
                "layout": str(self.layout),
                "param_names": [m["name"] for m in self._transfer_meta],
                "config": self.config.model_dump(),
            })  # fmt: skip

    def load_state(self, path: str) -> None:
        """Restore what ``save_state`` wrote (same t and p layout for the optimizer)."""
        self._require_init()
        meta = read_engine_state(path, "megatron")
        check_param_names(path, meta["param_names"], [m["name"] for m in self._transfer_meta])
        self._call("dist_load", {"path": os.path.abspath(path), "step": int(meta["step"])})
        self._step = int(meta["step"])
        self.set_version(int(meta["version"]))

    def detach_ranks(self) -> RankGroup:
        """Hand the running rank processes over (to ``MegatronTrainEngine(...,
        ranks=...)`` of another layout with the same world size): this
        engine's model is dropped and the engine is unusable afterwards.
        Saves the processes' start-up (imports) when several layouts run in
        a row, as the parity tests do."""
        self._require_init()
        assert self._ranks is not None
        self._call("destroy")
        group, self._ranks = self._ranks, None
        return group

    def destroy(self) -> None:
        """Stop the rank processes (politely first, then their process groups)."""
        if self._ranks is not None:
            self._ranks.shutdown()
            self._ranks = None

    def __del__(self) -> None:  # last resort: never leave ranks behind
        try:
            if self._ranks is not None:
                self._ranks.stop()
        except Exception:  # noqa: BLE001
            pass
