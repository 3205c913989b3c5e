"""``RankedTrainEngine``: a train engine whose model lives in rank processes.

A distributed engine is two halves: rank processes that hold the model (a
rank module whose ``main`` is ``areal_kernel.engine.ranks.rank_main``) and a
controller-side object, the ``TrainEngine`` the trainer calls. The
controller half is the same whatever the parallelism: pick the scheduler
that starts the ranks, start them as a ``RankGroup``, split each batch into
token-balanced data-parallel parts, send the parts out, put the answers back
in batch order, merge the training statistics, and forward weight export,
broadcast and checkpoint commands. This class is that half, once; a plugin
subclass names its rank module and fills in a few typed hooks where its
parallelism really differs (how parts reach the ranks, what ``create``
receives, what it keeps from ``initialize``).

The rank side answers these commands (the rank engine's methods of that
name, see ``rank_main``): ``create`` (with ``create_kwargs()``),
``initialize(model_path, total_train_steps)`` returning a dict with at least
``transfer_meta`` (rank 0's is kept: the HF weight list in send order, each
``{"name", "shape", "dtype"}``), ``score_part`` and ``train_part`` (the
arguments ``call_parts`` sends), ``export_hf(tmp_dir, shard_bytes,
**export_options())``, ``full_weights``, ``init_weight_group``,
``broadcast_weights(bucket_bytes)``, the two checkpoint commands named by
``save_state_command`` / ``load_state_command``, and ``destroy`` (only for
``detach_ranks``).

This module imports no torch at module level: ``import areal_kernel`` stays
light, and the controller needs torch only for meta tensors.
"""

from __future__ import annotations

import importlib
import os
import time
from typing import Any, Callable, ClassVar, Protocol

from areal_kernel.api.engine import TrainEngine, TrainEngineContext, WeightUpdateMeta
from areal_kernel.api.io import TrajectoryBatch
from areal_kernel.engine.lr_schedule import scheduled_lr
from areal_kernel.engine.microbatch import check_batch, count_loss_tokens, merge_stats
from areal_kernel.engine.ranks import RankGroup
from areal_kernel.engine.state import check_param_names, read_engine_state, write_engine_state
from areal_kernel.errors import ArealError, ConfigError
from areal_kernel.utils.fs import atomic_dir

__all__ = ["RankedEngineSettings", "RankedTrainEngine"]


class RankedEngineSettings(Protocol):
    """What ``RankedTrainEngine`` reads from the engine's settings section: the
    ``TorchEngineConfig`` fields (lr schedule, ``temperature``,
    ``share_prompts``) plus the three rank fields a plugin section adds."""

    temperature: float
    share_prompts: bool
    startup_timeout_s: float  # how long the ranks may take to start and connect
    dist_timeout_s: float  # timeout of collectives between ranks
    export_shard_mb: int  # HF export: the default size limit of one safetensors file

    def model_dump(self) -> dict[str, Any]: ...


