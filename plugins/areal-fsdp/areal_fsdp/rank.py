"""One FSDP rank: ``python -m areal_fsdp.rank`` (started by the scheduler).

The process joins the torch.distributed default group from the environment
the scheduler set (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...), connects
to the controller's control socket, and executes the commands the
controller's ``FSDPTrainEngine`` sends through the kernel's rank loop
(``areal_kernel.engine.ranks``), every rank the same command (each on
its share of the data), so the collectives of FSDP line up.

``FSDPRankEngine`` holds the model shard and optimizer of one rank. It is
built from the kernel's public engine parts, the same ones the single-process
``TorchTrainEngine`` uses: ``areal_kernel.engine.microbatch`` (packing, the
shared-prompt plan, the forward, the micro-batch loop and the stats rules),
``.hf`` (model loading, the transfer weight list, the HF writer), ``.state``
(optimizer, RNG, lr) and ``.lr_schedule``. What sharding changes is here:
``RankSync`` (equal micro-batch counts on every rank, the global finite check
and grad norm), summed instead of averaged gradients, gathered exports and
DCP checkpoints, and with ``t > 1`` the 2-D (data, tensor) mesh and the
tensor-parallel plan (``areal_fsdp.tensor_parallel``) applied before FSDP.
With ``p > 1`` the rank keeps only its pipeline stages
(``areal_fsdp.pipeline``): no FSDP, a schedule of
``torch.distributed.pipelining`` instead of the micro-batch loop, weights
sent point-to-point from their owner to rank 0 for exports, and the tied
embedding's two copies kept equal. With ``e > 1`` (``e == d``) every MoE
block's experts are split over the ranks as DTensors that FSDP ignores,
and the block dispatches its tokens by all-to-all
(``areal_fsdp.expert_parallel``); the rest is FSDP over the same ranks.
With ``c > 1`` every micro-batch's row is split along the sequence over the
context ranks of a replica (``areal_fsdp.context_parallel``): each runs its
chunk with an attention that all-gathers the row's keys and values, and FSDP
shards the weights over all ranks.

A rank exits when its control connection closes or when the controller (its
parent) disappears, so no rank outlives the run that started it.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any, Callable

from areal_kernel.api.io import TrajectoryBatch
from areal_kernel.engine.hf import finish_hf_dir, hf_files, load_causal_lm, weights_for_transfer, write_hf_weights
from areal_kernel.engine.lr_schedule import scheduled_lr
from areal_kernel.engine.microbatch import MicroBatchHooks, MicroBatchRunner
from areal_kernel.engine.lora import (
    adapter_config,
    adapter_weights,
    apply_lora,
    copy_tokenizer_files,
    merge_plan,
    merge_tensor,
    peft_file_name,
    trainable_named_params,
    write_adapter_files,
)
from areal_kernel.engine.state import load_rng_state, make_optimizer, save_rng_state, set_lr, torch_dtype
from areal_kernel.engine.ranks import join_process_group, rank_main
from areal_kernel.errors import ArealError, ConfigError
from areal_kernel.platforms import current_platform

from areal_fsdp.config import FSDPEngineConfig
from areal_fsdp.layout import Layout, check_layout_settings
from areal_fsdp.multi_adapter import RankAdapters

__all__ = ["FSDPRankEngine", "RankSync", "device_mesh", "join_process_group", "main", "replicas"]


def _local(t: Any) -> Any:
    """The rank-local part of a (possibly DTensor) tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def _full(t: Any) -> Any:
    """The whole tensor (an all-gather for a sharded DTensor: every rank must call it)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def replicas(t: Any, world_size: int) -> int:
    """How many ranks hold the same local part of ``t``: 1 for a tensor
    sharded over every rank; ``t`` for a weight FSDP shards over the data axis
    only and the tensor ranks replicate (norms; the embedding and LM head when
    the vocabulary stays replicated); the whole
    world for a plain tensor. A global sum of squares divides by it."""
    mesh = getattr(t, "device_mesh", None)
    if mesh is None:
        return world_size
    sharded = 1
    for dim, placement in enumerate(t.placements):
        # Shard, and FSDP's _StridedShard over a tensor-parallel shard (whose
        # is_shard() says False): anything that is not a replica splits the data.
        if not placement.is_replicate():
            sharded *= mesh.size(dim)
    return max(1, world_size // sharded)


def _all_reduce(values: list[float], op: str) -> list[float]:
    import torch
    import torch.distributed as dist

    plat = current_platform()
    dev = torch.device("cpu") if plat.collectives_on_host else plat.device()
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
    return t.cpu().tolist()


class RankSync(MicroBatchHooks):
    """The micro-batch runner's hooks on a rank of a sharded model: every rank
    runs as many micro-batches as the busiest one, every forward and backward
    (lockstep), and the finite check and the grad norm span all ranks."""

    lockstep = True

    def __init__(self, world_size: int = 1, plain_replicas: int | None = None, counted_elsewhere: Any = ()) -> None:
        self.world_size = world_size
        # How many ranks hold the same plain (non-DTensor) tensor: every rank
        # for a replicated model, 1 for pipeline stages (each holds its own layers).
        self.plain_replicas = world_size if plain_replicas is None else plain_replicas
        # Parameters whose gradient another rank counts in the norm (the last
        # pipeline stage's copy of a tied embedding): clipped, not counted.
        self.counted_elsewhere = {id(p) for p in counted_elsewhere}

    def _replicas(self, g: Any) -> int:
        return replicas(g, self.world_size) if hasattr(g, "device_mesh") else self.plain_replicas

    def micro_batch_count(self, local: int) -> int:
        return int(_all_reduce([float(local)], "max")[0])

    def all_finite(self, local: bool) -> bool:
        return _all_reduce([1.0 if local else 0.0], "min")[0] > 0

    def clip_grad_norm(self, params: list[Any], max_norm: float | None) -> float:
        """Global L2 norm of the sharded gradients (each rank sums the squares
        of its shards, each divided by how many ranks hold the same shard, one
        all-reduce adds them up), then clip every shard by the same factor.
        Returns the norm before clipping."""
        import torch

        grads = [p.grad for p in params]
        counted = [p.grad for p in params if id(p) not in self.counted_elsewhere]
        local = 0.0
        if counted:
            sq = torch.stack([_local(g).detach().float().pow(2).sum() / self._replicas(g) for g in counted]).sum()
            local = float(sq)
        total = math.sqrt(_all_reduce([local], "sum")[0])
        if max_norm is not None and max_norm > 0 and math.isfinite(total):
            coef = max_norm / (total + 1e-6)
            if coef < 1.0:
                with torch.no_grad():
                    for g in grads:
                        _local(g).mul_(coef)
        return total


class FSDPRankEngine(RankAdapters):
    """The model shard and optimizer of one rank (with ``adapters``: one
    optimizer per adapter, ``areal_fsdp.multi_adapter``)."""

    def __init__(
        self,
        config: FSDPEngineConfig | dict[str, Any] | None,
        rank: int,
        world_size: int,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        cp: int = 1,
    ) -> None:
        self.config = FSDPEngineConfig.parse(config)
        self.rank = rank
        self.world_size = world_size
        if tp < 1 or pp < 1 or cp < 1 or world_size % (tp * pp * cp):
            raise ConfigError(
                f"fsdp rank: tensor x pipeline x context size {tp}x{pp}x{cp} does not divide the world size "
                f"{world_size}"
            )
        if ep > 1 and (tp > 1 or pp > 1 or cp > 1 or ep != world_size):
            raise ConfigError(f"fsdp rank: expert size {ep} must equal the world size {world_size} without t, p or c")
        if cp > 1 and (tp > 1 or pp > 1):
            raise ConfigError(f"fsdp rank: context size {cp} is not combined with t or p")
        self.layout = Layout(dp=world_size // (tp * pp * cp), tp=tp, pp=pp, ep=ep, cp=cp)
        check_layout_settings(self.layout, self.config)
        self.model: Any = None
        self.optimizer: Any = None
        self.runner: MicroBatchRunner | None = None
        self.model_path: str | None = None
        self.total_train_steps = 0
        self.step = 0
        self.weight_group: Any = None
        self.transfer_meta: list[dict[str, Any]] = []
        # Transfer name -> name in the live (sharded) state dict; they differ
        # only for LoRA adapters (peft's file names vs its module names).
        self.live_names: dict[str, str] = {}
        # LoRA with export: merged: how each exported weight is built (areal_kernel.engine.lora.merge_plan).
        self.merge_plan: list[tuple[str, str, Any]] = []
        self.adapter_config: dict[str, Any] | None = None
        # Tensor parallelism: the tensor group, and the replicated weights whose
        # gradients are partial sums over it (areal_fsdp.tensor_parallel.per_head_params).
        self.tp_group: Any = None
        self.tp_partial_params: list[Any] = []
        # Pipeline parallelism (areal_fsdp.pipeline): this rank's stages, which
        # rank holds each transfer weight, and the tied embedding's two copies.
        self.pipeline: Any = None
        self.owner: dict[str, int] = {}
        self.tie_group: Any = None
        self.tied_param: Any = None
        # Expert parallelism (areal_fsdp.expert_parallel): the router sums of the current step.
        self.router_stats: Any = None
        # Context parallelism (areal_fsdp.context_parallel): this rank's context group.
        self.cp_group: Any = None

    @property
    def device(self) -> Any:
        return current_platform().device()

    # ------------------------------------------------------------------ setup
    def initialize(self, model_path: str, total_train_steps: int) -> dict[str, Any]:
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            FSDPModule,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )

        from areal_kernel.weights.broadcast import tensor_meta

        if not os.path.isfile(os.path.join(model_path, "config.json")):
            raise ConfigError(
                f"model_path {model_path!r} is not an HF model directory (no config.json); "
                "pass a local directory written by save_pretrained"
            )
        if total_train_steps < 1:
            raise ConfigError(f"total_train_steps must be >= 1, got {total_train_steps}")
        cfg = self.config
        plat = current_platform()
        # Same seed on every rank: any random init (e.g. a new head) is identical before sharding.
        plat.manual_seed(cfg.seed)
        # Every rank reads the (memory-mapped) safetensors and keeps only its
        # shard after fully_shard; the full copy is transient.
        model = load_causal_lm(model_path, torch_dtype(cfg.param_dtype), cfg.attn_implementation)
        from areal_kernel.models.vision import ImageTensors, is_vision_model

        vision_model = is_vision_model(model_path)
        if cfg.adapters is not None:
            model = self.wrap_adapters(model)
        elif cfg.lora is not None:
            model = apply_lora(model, cfg.lora, section="actor.fsdp.lora")
        model.to(self.device)
        if cfg.adapters is not None:
            # Each adapter's transfer list; the rank starts as adapter 0's engine.
            self.describe_adapters(model, model_path)
        # What exports and broadcasts send, in order (tied aliases dropped), from
        # the unsharded model: the same list the single-process engine sends
        # (with LoRA: the adapter's tensors under peft's file names).
        if cfg.adapters is not None:
            named = []
        elif cfg.lora is not None:
            self.live_names = {peft_file_name(n): n for n, _ in trainable_named_params(model)}
            named = adapter_weights(model)
            if {n for n, _ in named} != set(self.live_names):
                raise ArealError("fsdp rank: peft's adapter names do not map onto the model's LoRA parameters")
            self.transfer_meta = tensor_meta(named)
            self.merge_plan = merge_plan(model)
            self.adapter_config = adapter_config(model, os.path.abspath(model_path))
        else:
            named = weights_for_transfer(model)
            self.live_names = {n: n for n, _ in named}
            self.transfer_meta = tensor_meta(named)
        del named
        if self.layout.pp > 1:
            if vision_model:
                raise ConfigError(
                    f"actor.backend: {self.layout}: pipeline stages are not cut for vision-language models; "
                    f"use 'fsdp:d{self.world_size}'"
                )
            return self._initialize_pipeline(model, model_path, total_train_steps)
        if self.layout.cp > 1:
            self._prepare_context_parallel(model, vision_model)
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

        mesh = device_mesh(self.world_size, self.layout.tp)
        tp_layers = 0
        # First vocabulary row of this rank's embedding / LM head slice; None
        # while they are replicated (no tensor parallelism, or they cannot split).
        vocab_start: int | None = None
        vocab_refusal: str | None = None
        partial_names: list[str] = []
        expert_params: list[Any] = []
        expert_info: dict[str, Any] = {}
        if self.layout.ep > 1:
            if vision_model:
                raise ConfigError(
                    f"actor.backend: {self.layout}: expert parallelism is not validated for vision-language models; "
                    f"use 'fsdp:d{self.world_size}'"
                )
            expert_params, expert_info = self._apply_expert_parallel(model, mesh)
        if self.layout.tp > 1:
            from areal_fsdp.tensor_parallel import (
                apply_tensor_parallel,
                apply_vocab_parallel,
                check_tp_model,
                per_head_params,
                vocab_split_refusal,
            )

            if vision_model:
                raise ConfigError(
                    f"actor.backend: {self.layout}: tensor parallelism has no plan for vision-language models; "
                    "use data parallelism only (t1)"
                )
            check_tp_model(model.config, self.layout.tp, str(self.layout))
            # TP first, then FSDP over the data axis (the order FSDP2 composes with DTensor).
            tp_layers = apply_tensor_parallel(model, mesh["tp"])
            self.tp_group = mesh["tp"].get_group()
            # The driver logs the refusal (a fallback, not an error: the replicated head is exact).
            vocab_refusal = vocab_split_refusal(model, self.layout.tp)
            if vocab_refusal is None:
                vocab_start = apply_vocab_parallel(model, mesh["tp"])
            partial_names = per_head_params(model)
            mesh = mesh["dp"]
        mp = cfg.mixed_precision
        mp_policy = MixedPrecisionPolicy(
            param_dtype=torch_dtype(mp.param_dtype),
            reduce_dtype=torch_dtype(mp.reduce_dtype),
            output_dtype=torch_dtype(mp.output_dtype),
            cast_forward_inputs=mp.cast_forward_inputs,
        )
        # Offloading moves shards from the accelerator to host memory; where
        # they are in host memory already (and FSDP's policy refuses a cpu
        # device) the platform says it cannot, and it is a no-op there.
        offload = CPUOffloadPolicy() if cfg.cpu_offload and plat.supports_cpu_offload else OffloadPolicy()

        # The experts (DTensors already split over the expert ranks) are left
        # out of FSDP: a rank computes with its own experts and never gathers the others'.
        ignored = set(expert_params) or None

        def shard(module: Any) -> None:
            fully_shard(
                module,
                mesh=mesh,
                reshard_after_forward=cfg.reshard_after_forward,
                mp_policy=mp_policy,
                offload_policy=offload,
                ignored_params=ignored,
            )

        wrapped = 0
        if cfg.wrap_policy == "decoder_layer":
            block_names = set(getattr(model, "_no_split_modules", None) or [])
            for name, m in list(model.named_modules()):
                # A vision-language model's vision tower stays in the root unit:
                # it runs only in micro-batches with images, and a unit of its
                # own would gather on some ranks and not on others (a hang).
                if type(m).__name__ in block_names and not (vision_model and "vision" in name):
                    shard(m)
                    wrapped += 1
        shard(model)
        # Each rank's loss is its share of the *batch* loss (normalised by
        # batch-level token counts), so gradients must be summed across ranks,
        # not averaged as FSDP does by default.
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                # Plain SUM reductions: gloo has no PREMUL_SUM (and a factor of 1 needs no scaling).
                m.set_force_sum_reduction_for_comms(True)
        model.train()
        self.model = model
        # After fully_shard: its parameters replaced the module's.
        params = dict(model.named_parameters())
        self.tp_partial_params = [params[n] for n in partial_names]
        # The sharded model is only called as a whole (split_head=False): calling
        # the decoder and the LM head separately would bypass the root unit's
        # hooks, which gather the embedding, final norm and head.
        if self.layout.ep > 1:
            from areal_fsdp.expert_parallel import ExpertRunner

            runner = ExpertRunner(model, cfg, self.device, hooks=RankSync(self.world_size), split_head=False)
            runner.router_stats = self.router_stats
            self.runner = runner
        elif self.layout.cp > 1:
            from areal_fsdp.context_parallel import ContextRunner

            # Plain packing: a shared-prompt tree row's 4-D mask is not split by the context attention.
            self.runner = ContextRunner(
                model, cfg.model_copy(update={"share_prompts": False}), self.device, hooks=RankSync(self.world_size),
                split_head=False, group=self.cp_group, rank=self.rank % self.layout.cp, size=self.layout.cp,
            )  # fmt: skip
        elif vocab_start is not None:
            from areal_fsdp.tensor_parallel import TensorRunner

            self.runner = TensorRunner(
                model, cfg, self.device, hooks=RankSync(self.world_size), split_head=False,
                group=self.tp_group, vocab_start=vocab_start,
            )  # fmt: skip
        else:
            self.runner = MicroBatchRunner(model, cfg, self.device, hooks=RankSync(self.world_size), split_head=False)
        if vision_model:
            self.runner.vision = ImageTensors(model_path)
        self.model_path = os.path.abspath(model_path)
        self.total_train_steps = int(total_train_steps)
        # With LoRA only the adapter trains: frozen base weights get no optimizer state.
        self.optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad], cfg)
        self.step = 0
        if cfg.adapters is not None:
            self.adapter_optimizers()
        self.set_lr()
        return {
            "transfer_meta": self.transfer_meta,
            "wrapped_blocks": wrapped,
            "tp_layers": tp_layers,
            "vocab_parallel": vocab_start is not None,
            "vocab_refusal": vocab_refusal,
            "adapter_config": self.adapter_config,
            "param_bytes": sum(_local(p).numel() * p.element_size() for p in model.parameters()),
            **expert_info,
            **(self.adapter_info() if cfg.adapters is not None else {}),
        }

    def _apply_expert_parallel(self, model: Any, mesh: Any) -> tuple[list[Any], dict[str, Any]]:
        """``fsdp:dNeN``: check the model, split every MoE block's experts over
        the ranks and swap in the all-to-all block (before FSDP). Returns the
        expert parameters and what ``initialize`` reports about them."""
        import torch.distributed as dist

        from areal_fsdp.expert_parallel import RouterStats, apply_expert_parallel, check_ep_model
        from areal_fsdp.pipeline import comm_device

        hf = model.config
        check_ep_model(hf, self.layout.ep, str(self.layout))
        n_experts, top_k = int(hf.num_experts), int(hf.num_experts_per_tok)
        self.router_stats = RouterStats(n_experts)
        # A group of its own for the token exchange, so its all-to-alls never
        # interleave with FSDP's gathers and reductions on the mesh's group.
        group = dist.new_group(list(range(self.world_size)))
        params = apply_expert_parallel(model, mesh, self.rank, group, self.router_stats, comm_device())
        per_rank = n_experts // self.layout.ep
        info = {
            "experts": [self.rank * per_rank, (self.rank + 1) * per_rank],
            "moe_shape": [n_experts, top_k],
            "moe_blocks": len(params) // 2,
        }
        return params, info

    def _prepare_context_parallel(self, model: Any, vision_model: bool) -> None:
        """``fsdp:dNcM``: check the model, switch its attention to the
        context-parallel one and make the context groups (every rank takes
        part in every ``new_group``; a rank keeps its own replica's)."""
        import torch.distributed as dist

        from areal_fsdp.context_parallel import ATTENTION_NAME, check_cp_model, register_attention

        cp = self.layout.cp
        if vision_model:
            raise ConfigError(
                f"actor.backend: {self.layout}: context parallelism is not validated for vision-language models; "
                f"use 'fsdp:d{self.world_size}'"
            )
        check_cp_model(model.config, cp, str(self.layout))
        register_attention()
        model.set_attn_implementation(ATTENTION_NAME)
        # Groups of their own, so the key/value gathers never interleave with
        # FSDP's gathers and reductions on the mesh's group.
        for replica in range(self.layout.dp):
            group = dist.new_group(list(range(replica * cp, (replica + 1) * cp)))
            if replica == self.rank // cp:
                self.cp_group = group

    def _initialize_pipeline(self, model: Any, model_path: str, total_train_steps: int) -> dict[str, Any]:
        """``fsdp:pN``: cut this rank's stages out of the whole model
        (``areal_fsdp.pipeline``), find which rank holds each weight, and pair
        the tied embedding's two copies."""
        import torch.distributed as dist

        from areal_fsdp.pipeline import make_pipeline

        cfg = self.config
        # Plain packing: a shared-prompt tree row needs its 4-D mask sent along
        # the pipeline, which the stages do not do yet (see areal_fsdp.pipeline).
        runner = MicroBatchRunner(
            model, cfg.model_copy(update={"share_prompts": False}), self.device, split_head=False,
        )  # fmt: skip
        self.pipeline, info = make_pipeline(model, runner, self.layout, cfg.pipeline_schedule, self.rank)
        model.train()
        self.model = model
        # Every rank sends the names it holds; a weight's owner is the (one) rank holding it.
        held: list[Any] = [None] * self.world_size
        dist.all_gather_object(held, sorted(model.state_dict()))
        for r in reversed(range(self.world_size)):
            for name in held[r]:
                self.owner[name] = r
        missing = [m["name"] for m in self.transfer_meta if m["name"] not in self.owner]
        if missing:
            raise ArealError(f"fsdp rank: no pipeline stage holds {missing[:3]}")
        counted_elsewhere = []
        if info["tie_split"]:
            from areal_fsdp.layout import PIPELINE_SCHEDULES, stage_rank

            n_stages = self.layout.pp * PIPELINE_SCHEDULES[cfg.pipeline_schedule][1]
            pair = sorted({stage_rank(0, self.layout.pp), stage_rank(n_stages - 1, self.layout.pp)})
            self.tie_group = dist.new_group(pair)  # every rank must take part in new_group
            if info["first"]:
                self.tied_param = model.model.embed_tokens.weight
            elif info["last"]:
                self.tied_param = model.lm_head.weight
                counted_elsewhere = [self.tied_param]  # the first stage counts the matrix in the norm
        runner.hooks = RankSync(self.world_size, plain_replicas=1, counted_elsewhere=counted_elsewhere)
        self.runner = runner
        self.model_path = os.path.abspath(model_path)
        self.total_train_steps = int(total_train_steps)
        self.optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad], cfg)
        self.step = 0
        self.set_lr()
        return {
            "transfer_meta": self.transfer_meta,
            "wrapped_blocks": 0,
            "tp_layers": 0,
            "adapter_config": None,
            "stages": [[s, r.start, r.stop] for s, r in info["stages"]],
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        }

    def set_lr(self) -> float:
        return set_lr(self.optimizer, scheduled_lr(self.config, self.step, self.total_train_steps))

    def _runner(self) -> MicroBatchRunner:
        if self.runner is None:
            raise ArealError("fsdp rank: initialize was not called")
        return self.runner

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    # ---------------------------------------------------------------- scoring
    def score_part(
        self, part: TrajectoryBatch, only_loss_tokens: bool, with_entropy: bool
    ) -> tuple[list, list | None] | None:
        """This rank's part's logprobs (and entropies); with pipeline
        parallelism only the rank of the last stage answers (others: None)."""
        if self.pipeline is not None:
            lp, ent = self.pipeline.score(part, only_loss_tokens)
            if not self.pipeline.last:
                return None
        else:
            lp, ent = self._runner().score(part, only_loss_tokens)
        return lp, (ent if with_entropy else None)

    # --------------------------------------------------------------- training
    def train_part(
        self,
        part: TrajectoryBatch,
        global_index: list[int],
        loss_fn: Callable[..., Any],
        extra: dict[str, list[list[float]]] | None,
        batch_loss_tokens: int,
        batch_n_seqs: int,
    ) -> dict[str, Any] | None:
        """This rank's share of one optimizer step. ``part`` holds the
        trajectories ``global_index`` of the batch; the loss normalisers are
        the whole batch's, so summing every rank's gradients gives the
        single-process gradient. With pipeline parallelism every rank runs
        its stages on the whole part and only the last stage's rank answers
        (the loss and stats are measured there; others return None)."""
        runner = self._runner()
        t0 = time.perf_counter()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.set_lr()
        worker: Any = self.pipeline if self.pipeline is not None else runner
        acc = worker.accumulate(
            part, loss_fn, extra, batch_loss_tokens=batch_loss_tokens, batch_n_seqs=batch_n_seqs,
            seq_index=global_index,
        )  # fmt: skip
        self._sum_partial_grads()
        self._sum_tied_grads()
        grad_norm, applied = runner.apply_gradients(self.optimizer, acc.finite, self.config.max_grad_norm)
        # Raw sums: the controller adds the ranks' and derives the metrics.
        router = self.router_stats.take() if self.router_stats is not None else {}
        self.step += 1
        current_platform().synchronize()
        if self.pipeline is not None and not self.pipeline.last:
            return None
        answer = acc.part_answer(grad_norm=grad_norm, lr=lr, applied=applied, step_time_s=time.perf_counter() - t0)
        answer["stats"].update(router)
        return answer

    def _sum_partial_grads(self) -> None:
        """Sum the per-head weights' gradients over the tensor group (each
        tensor rank saw only its heads). Summing FSDP's reduce-scattered local
        shards is the same sum: both reductions add."""
        import torch.distributed as dist

        for p in self.tp_partial_params:
            if p.grad is not None:
                dist.all_reduce(_local(p.grad), group=self.tp_group)

    def _sum_tied_grads(self) -> None:
        """Pipeline stages on two ranks holding one tied matrix each (embedding
        on the first, LM head on the last): add the two gradients, so both
        copies get the single-process gradient and stay equal."""
        import torch
        import torch.distributed as dist

        p = self.tied_param
        if p is None:
            return
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=self.tie_group)

    # ---------------------------------------------------------------- weights
    def _named_sharded(self) -> dict[str, Any]:
        return dict(self.model.state_dict())

    def _gather_group(self, sd: dict[str, Any], names: list[str]) -> list[tuple[str, Any]]:
        """All-gather ``names`` (collective); only rank 0 keeps the results.
        Pipeline stages: the rank holding each weight sends it to rank 0."""
        if self.pipeline is not None:
            return self._gather_from_owners(sd, names)
        out = []
        for name in names:
            full = _full(sd[self.live_names.get(name, name)]).detach()
            if self.rank == 0:
                out.append((name, full.to("cpu")))  # no copy when it is a host tensor already
            del full
        return out

    def _gather_from_owners(self, sd: dict[str, Any], names: list[str]) -> list[tuple[str, Any]]:
        """Pipeline stages: each weight of ``names`` travels from its owner to
        rank 0 (point-to-point, in ``names`` order, so the pairs match)."""
        import torch
        import torch.distributed as dist

        from areal_fsdp.pipeline import comm_device
        from areal_kernel.weights.broadcast import parse_dtype

        meta = {m["name"]: m for m in self.transfer_meta}
        dev = comm_device()
        out = []
        for name in names:
            owner = self.owner[name]
            if owner == self.rank:
                t = sd[name].detach()
                if self.rank == 0:
                    out.append((name, t.to("cpu")))
                else:
                    dist.send(t.to(dev).contiguous(), dst=0)
            elif self.rank == 0:
                buf = torch.empty(meta[name]["shape"], dtype=parse_dtype(meta[name]["dtype"]), device=dev)
                dist.recv(buf, src=owner)
                out.append((name, buf.to("cpu")))
        return out

    def export_hf(self, tmp_dir: str, shard_bytes: int, lora_export: str | None = None) -> dict[str, Any]:
        """Write an HF directory into ``tmp_dir`` with the kernel's HF writer
        (``areal_kernel.engine.hf``): every rank helps gather one file's
        weights at a time (at most ``shard_bytes``), rank 0 writes it, so its
        memory stays bounded by one file."""
        if self.config.lora is not None:
            return self._export_lora(tmp_dir, shard_bytes, lora_export or self.config.lora.export)
        sd = self._named_sharded()
        files: dict[str, dict[str, Any]] = {}
        plan = hf_files(self.transfer_meta, shard_bytes)
        for fname, names in plan:
            named = self._gather_group(sd, names)
            if self.rank == 0:
                files[fname] = write_hf_weights(tmp_dir, fname, named)
            del named
        if self.rank == 0:
            finish_hf_dir(tmp_dir, self.model, files, self.model_path)
        self.barrier()
        return {"files": len(plan)}

    def _export_lora(self, tmp_dir: str, shard_bytes: int, export: str) -> dict[str, Any]:
        """LoRA exports: the adapter directory (every rank helps gather the
        adapter, rank 0 writes it), or with ``lora.export: merged`` the base
        model with the adapter merged in, one file of at most ``shard_bytes``
        at a time (each weight gathered with its adapter and merged on rank 0)."""
        from areal_kernel.weights.broadcast import tensor_meta

        assert self.config.lora is not None
        sd = self._named_sharded()
        if export != "merged":
            self.write_adapter(tmp_dir)
            if self.rank == 0:
                copy_tokenizer_files(self.model_path, tmp_dir)
            self.barrier()
            return {"files": 1}
        by_hf = {hf: (live, lora) for hf, live, lora in self.merge_plan}
        meta = tensor_meta((hf, sd[live]) for hf, live, _ in self.merge_plan)
        files: dict[str, dict[str, Any]] = {}
        plan = hf_files(meta, shard_bytes)
        for fname, names in plan:
            named = []
            for hf in names:
                live, lora = by_hf[hf]
                parts = self._gather_group(sd, [live] + ([lora[0], lora[1]] if lora else []))
                if self.rank == 0:
                    t = parts[0][1]
                    if lora is not None:
                        t = merge_tensor(t, parts[1][1], parts[2][1], lora[2])
                    named.append((hf, t))
            if self.rank == 0:
                files[fname] = write_hf_weights(tmp_dir, fname, named)
            del named
        if self.rank == 0:
            finish_hf_dir(tmp_dir, self.model.get_base_model(), files, self.model_path)
        self.barrier()
        return {"files": len(plan)}

    def write_adapter(self, tmp_dir: str) -> dict[str, Any]:
        """The adapter as a peft directory's files in ``tmp_dir`` (rank 0
        writes; every rank helps gather). What a disk weight update ships."""
        named = self._gather_group(self._named_sharded(), [m["name"] for m in self.transfer_meta])
        if self.rank == 0:
            assert self.adapter_config is not None, "write_adapter: this engine trains no adapter"
            write_adapter_files(tmp_dir, named, self.adapter_config)
        return {"tensors": len(named)}

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
        """Only rank 0 joins the broadcast group (it talks to the inference
        servers); the other ranks only help gather."""
        from areal_kernel.weights.broadcast import init_weight_group

        if self.rank == 0:
            self.weight_group = init_weight_group(
                master_addr, master_port, world_size, rank, group_name, backend=backend, timeout_s=timeout_s
            )

    def broadcast_weights(self, bucket_bytes: int) -> dict[str, Any]:
        """Stream the full weights to the servers in buckets of at most
        ``bucket_bytes``: every rank helps all-gather one bucket, rank 0 sends
        it over the weight group, then the next. The receivers plan the same
        buckets from the same metadata (``plan_buckets``)."""
        from areal_kernel.weights.broadcast import plan_buckets, send_buckets

        if self.rank == 0 and self.weight_group is None:
            raise ArealError("broadcast needs the weight group: call init_weight_group(...) first")
        sd = self._named_sharded()
        meta = self.transfer_meta
        n_buckets = 0
        for bucket in plan_buckets(meta, bucket_bytes):
            named = self._gather_group(sd, [meta[i]["name"] for i in bucket])
            if self.rank == 0:
                # One planned bucket re-plans to exactly one bucket on this sub-list.
                send_buckets(self.weight_group, named, bucket_bytes)
            del named
            n_buckets += 1
        current_platform().synchronize()
        return {"buckets": n_buckets}

    def weight_sample(self, positions: dict[str, list[int]]) -> dict[str, Any] | None:
        """The weight-delivery check's sample (rank 0; None elsewhere): only
        the sampled tensors are gathered, the elements taken on rank 0."""
        from areal_kernel.utils.tensor_sample import sample_named

        names = [m["name"] for m in self.transfer_meta if m["name"] in positions]
        named = self._gather_group(self._named_sharded(), names)
        return sample_named(named, positions) if self.rank == 0 else None

    def full_weights(self) -> list[tuple[str, Any]] | None:
        """The gathered weights (rank 0; None elsewhere): for tests and small models."""
        named = self._gather_group(self._named_sharded(), [m["name"] for m in self.transfer_meta])
        return named if self.rank == 0 else None

    # ------------------------------------------------------------- checkpoint
    def dcp_save(self, tmp_dir: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.optimizer, options=self._state_dict_options())
        msd = self._trained_only(msd)
        dcp.save({"model": msd, "optim": self._optim_entry(osd)}, checkpoint_id=os.path.join(tmp_dir, "dcp"))
        save_rng_state(os.path.join(tmp_dir, f"rng-rank{self.rank}.safetensors"))
        self.barrier()

    def dcp_load(self, path: str, step: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        opts = self._state_dict_options()
        msd, osd = get_state_dict(self.model, self.optimizer, options=opts)
        state: dict[str, Any] = {"model": self._trained_only(msd), "optim": self._optim_entry(osd)}
        dcp.load(state, checkpoint_id=os.path.join(path, "dcp"))
        optim = state["optim"][f"stage_rank{self.rank}"] if self.pipeline is not None else state["optim"]
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=optim, options=opts
        )
        rng_path = os.path.join(path, f"rng-rank{self.rank}.safetensors")
        if os.path.isfile(rng_path):  # absent when resuming with more ranks than were saved
            load_rng_state(rng_path)
        self.step = int(step)
        self.set_lr()
        self.barrier()

    def _optim_entry(self, osd: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint's optimizer entry. Pipeline stages: under this rank's
        own key, because each rank's optimizer has other parameter groups and
        DCP would keep one rank's copy of an entry every rank writes. (The
        model entry needs no key of its own: the stages keep the HF names, and
        each name is held by one rank.)"""
        return {f"stage_rank{self.rank}": osd} if self.pipeline is not None else osd

    def _state_dict_options(self) -> Any:
        """With LoRA a checkpoint holds the adapter and its optimizer state
        only: the frozen base is the model directory's."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        lora = self.config.lora is not None
        return StateDictOptions(ignore_frozen_params=lora, strict=not lora)

    def _trained_only(self, msd: dict[str, Any]) -> dict[str, Any]:
        """With LoRA, the adapter's entries of a model state dict: a tied LM head
        slips through ``ignore_frozen_params`` as an alias of the frozen embedding."""
        if self.config.lora is None:
            return msd
        trained = set(self.live_names.values())
        return {k: v for k, v in msd.items() if k in trained}

    def get_step(self) -> int:
        return self.step

    def destroy(self) -> None:
        self.model = None
        self.runner = None
        self.pipeline = None
        self.optimizer = None
        self.weight_group = None


# ---------------------------------------------------------------- the process
def device_mesh(world_size: int, tp: int = 1) -> Any:
    """The mesh on the platform's device type (torch picks the collective
    backend registered for that device): 1-D over every rank for data
    parallelism alone; with ``tp > 1`` 2-D ``("dp", "tp")``, tensor ranks
    innermost (rank ``r`` is replica ``r // tp``, tensor rank ``r % tp``)."""
    from torch.distributed.device_mesh import init_device_mesh

    if tp == 1:
        return init_device_mesh(current_platform().device_type, (world_size,))
    return init_device_mesh(current_platform().device_type, (world_size // tp, tp), mesh_dim_names=("dp", "tp"))


def main(argv: list[str] | None = None) -> int:
    """The rank process: the kernel's rank loop (``areal_kernel.engine.ranks``)
    serving an ``FSDPRankEngine``."""
    return rank_main(
        lambda rank, world_size, config, tp=1, pp=1, ep=1, cp=1: FSDPRankEngine(
            config, rank, world_size, tp, pp, ep, cp
        ),
        "fsdp",
        argv,
    )


if __name__ == "__main__":
    sys.exit(main())
