"""One Megatron rank: ``python -m areal_megatron.rank`` (started by the scheduler
through ``areal_kernel.engine.ranks.RankGroup``).

``MegatronRankEngine`` holds one rank's piece of a Megatron-Core ``GPTModel``
(local layer spec, no Transformer Engine): its tensor-parallel slice of the
layers of its pipeline stage, and a torch optimizer over those parameters.
It is built from the kernel's public engine parts: the micro-batch runner
(``areal_kernel.engine.microbatch``: planning, the loss contract, lockstep
hooks, gradient application), ``.state`` (optimizer, RNG), ``.lr_schedule``,
``.hf`` (the HF writer) and ``areal_kernel.weights.broadcast`` (buckets).
What Megatron changes is here:

- forward: micro-batches are *padded* (each sequence its own row, positions
  from 0, right padding under the causal mask): megatron-core's variable-
  length (THD) attention exists only in Transformer Engine. Cost: the pad
  tokens of each micro-batch (``max_len * n_seqs - sum(len)``) are computed;
- logprobs from vocabulary-parallel logits (max, sum of exponentials and the
  target logit reduced over the tensor-parallel group, no full-vocab gather);
- pipeline: a plain schedule with one micro-batch in flight (activations
  sent forward, the last stage's logprobs broadcast back so every stage runs
  the same loss, activation gradients sent backward). Exact, but the stages
  take turns (no 1F1B overlap);
- data parallel: gradients *summed* over data-parallel replicas (the kernel's
  loss contract normalises by the whole batch), tied embeddings' gradients
  summed between first and last stage;
- checkpoints: the model through ``megatron.core.dist_checkpointing`` (any
  layout can load it), optimizer and RNG per (tensor, pipeline) rank.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Callable, Iterator

from areal_kernel.api.io import TrajectoryBatch
from areal_kernel.engine.lr_schedule import scheduled_lr
from areal_kernel.engine.microbatch import MicroBatchHooks, MicroBatchRunner
from areal_kernel.engine.optimizer_state import load_optimizer_state, save_optimizer_state
from areal_kernel.engine.state import load_rng_state, make_optimizer, save_rng_state, set_lr, torch_dtype
from areal_kernel.errors import ArealError, ConfigError
from areal_kernel.platforms import current_platform

from areal_megatron.config import MegatronEngineConfig
from areal_megatron.convert import ArchSpec, arch_from_hf_config, check_layout, hf_to_megatron, megatron_to_hf
from areal_megatron.convert import is_tensor_parallel, megatron_names


def _host_or_device() -> Any:
    import torch

    plat = current_platform()
    return torch.device("cpu") if plat.collectives_on_host else plat.device()


class _Pipe:
    """Point-to-point and broadcast helpers of one pipeline group."""

    def __init__(self) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        self.size = ps.get_pipeline_model_parallel_world_size()
        self.rank = ps.get_pipeline_model_parallel_rank()
        self.group = ps.get_pipeline_model_parallel_group()
        self.ranks = dist.get_process_group_ranks(self.group)
        self.first = self.rank == 0
        self.last = self.rank == self.size - 1

    def send_next(self, t: Any) -> None:
        import torch.distributed as dist

        dist.send(t.detach().contiguous(), dst=self.ranks[self.rank + 1])

    def recv_prev(self, like: Any) -> Any:
        import torch.distributed as dist

        buf = like.new_empty(like.shape)
        dist.recv(buf, src=self.ranks[self.rank - 1])
        return buf

    def send_prev(self, t: Any) -> None:
        import torch.distributed as dist

        dist.send(t.detach().contiguous(), dst=self.ranks[self.rank - 1])

    def recv_next(self, like: Any) -> Any:
        import torch.distributed as dist

        buf = like.new_empty(like.shape)
        dist.recv(buf, src=self.ranks[self.rank + 1])
        return buf

    def from_last(self, t: Any) -> Any:
        import torch.distributed as dist

        dist.broadcast(t, src=self.ranks[-1], group=self.group)
        return t


def _boundary(pipe: _Pipe) -> Any:
    """Autograd function of a non-last stage: its outputs are the last stage's
    (logprobs, entropy), its backward receives the gradient of this stage's
    output activations from the next stage."""
    import torch

    class Boundary(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, hidden: Any, lp: Any, ent: Any) -> Any:
            ctx.hidden_like = torch.empty_like(hidden)
            return lp.clone(), ent.clone()

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            return pipe.recv_next(ctx.hidden_like), None, None

    return Boundary


class MegatronSync(MicroBatchHooks):
    """Hooks of the micro-batch runner on a Megatron rank: every rank of a
    tensor/pipeline group sees the same data, so it runs the same micro-
    batches; the finite check spans all ranks; the gradient norm sums each
    distinct parameter shard once (replicated norms on tensor-parallel rank
    0 only, a tied output layer once)."""

    lockstep = True

    def __init__(self, counted: Callable[[str], bool], names: dict[int, str]) -> None:
        self.counted = counted
        self.names = names  # id(param) -> megatron name

    def all_finite(self, local: bool) -> bool:
        import torch
        import torch.distributed as dist

        t = torch.tensor([1.0 if local else 0.0], device=_host_or_device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item() > 0)

    def clip_grad_norm(self, params: list[Any], max_norm: float | None) -> float:
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        sq = torch.zeros(1, dtype=torch.float64, device=_host_or_device())
        for p in params:
            if self.counted(self.names[id(p)]):
                sq += p.grad.detach().double().pow(2).sum().to(sq.device)
        dist.all_reduce(sq, group=ps.get_model_parallel_group())
        total = math.sqrt(float(sq.item()))
        if max_norm is not None and max_norm > 0 and math.isfinite(total):
            coef = max_norm / (total + 1e-6)
            if coef < 1.0:
                with torch.no_grad():
                    for p in params:
                        p.grad.mul_(coef)
        return total


class MegatronRunner(MicroBatchRunner):
    """The kernel's micro-batch runner with a Megatron forward (padded rows,
    vocabulary-parallel logprobs, the pipeline schedule above)."""

    def __init__(self, model: Any, config: Any, device: Any, hooks: MicroBatchHooks, pipe: _Pipe) -> None:
        super().__init__(model, config, device, hooks=hooks, split_head=False)
        self.pipe = pipe
        self.boundary = _boundary(pipe)

    def forward(
        self, row: Any, *, entropy_grad: bool, scored: Any = None, tree: Any = None, images: Any = None
    ) -> tuple[Any, Any]:
        import torch
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as tp_sum

        if tree is not None:
            raise ArealError("megatron engine: shared-prompt trees are not supported (share_prompts: false)")
        if images:
            raise ArealError("megatron engine: vision-language models are not supported (text-only GPT models)")
        n = row.input_ids.shape[0]
        dev = row.input_ids.device
        cu = list(row.cu_seqlens)
        lens = [cu[k + 1] - cu[k] for k in range(len(cu) - 1)]
        b, width = len(lens), max(lens)
        ids = torch.zeros(b, width, dtype=torch.long, device=dev)
        seq_of = torch.empty(n, dtype=torch.long, device=dev)
        off_of = torch.empty(n, dtype=torch.long, device=dev)
        for k, (a, ln) in enumerate(zip(cu[:-1], lens)):
            ids[k, :ln] = row.input_ids[a : a + ln]
            seq_of[a : a + ln] = k
            off_of[a : a + ln] = torch.arange(ln, device=dev)
        pos = torch.arange(width, device=dev)[None].expand(b, width)
        wanted = ~row.seq_start if scored is None else (scored & ~row.seq_start)
        target_pos = torch.nonzero(wanted, as_tuple=False)[:, 0]
        # Token i of a sequence is predicted by the output at i-1.
        flat_pred = seq_of.index_select(0, target_pos) * width + off_of.index_select(0, target_pos) - 1
        pipe = self.pipe
        hidden_shape = (width, b, self.model.config.hidden_size)
        if not pipe.first:
            like = torch.empty(hidden_shape, dtype=self.model.config.params_dtype, device=dev)
            inp = pipe.recv_prev(like).requires_grad_(True)
            inp.register_hook(lambda g: pipe.send_prev(g))
            self.model.set_input_tensor(inp)
        with self.autocast():
            out = self.model(ids if pipe.first else None, pos if pipe.first else None, None)
        k_sel = target_pos.shape[0]
        if pipe.last:
            z = out.reshape(b * width, -1).index_select(0, flat_pred).float()  # [k, V / tp]
            if self.config.temperature != 1.0:
                z = z / self.config.temperature
            m = z.detach().max(dim=-1).values
            if ps.get_tensor_model_parallel_world_size() > 1:
                torch.distributed.all_reduce(
                    m, op=torch.distributed.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group()
                )
            e = torch.exp(z - m[:, None])
            lse = m + torch.log(tp_sum(e.sum(-1)))
            v_local = z.shape[-1]
            start = ps.get_tensor_model_parallel_rank() * v_local
            labels = row.input_ids.index_select(0, target_pos) - start
            here = (labels >= 0) & (labels < v_local)
            tgt = z.gather(-1, labels.clamp(0, v_local - 1)[:, None])[:, 0] * here
            lp_sel = tp_sum(tgt) - lse
            if entropy_grad:
                ent_sel = lse - tp_sum((torch.exp(z - lse[:, None]) * z).sum(-1))
            else:
                with torch.no_grad():
                    ent_sel = lse - tp_sum((torch.exp(z - lse[:, None]) * z).sum(-1))
            if pipe.size > 1:
                pipe.from_last(torch.stack([lp_sel.detach(), ent_sel.detach()]))
        else:
            pipe.send_next(out)
            vals = pipe.from_last(torch.empty(2, k_sel, dtype=torch.float32, device=dev))
            lp_sel, ent_sel = self.boundary.apply(out, vals[0], vals[1])
        logprobs = torch.zeros(n, dtype=lp_sel.dtype, device=dev).index_put((target_pos,), lp_sel)
        entropy = torch.zeros(n, dtype=ent_sel.dtype, device=dev).index_put((target_pos,), ent_sel)
        return logprobs, entropy


class MegatronRankEngine:
    """The model piece and optimizer of one rank."""

    def __init__(self, config: MegatronEngineConfig | dict[str, Any] | None, rank: int, world_size: int,
                 tp: int = 1, pp: int = 1) -> None:  # fmt: skip
        self.config = MegatronEngineConfig.parse(config)
        self.rank, self.world_size, self.tp, self.pp = rank, world_size, tp, pp
        self.model: Any = None
        self.optimizer: Any = None
        self.runner: MegatronRunner | None = None
        self.arch: ArchSpec | None = None
        self.model_path: str | None = None
        self.total_train_steps = 0
        self.step = 0
        self.weight_group: Any = None
        self.transfer_meta: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ setup
    def initialize(self, model_path: str, total_train_steps: int) -> dict[str, Any]:
        import torch
        from megatron.core import parallel_state as ps
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.transformer.transformer_config import TransformerConfig
        from safetensors import safe_open

        from areal_megatron import cpu_redirect

        cfg = self.config
        plat = current_platform()
        cpu_redirect.apply(plat.host_memory)
        with open(os.path.join(model_path, "config.json")) as f:
            hf_cfg = json.load(f)
        arch = self.arch = arch_from_hf_config(hf_cfg, where=os.path.join(model_path, "config.json"))
        check_layout(arch, self.tp, self.pp)
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp)
        plat.manual_seed(cfg.seed)
        # Megatron's attention forks its tensor-parallel RNG state around
        # dropout (even at p=0) and raises unless that state was added: on a
        # device this call adds it; on host memory cpu_redirect made it a plain
        # torch.manual_seed (looked up through the module so the redirect applies).
        from megatron.core.tensor_parallel import random as mcore_random

        mcore_random.model_parallel_cuda_manual_seed(cfg.seed)
        dtype = torch_dtype(cfg.param_dtype)
        tcfg = TransformerConfig(
            num_layers=arch.layers, hidden_size=arch.hidden, num_attention_heads=arch.heads,
            num_query_groups=arch.kv_heads, kv_channels=arch.head_dim, ffn_hidden_size=arch.ffn,
            normalization="RMSNorm", layernorm_epsilon=arch.eps, gated_linear_unit=True,
            activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=arch.qkv_bias,
            qk_layernorm=arch.qk_norm, attention_dropout=0.0, hidden_dropout=0.0,
            bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
            gradient_accumulation_fusion=False, persist_layer_norm=False, use_cpu_initialization=True,
            perform_initialization=False, params_dtype=dtype, pipeline_dtype=dtype,
            tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
            bf16=cfg.param_dtype == "bfloat16",
        )  # fmt: skip
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=arch.qk_norm)
        model = GPTModel(
            tcfg, spec, vocab_size=arch.vocab, max_sequence_length=arch.max_positions,
            pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=arch.tied, position_embedding_type="rope",
            rotary_base=int(arch.rope_theta) if float(arch.rope_theta).is_integer() else arch.rope_theta,
            parallel_output=True,
        )  # fmt: skip
        self.pipe = _Pipe()
        per_stage = arch.layers // self.pp
        self.layer_offset = self.pipe.rank * per_stage
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        expected = megatron_names(arch, per_stage, self.pipe.first, self.pipe.last)
        if arch.tied and self.pp > 1 and self.pipe.last:
            expected.append("output_layer.weight")  # the last stage's copy of the tied embedding
        names = [n for n, _ in model.named_parameters()]
        if sorted(names) != sorted(expected):
            raise ArealError(f"megatron model parameters {names} differ from the converter's {expected}")
        with safe_open(self._weights_file(model_path), "pt") as f:
            index = self._weight_index(model_path)

            def get(name: str) -> Any:
                if name == "lm_head.weight" and arch.tied:
                    name = "model.embed_tokens.weight"
                if index is None:
                    return f.get_tensor(name)
                with safe_open(os.path.join(model_path, index[name]), "pt") as g:
                    return g.get_tensor(name)

            with torch.no_grad():
                for n, p in model.named_parameters():
                    if n == "output_layer.weight" and arch.tied:
                        t = hf_to_megatron("embedding.word_embeddings.weight", get, arch, self.tp_rank, self.tp)
                    else:
                        t = hf_to_megatron(n, get, arch, self.tp_rank, self.tp, self.layer_offset)
                    if tuple(t.shape) != tuple(p.shape):
                        raise ArealError(f"converted {n} has shape {tuple(t.shape)}, the model {tuple(p.shape)}")
                    p.copy_(t.to(p.dtype))
        model.to(plat.device())
        model.train()
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.model = model
        self.optimizer = make_optimizer(list(model.parameters()), cfg)
        hooks = MegatronSync(self._counted, self.names)
        self.runner = MegatronRunner(model, cfg, plat.device(), hooks, self.pipe)
        self.model_path = os.path.abspath(model_path)
        self.total_train_steps = int(total_train_steps)
        self.transfer_meta = self._transfer_meta(model_path)
        self.sources = self._stage_sources()
        return {"transfer_meta": self.transfer_meta, "dp_rank": self.dp_rank, "reporter": self._reporter}

    @property
    def _reporter(self) -> bool:
        """The rank whose losses, stats and scores stand for its data-parallel replica."""
        return self.pipe.last and self.tp_rank == 0

    def _counted(self, name: str) -> bool:
        if self.arch is not None and self.arch.tied and self.pp > 1 and name == "output_layer.weight":
            return False  # the first stage counts the tied embedding
        return is_tensor_parallel(name) or self.tp_rank == 0

    @staticmethod
    def _weight_index(model_path: str) -> dict[str, str] | None:
        idx = os.path.join(model_path, "model.safetensors.index.json")
        if not os.path.isfile(idx):
            return None
        with open(idx) as f:
            return dict(json.load(f)["weight_map"])

    @staticmethod
    def _weights_file(model_path: str) -> str:
        single = os.path.join(model_path, "model.safetensors")
        if os.path.isfile(single):
            return single
        idx = MegatronRankEngine._weight_index(model_path)
        if idx is None:
            raise ConfigError(f"model_path {model_path!r} has no model.safetensors (or index)")
        return os.path.join(model_path, sorted(set(idx.values()))[0])

    def _stages(self) -> list[tuple[int, list[str]]]:
        """(stage, megatron names) of every pipeline stage, in HF export order."""
        assert self.arch is not None
        per = self.arch.layers // self.pp
        return [(s, megatron_names(self.arch, per, s == 0, s == self.pp - 1)) for s in range(self.pp)]

    def _transfer_meta(self, model_path: str) -> list[dict[str, Any]]:
        """HF names, shapes and dtypes in the order ``iter_hf`` yields them
        (conversion run on meta tensors)."""
        import torch
        from safetensors import safe_open

        from areal_kernel.weights.broadcast import tensor_meta

        assert self.arch is not None
        arch = self.arch
        dtype = torch_dtype(self.config.param_dtype)
        index = self._weight_index(model_path)
        shapes: dict[str, list[int]] = {}
        files = sorted(set(index.values())) if index else ["model.safetensors"]
        for fn in files:
            with safe_open(os.path.join(model_path, fn), "pt") as f:
                for k in f.keys():
                    shapes[k] = list(f.get_slice(k).get_shape())

        def get(name: str) -> Any:
            if name == "lm_head.weight" and arch.tied:
                name = "model.embed_tokens.weight"
            return torch.empty(shapes[name], dtype=dtype, device="meta")

        named = []
        per = arch.layers // self.pp
        for s, names in self._stages():
            for n in names:
                shards = [hf_to_megatron(n, get, arch, r, self.tp, s * per) for r in range(self.tp)]
                named += megatron_to_hf(n, shards, arch, s * per)
        return tensor_meta(named)

    # --------------------------------------------------------------- training
    def _my_part(self, parts: list[TrajectoryBatch]) -> TrajectoryBatch:
        return parts[self.dp_rank]

    def score_part(self, parts: list[TrajectoryBatch], only_loss_tokens: bool, with_entropy: bool) -> Any:
        assert self.runner is not None
        lp, ent = self.runner.score(self._my_part(parts), only_loss_tokens)
        return (lp, ent if with_entropy else None) if self._reporter else None

    def train_part(
        self,
        parts: list[TrajectoryBatch],
        global_index: list[list[int]],
        loss_fn: Callable[..., Any],
        extra: list[dict[str, list[list[float]]]],
        batch_loss_tokens: int,
        batch_n_seqs: int,
    ) -> dict[str, Any] | None:
        assert self.runner is not None
        t0 = time.perf_counter()
        lr = set_lr(self.optimizer, scheduled_lr(self.config, self.step, self.total_train_steps))
        self.optimizer.zero_grad(set_to_none=True)
        res = self.runner.accumulate(
            self._my_part(parts), loss_fn, extra[self.dp_rank],
            batch_loss_tokens=batch_loss_tokens, batch_n_seqs=batch_n_seqs, seq_index=global_index[self.dp_rank],
        )  # fmt: skip
        self._reduce_grads()
        grad_norm, applied = self.runner.apply_gradients(self.optimizer, res.finite, self.config.max_grad_norm)
        self.step += 1
        if not self._reporter:
            return None
        return res.part_answer(grad_norm=grad_norm, lr=lr, applied=applied, step_time_s=time.perf_counter() - t0)

    def _reduce_grads(self) -> None:
        """Sum gradients over data-parallel replicas (one flat buffer) and the
        tied embedding's two copies over the embedding group."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        params = list(self.model.parameters())
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if ps.get_data_parallel_world_size() > 1:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat, group=ps.get_data_parallel_group())
            off = 0
            for p in params:
                k = p.grad.numel()
                p.grad.copy_(flat[off : off + k].view_as(p.grad))
                off += k
        if self.arch is not None and self.arch.tied and self.pp > 1:
            if self.pipe.first or self.pipe.last:
                w = self.model.shared_embedding_or_output_weight()
                dist.all_reduce(w.grad, group=ps.get_embedding_group())

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    # ---------------------------------------------------------------- weights
    def iter_hf(self) -> Iterator[tuple[str, Any]]:
        """The full HF weights in ``transfer_meta`` order: yielded on rank 0
        only (every rank must run the generator to the end: it gathers the
        tensor-parallel shards of one parameter at a time and sends whole
        tensors from the other stages to rank 0)."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        assert self.arch is not None
        own = dict(self.model.named_parameters())
        per = self.arch.layers // self.pp
        tp_group = ps.get_tensor_model_parallel_group()
        k = 0
        for s, names in self._stages():
            mine = s == self.pipe.rank
            source = mine and self.tp_rank == 0 and self.dp_rank == 0
            src_rank = self.sources[s]
            for n in names:
                converted: list[tuple[str, Any]] = []
                if mine:
                    t = own[n].detach()
                    if self.tp > 1 and is_tensor_parallel(n):
                        shards = [torch.empty_like(t) for _ in range(self.tp)]
                        dist.all_gather(shards, t.contiguous(), group=tp_group)
                    else:
                        shards = [t] * self.tp
                    if source:
                        converted = megatron_to_hf(n, [x.cpu() for x in shards], self.arch, s * per)
                m_count = self._hf_count(n)
                for j in range(m_count):
                    meta = self.transfer_meta[k + j]
                    if self.rank == 0:
                        if src_rank == 0:
                            yield converted[j]
                        else:
                            from areal_kernel.weights.broadcast import parse_dtype

                            # On the collective backend's device (nccl sends device tensors only).
                            buf = torch.empty(meta["shape"], dtype=parse_dtype(meta["dtype"]), device=_host_or_device())
                            dist.recv(buf, src=src_rank)
                            yield meta["name"], buf.cpu()
                    elif source:
                        dist.send(converted[j][1].contiguous().to(_host_or_device()), dst=0)
                k += m_count

    def _hf_count(self, name: str) -> int:
        assert self.arch is not None
        if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
            return 3
        if name.endswith("linear_fc1.weight"):
            return 2
        return 1

    def _stage_sources(self) -> list[int]:
        """Global rank of (stage s, tensor rank 0, data rank 0) for every
        pipeline stage s (collective: every rank calls it once)."""
        import torch
        import torch.distributed as dist

        mine = self.tp_rank == 0 and self.dp_rank == 0
        vec = torch.tensor(
            [self.rank if (mine and s == self.pipe.rank) else -1 for s in range(self.pp)], dtype=torch.long
        ).to(_host_or_device())
        dist.all_reduce(vec, op=dist.ReduceOp.MAX)
        return [int(x) for x in vec.tolist()]

    def weight_sample(self, positions: dict[str, list[int]]) -> dict[str, Any] | None:
        """The weight-delivery check's sample (rank 0; None elsewhere). The
        HF tensors come out of ``iter_hf``, a collective walk over every
        tensor (the gathers of one tensor involve its owners), so the walk
        is whole; only the sampled tensors' elements are kept."""
        from areal_kernel.utils.tensor_sample import sample_named

        picked = [(n, t.clone()) for n, t in self.iter_hf() if self.rank == 0 and n in positions]
        return sample_named(picked, positions) if self.rank == 0 else None

    def full_weights(self) -> list[tuple[str, Any]] | None:
        named = [(n, t.clone()) for n, t in self.iter_hf()]
        return named if self.rank == 0 else None

    def export_hf(self, tmp_dir: str, shard_bytes: int) -> dict[str, Any]:
        """Write an HF directory into ``tmp_dir``: one safetensors file of at
        most ``shard_bytes`` at a time gathered on rank 0 and written there."""
        from areal_kernel.engine.hf import finish_hf_dir, hf_files, write_hf_weights

        plan = hf_files(self.transfer_meta, shard_bytes)
        it = self.iter_hf()
        files: dict[str, dict[str, Any]] = {}
        for fname, names in plan:
            if self.rank == 0:
                named = [next(it) for _ in names]
                assert [n for n, _ in named] == names
                files[fname] = write_hf_weights(tmp_dir, fname, named)
        for _ in it:  # the other ranks' side of the remaining transfers
            pass
        if self.rank == 0:
            finish_hf_dir(tmp_dir, self._hf_shell(), files, self.model_path)
        self.barrier()
        return {"files": len(plan)}

    def _hf_shell(self) -> Any:
        """An HF model of the source config on the meta device: what the
        kernel's HF writer reads the config, class and dtype from."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        assert self.model_path is not None
        hf_cfg = AutoConfig.from_pretrained(self.model_path)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(hf_cfg, dtype=torch_dtype(self.config.param_dtype))

    def init_weight_group(
        self, master_addr: str, master_port: int, world_size: int, rank: int = 0,
        group_name: str = "areal_weights", backend: str | None = None, timeout_s: float = 300,
    ) -> None:  # fmt: skip
        from areal_kernel.weights.broadcast import init_weight_group

        if self.rank == 0:
            self.weight_group = init_weight_group(
                master_addr, master_port, world_size, rank, group_name, backend=backend, timeout_s=timeout_s
            )

    def broadcast_weights(self, bucket_bytes: int) -> dict[str, Any]:
        """Stream the HF weights to the servers in buckets of at most
        ``bucket_bytes``: rank 0 collects one planned bucket from the
        gathers, sends it over the weight group, then the next (its memory
        stays bounded by one bucket plus one tensor)."""
        from areal_kernel.weights.broadcast import plan_buckets, send_buckets

        if self.rank == 0 and self.weight_group is None:
            raise ArealError("broadcast needs the weight group: call init_weight_group(...) first")
        it = self.iter_hf()
        n = 0
        for bucket in plan_buckets(self.transfer_meta, bucket_bytes):
            if self.rank == 0:
                named = [next(it) for _ in bucket]
                send_buckets(self.weight_group, named, bucket_bytes)
                del named
            n += 1
        for _ in it:
            pass
        current_platform().synchronize()
        return {"buckets": n}

    # ------------------------------------------------------------- checkpoint
    def dist_save(self, tmp_dir: str) -> None:
        """The model through megatron-core's distributed checkpointing (every
        rank writes its shards; loadable into another layout), the optimizer
        and RNG states per rank."""
        from megatron.core import dist_checkpointing

        d = os.path.join(tmp_dir, "model")
        if self.rank == 0:
            os.makedirs(d, exist_ok=True)
        self.barrier()
        dist_checkpointing.save(self.model.sharded_state_dict(), d)
        tag = f"tp{self.tp_rank}-pp{self.pipe.rank}"
        if self.dp_rank == 0:
            # Tensors as safetensors, the rest as JSON: a checkpoint never
            # carries a pickle (the kernel's rule for every engine).
            rest = save_optimizer_state(self.optimizer, os.path.join(tmp_dir, f"optim-{tag}.safetensors"))
            with open(os.path.join(tmp_dir, f"optim-{tag}.json"), "w", encoding="utf-8") as f:
                json.dump(rest, f)
        save_rng_state(os.path.join(tmp_dir, f"rng-rank{self.rank}.safetensors"))
        self.barrier()

    def dist_load(self, path: str, step: int) -> None:
        from megatron.core import dist_checkpointing

        sd = dist_checkpointing.load(self.model.sharded_state_dict(), os.path.join(path, "model"))
        self.model.load_state_dict(sd)
        tag = f"tp{self.tp_rank}-pp{self.pipe.rank}"
        optim = os.path.join(path, f"optim-{tag}.safetensors")
        if not os.path.isfile(optim):
            raise ConfigError(
                f"{path}: no optimizer state for tensor rank {self.tp_rank}, pipeline stage {self.pipe.rank}; "
                "a megatron checkpoint restores its optimizer only into the t and p layout that saved it"
            )
        with open(os.path.join(path, f"optim-{tag}.json"), encoding="utf-8") as f:
            rest = json.load(f)
        load_optimizer_state(self.optimizer, optim, rest, str(next(self.model.parameters()).device))
        rng = os.path.join(path, f"rng-rank{self.rank}.safetensors")
        if os.path.isfile(rng):
            load_rng_state(rng)
        self.step = int(step)
        self.barrier()

    def destroy(self) -> None:
        """Drop the model and Megatron's parallel state (the process may
        build another layout next)."""
        import gc

        from megatron.core import parallel_state as ps
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        self.model = self.optimizer = self.runner = None
        RotaryEmbedding.forward.cache_clear()  # its cache holds the module instances
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        gc.collect()


def make_rank_engine(rank: int, world_size: int, config: dict[str, Any], tp: int, pp: int) -> MegatronRankEngine:
    return MegatronRankEngine(config, rank, world_size, tp=tp, pp=pp)


def main(argv: list[str] | None = None) -> int:
    from areal_kernel.engine.ranks import rank_main

    return rank_main(make_rank_engine, "megatron", argv)


if __name__ == "__main__":
    sys.exit(main())