class RankedTrainEngine(TrainEngine):
    """Controller side of a train engine over ``world_size`` rank processes.

    Subclass contract: set the class attributes ``engine_name`` (in messages,
    the rank log directory ``<run_dir>/<engine_name>-ranks`` and the
    ``engine_state.json`` kind), ``rank_module`` (``python -m`` target on
    every rank), ``save_state_command`` and ``load_state_command``, and call ``super().__init__`` with the parsed settings and
    the world size. ``from_context`` builds the subclass as
    ``cls(settings, allocation, log_dir=..., scheduler=..., run_config=...)``,
    so a subclass constructor takes that shape.

    Built by the kernel, the run's scheduler starts the ranks and is never
    stopped here (the run owns it). Built directly (tests, scripts) the
    engine makes a scheduler of its own (``run_config.scheduler.type``, the
    ``areal_select_scheduler`` hook for ``auto``, else ``local``) and stops
    it with the ranks.
    """

    engine_name: ClassVar[str]
    rank_module: ClassVar[str]
    # After one rank failed, how long the others get to answer before the
    # group counts them as stuck in a collective and stops every rank.
    error_grace_s: ClassVar[float] = 20.0
    # Rank commands that write (``tmp_dir=``) and read (``path=``, ``step=``)
    # a checkpoint's model, optimizer and RNG shards.
    save_state_command: ClassVar[str]
    load_state_command: ClassVar[str]
    # The rank module answers ``weight_sample(positions)`` (rank 0: the
    # sampled elements of the full HF tensors), for the weight-delivery check.
    rank_weight_sample: ClassVar[bool] = False

    config: RankedEngineSettings

    def __init__(
        self,
        config: RankedEngineSettings,
        world_size: int,
        *,
        log_dir: str | None = None,
        scheduler: Any = None,
        run_config: Any = None,
        ranks: RankGroup | None = None,
    ) -> None:
        self.config = config
        self.world_size = int(world_size)
        self.log_dir = log_dir
        self.run_config = run_config  # the run's ExperimentConfig (scheduler choice) when built by the kernel
        self.model_path: str | None = None
        self.total_train_steps = 0
        self._step = 0
        self._transfer_meta: list[dict[str, Any]] = []
        # The run's scheduler is used, never stopped; one made here is this
        # engine's own and is stopped with the ranks.
        self._scheduler: Any = scheduler
        self._owns_scheduler = False
        self._ranks: RankGroup | None = None
        # Started rank processes to build on instead of starting new ones
        # (``detach_ranks`` of another engine): saves the ranks' start-up.
        self._reuse = ranks

    @classmethod
    def from_context(cls, context: TrainEngineContext) -> "RankedTrainEngine":
        """The kernel's factory: settings, allocation, scheduler and the rank
        log directory ``<run_dir>/<engine_name>-ranks`` (``-<role>`` appended
        for a model other than the actor, e.g. the reference model)."""
        sub = f"{cls.engine_name}-ranks" if context.role == "actor" else f"{cls.engine_name}-ranks-{context.role}"
        # Subclasses take (settings, allocation, *, log_dir, scheduler, run_config), not this
        # base's (settings, world_size): see the class docstring.
        factory: Callable[..., RankedTrainEngine] = cls
        return factory(
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
        """Optimizer steps taken (restored by ``load_state``)."""
        return self._step

    def current_lr(self) -> float:
        return scheduled_lr(self.config, self._step, self.total_train_steps)

    def policy_state(self) -> dict[str, Any]:
        """What the one-policy calls read and advance: ``settings``, the
        weight list the ranks send (``transfer_meta``), ``step`` and
        ``version``. A subclass whose ranks hold several policies (one
        adapter each) wears one policy's state for the length of a call
        with ``set_policy_state`` and takes the advanced state back after."""
        return {
            "settings": self.config,
            "transfer_meta": self._transfer_meta,
            "step": self._step,
            "version": self.get_version(),
        }

    def set_policy_state(self, state: dict[str, Any]) -> None:
        """Wear ``state`` (as ``policy_state`` returns it)."""
        self.config = state["settings"]
        self._transfer_meta = state["transfer_meta"]
        self._step = int(state["step"])
        self.set_version(int(state["version"]))

    @property
    def ranks(self) -> RankGroup | None:
        """The running rank group (``None`` before ``initialize`` and after
        ``destroy`` / ``detach_ranks``)."""
        return self._ranks

    @property
    def owns_scheduler(self) -> bool:
        """Whether the scheduler that starts the ranks was made by this engine
        (and is stopped with them)."""
        return self._owns_scheduler

    @property
    def data_parallel_size(self) -> int:
        """How many parts a batch is split into. Default: one per rank; an
        engine with model parallelism overrides it (and ``call_parts``)."""
        return self.world_size

    # ---------------------------------------------------------- rank control
    def rank_scheduler(self) -> Any:
        """The scheduler that starts the ranks: the run's when the kernel gave
        one, else a new one (``scheduler.type`` of the run config, or
        ``local`` for an actor of this engine's rank count). ``ConfigError``
        when it cannot start train ranks."""
        from areal_kernel.plugins import get_plugin_manager, get_registry

        if self._scheduler is not None:
            sched, name = self._scheduler, type(self._scheduler).__name__
        else:
            from areal_kernel.api.scheduler import ACTOR, ROLLOUT, SchedulerContext

            cfg = self.run_config
            roles: tuple[str, ...]
            if cfg is None:
                from areal_kernel.config.loader import validate_config

                actor = {"backend": f"{self.engine_name}:d{self.world_size}"}
                cfg = validate_config({"actor": actor}, "the engine's own scheduler config", get_registry())
                # Without a run, no inference server is started: place the ranks alone.
                name, roles = "local", (ACTOR,)
            else:
                name, roles = cfg.scheduler.type, (ACTOR, ROLLOUT)
                if name == "auto":
                    name = get_plugin_manager().hook.areal_select_scheduler(config=cfg) or "local"
            sched = get_registry().build("scheduler", name, SchedulerContext(name=name, config=cfg, roles=roles))
            self._scheduler, self._owns_scheduler = sched, True
        if not hasattr(sched, "start_train_ranks"):
            raise ConfigError(
                f"scheduler.type: scheduler '{name}' cannot start train-engine ranks (it has no "
                f"start_train_ranks); the {self.engine_name} engine needs one that does, e.g. 'local'"
            )
        return sched

    def rank_pythonpath(self) -> list[str]:
        """Directories put first on the ranks' ``PYTHONPATH``: by default the
        directory holding ``rank_module``'s top-level package, so the ranks
        import the same plugin copy as the controller (a source checkout
        that is not installed included)."""
        top = importlib.import_module(self.rank_module.partition(".")[0])
        if top.__file__ is None:  # a namespace package: nothing to pin
            return []
        return [os.path.dirname(os.path.dirname(os.path.abspath(top.__file__)))]

    def make_rank_group(self) -> RankGroup:
        """A new (not yet started) ``RankGroup`` for this engine's ranks."""
        sched = self.rank_scheduler()
        return RankGroup(
            self.engine_name, self.rank_module, self.world_size, sched, self.log_dir,
            owns_scheduler=self._owns_scheduler, startup_timeout_s=self.config.startup_timeout_s,
            dist_timeout_s=self.config.dist_timeout_s, error_grace_s=self.error_grace_s,
            pythonpath=self.rank_pythonpath(),
        )  # fmt: skip

    def require_initialized(self) -> None:
        """``ArealError`` unless ``initialize`` started the ranks."""
        if self._ranks is None:
            raise ArealError(
                f"{type(self).__name__} is not initialized: call initialize(model_path, total_train_steps)"
            )

    def call_ranks(self, cmd: str, kwargs: dict[str, Any] | list[dict[str, Any]] | None = None) -> list[Any]:
        """Run ``cmd`` on every rank (``kwargs`` per rank when a list) and
        return the answers in rank order (``RankGroup.call``)."""
        self.require_initialized()
        assert self._ranks is not None
        return self._ranks.call(cmd, kwargs)

    # ------------------------------------------------------- subclass hooks
    def create_kwargs(self) -> dict[str, Any]:
        """Arguments of the ranks' ``create`` command (the rank module's
        ``make_engine``). Default: the settings as a dict."""
        return {"config": self.config.model_dump()}

    def on_initialized(self, answers: list[Any]) -> None:
        """Called once the ranks answered ``initialize`` (answers in rank
        order): keep what the engine needs from them. Default: nothing."""

    def call_parts(
        self,
        cmd: str,
        parts: list[TrajectoryBatch],
        per_part: list[dict[str, Any]],
        common: dict[str, Any],
    ) -> list[Any]:
        """Send the data-parallel ``parts`` with ``cmd`` and return one answer
        per part. ``per_part[i]`` holds the arguments that belong to part
        ``i`` (``global_index``, ``extra``), ``common`` those of the whole
        batch. Default (one part per rank): rank ``i`` gets ``part=parts[i]``,
        ``**per_part[i]`` and ``**common``."""
        return self.call_ranks(cmd, [{"part": p, **kw, **common} for p, kw in zip(parts, per_part)])

    def export_options(self) -> dict[str, Any]:
        """Extra arguments of the ranks' ``export_hf`` command. Default: none."""
        return {}

    def write_disk_weights(self, path: str) -> None:
        """What ``send_weights(kind='disk')`` writes at ``path``. Default: the
        full HF directory (``save_hf``)."""
        self.save_hf(path)

    def state_meta(self) -> dict[str, Any]:
        """Extra ``engine_state.json`` entries describing the rank layout the
        checkpoint was written with. Default: ``world_size``."""
        return {"world_size": self.world_size}

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
            raise ArealError(f"{type(self).__name__}.initialize was already called")
        group, self._reuse = self._reuse or self.make_rank_group(), None
        if not group.started:
            group.start()
        self._ranks = group
        self.log_dir = group.log_dir
        try:
            self.call_ranks("create", self.create_kwargs())
            out = self.call_ranks("initialize", {"model_path": model_path, "total_train_steps": total_train_steps})
        except BaseException:
            # No half-built engine: the ranks go, and initialize may be retried.
            group.shutdown()
            self._ranks = None
            raise
        self._transfer_meta = out[0]["transfer_meta"]
        self.model_path = os.path.abspath(model_path)
        self.total_train_steps = int(total_train_steps)
        self._step = 0
        self.on_initialized(out)

    # -------------------------------------------------------------- batching
    def partition(self, batch: TrajectoryBatch) -> list[list[int]]:
        """Trajectory indices per data-parallel part, balanced by tokens
        (largest first onto the least-loaded part; a part may be empty when
        the batch is smaller than ``data_parallel_size``, it then adds zero
        gradients). Whole groups stay in one part when prompt sharing is on
        and there are at least as many groups as parts (a shared prompt is
        only shared within a part)."""
        trajs = batch.trajectories
        n = self.data_parallel_size
        units: list[list[int]] = [[i] for i in range(len(trajs))]
        if self.config.share_prompts:
            by_group: dict[str, list[int]] = {}
            for i, t in enumerate(trajs):
                by_group.setdefault(t.group_id or f"__single_{i}", []).append(i)
            if len(by_group) >= n:
                units = list(by_group.values())
        size = [sum(len(trajs[i].input_ids) for i in u) for u in units]
        order = sorted(range(len(units)), key=lambda k: (-size[k], units[k][0]))
        loads = [0] * n
        parts: list[list[int]] = [[] for _ in range(n)]
        for k in order:
            r = min(range(n), key=lambda j: (loads[j], j))
            parts[r].extend(units[k])
            loads[r] += size[k]
        return [sorted(p) for p in parts]

    @staticmethod
    def _sub(batch: TrajectoryBatch, idx: list[int]) -> TrajectoryBatch:
        return TrajectoryBatch([batch.trajectories[i] for i in idx])

    def score_parts(
        self, batch: TrajectoryBatch, only_loss_tokens: bool, with_entropy: bool, cmd: str = "score_part"
    ) -> tuple[list[list[float]], list[list[float]]]:
        """Score ``batch`` in data-parallel parts with the ranks' ``cmd``
        (``score_part``, or a subclass's scoring command taking the same
        arguments, e.g. the base with its adapters off) and put the logprobs
        (and entropies, with ``with_entropy``) back in batch order."""
        check_batch(batch)
        parts = self.partition(batch)
        answers = self.call_parts(
            cmd,
            [self._sub(batch, p) for p in parts],
            [{} for _ in parts],
            {"only_loss_tokens": only_loss_tokens, "with_entropy": with_entropy},
        )
        lps: list[list[float]] = [[] for _ in range(len(batch))]
        ents: list[list[float]] = [[] for _ in range(len(batch))]
        for p, (lp, ent) in zip(parts, answers):
            for k, i in enumerate(p):
                lps[i] = lp[k]
                if with_entropy:
                    ents[i] = ent[k]
        return lps, ents

    def compute_logprobs(self, batch: TrajectoryBatch, only_loss_tokens: bool = False) -> list[list[float]]:
        """Per-token logprobs under the current weights (see ``TorchTrainEngine``)."""
        return self.score_parts(batch, only_loss_tokens, False)[0]

    def compute_logprobs_and_entropy(self, batch: TrajectoryBatch) -> tuple[list[list[float]], list[list[float]]]:
        return self.score_parts(batch, False, True)

    def train_batch(
        self,
        batch: TrajectoryBatch,
        loss_fn: Callable[..., Any],
        extra: dict[str, list[list[float]]] | None = None,
    ) -> dict[str, float]:
        """One optimizer step over ``batch`` on all ranks; the loss contract and
        the returned keys are those of ``TorchTrainEngine.train_batch``. Sums
        (loss, stats, entropy) are reduced over the parts, ``*_max``/``*_min``
        stats by max/min; ``grad_norm`` is the global norm over every shard
        before clipping."""
        t0 = time.perf_counter()
        check_batch(batch, extra)
        n_loss_tokens = count_loss_tokens(batch)
        subs, per_part = self.part_arguments(batch, extra, self.partition(batch))
        answers = self.call_parts(
            "train_part", subs, per_part,
            {"loss_fn": loss_fn, "batch_loss_tokens": n_loss_tokens, "batch_n_seqs": len(batch)},
        )  # fmt: skip
        self._step += 1
        return self.merge_step_answers(answers, batch, n_loss_tokens, time.perf_counter() - t0)

    def part_arguments(
        self, batch: TrajectoryBatch, extra: dict[str, list[list[float]]] | None, parts: list[list[int]]
    ) -> tuple[list[TrajectoryBatch], list[dict[str, Any]]]:
        """Each data-parallel part of ``batch`` (trajectory indices, from
        ``partition``) and what belongs to it alone: ``global_index`` and its
        rows of ``extra``, as a rank's training command takes them."""
        subs = [self._sub(batch, p) for p in parts]
        per_part = [
            {"global_index": p, "extra": {k: [rows[i] for i in p] for k, rows in (extra or {}).items()}} for p in parts
        ]
        return subs, per_part

    def merge_step_answers(
        self, answers: list[dict[str, Any]], batch: TrajectoryBatch, n_loss_tokens: int, step_time_s: float
    ) -> dict[str, float]:
        """``train_batch``'s statistics from the ranks' answers for one
        optimizer step over ``batch``: each answer holds ``loss``,
        ``entropy_sum``, ``stats`` (the loss_fn's, summed over its
        micro-batches), ``grad_norm``, ``lr``, ``skipped`` (the same on every
        rank), ``n_mbs`` and ``n_model_tokens``. Sums are added over the
        ranks, ``*_max``/``*_min`` stats taken by max/min."""
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
            n_seqs=float(len(batch)),
            n_tokens=float(batch.n_tokens),
            n_loss_tokens=float(n_loss_tokens),
            n_mbs=sum(a["n_mbs"] for a in answers),
            n_model_tokens=sum(a["n_model_tokens"] for a in answers),
            n_ranks=float(self.world_size),
            step_time_s=step_time_s,
        )
        return out

    # --------------------------------------------------------------- weights
    def named_weights_for_transfer(self) -> list[tuple[str, Any]]:
        """``(HF name, tensor)`` in send order, as *meta* tensors (shape and
        dtype, no data): the weights live in the ranks. Enough for
        ``tensor_meta`` and byte counts; the data travels with
        ``send_weights``."""
        import torch

        from areal_kernel.weights.broadcast import parse_dtype

        self.require_initialized()
        return [
            (m["name"], torch.empty(m["shape"], dtype=parse_dtype(m["dtype"]), device="meta"))
            for m in self._transfer_meta
        ]

    def weight_transfer_meta(self) -> list[dict[str, Any]]:
        """The transfer list as ``{"name", "shape", "dtype"}`` dicts (copies)."""
        self.require_initialized()
        return [dict(m) for m in self._transfer_meta]

    def weight_sample(self, positions: dict[str, list[int]]) -> dict[str, Any]:
        """The weight-delivery check's sample, taken in the ranks (the rank
        module's ``weight_sample`` command: rank 0 answers with the sampled
        elements of the full HF tensors; the others help gather). A rank
        module without the command (``rank_weight_sample`` false) makes the
        check skip itself with a note."""
        self.require_initialized()
        if not self.rank_weight_sample:
            raise NotImplementedError(f"the {self.engine_name} engine's ranks do not sample their weights")
        return dict(self.call_ranks("weight_sample", {"positions": dict(positions)})[0])

    def full_weights(self) -> dict[str, Any]:
        """Every weight as HF tensors in this process (small models, tests)."""
        return dict(self.call_ranks("full_weights")[0])

    def save_hf(self, path: str, max_shard_bytes: int | None = None) -> None:
        """Write an HF directory (config, safetensors in files of at most
        ``max_shard_bytes``, default ``export_shard_mb``, tokenizer files),
        atomically: the ranks write into a temporary sibling that is renamed
        onto ``path`` once complete."""
        self.require_initialized()
        shard_bytes = int(max_shard_bytes or (self.config.export_shard_mb << 20))
        if shard_bytes <= 0:
            raise ConfigError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
        with atomic_dir(path) as tmp:
            self.call_ranks("export_hf", {"tmp_dir": tmp, "shard_bytes": shard_bytes, **self.export_options()})

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
        are ranks 1..n); the other ranks help gather towards it."""
        self.call_ranks(
            "init_weight_group",
            dict(master_addr=master_addr, master_port=master_port, world_size=world_size, rank=rank,
                 group_name=group_name, backend=backend, timeout_s=timeout_s),
        )  # fmt: skip

    def send_weights(self, meta: WeightUpdateMeta) -> None:
        self.require_initialized()
        if meta.kind == "disk":
            if not meta.path:
                raise ConfigError("WeightUpdateMeta.path is required for kind='disk'")
            self.write_disk_weights(meta.path)
        elif meta.kind == "broadcast":
            if "group" in meta.extra:
                raise ConfigError(
                    f"WeightUpdateMeta.extra['group'] cannot be used with the {self.engine_name} engine (the group "
                    "lives in rank 0's process): call engine.init_weight_group(...) instead"
                )
            self.call_ranks("broadcast_weights", {"bucket_bytes": meta.bucket_bytes})
        else:
            raise ConfigError(f"WeightUpdateMeta.kind={meta.kind!r} is not supported; valid: 'disk', 'broadcast'")

    # ------------------------------------------------------------ checkpoint
    def save_state(self, path: str) -> None:
        """Model and optimizer shards (each rank writes its own with
        ``save_state_command``) and ``engine_state.json`` (step, version,
        ``state_meta()``, parameter names, settings); written atomically."""
        self.require_initialized()
        with atomic_dir(path) as tmp:
            self.call_ranks(self.save_state_command, {"tmp_dir": tmp})
            write_engine_state(tmp, self.engine_name, {
                "step": self._step,
                "version": self.get_version(),
                "total_train_steps": self.total_train_steps,
                **self.state_meta(),
                "param_names": [m["name"] for m in self._transfer_meta],
                "config": self.config.model_dump(),
            })  # fmt: skip

    def load_state(self, path: str) -> None:
        """Restore what ``save_state`` wrote: the parameter names must match,
        the ranks read their shards with ``load_state_command``."""
        self.require_initialized()
        meta = read_engine_state(path, self.engine_name)
        check_param_names(path, meta["param_names"], [m["name"] for m in self._transfer_meta])
        self.call_ranks(self.load_state_command, {"path": os.path.abspath(path), "step": int(meta["step"])})
        self._step = int(meta["step"])
        self.set_version(int(meta["version"]))

    # ------------------------------------------------------------- teardown
    def detach_ranks(self) -> RankGroup:
        """Hand the running rank processes over to another engine of the same
        rank module and world size (its constructor's ``ranks=``): the ranks
        drop this engine's model (their ``destroy``) and this engine is
        unusable afterwards. Saves the ranks' start-up (imports) when several
        engines run one after another."""
        self.require_initialized()
        assert self._ranks is not None
        self.call_ranks("destroy")
        group, self._ranks = self._ranks, None
        return group

    def destroy(self) -> None:
        """Stop the rank processes (politely first, then their process groups)."""
        if self._ranks is not None:
            self._ranks.shutdown()
            self._ranks = None

    def __del__(self) -> None:  # last resort: never leave ranks behind
        try:
            ranks = getattr(self, "_ranks", None)
            if ranks is not None and ranks.procs:
                ranks.stop()
        except Exception:  # noqa: BLE001
            pass
