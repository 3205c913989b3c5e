"""One FSDP rank: ``python -m areal_fsdp.rank`` (started by the scheduler).

The process joins the torch.distributed default group from the environment
the scheduler set (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...), connects
to the controller's control socket, and executes the commands the
controller's ``FSDPTrainEngine`` sends, every rank the same command (each on
its share of the data), so the collectives of FSDP line up.

``FSDPRankEngine`` is the kernel's ``TorchTrainEngine`` with the model
sharded by ``fully_shard``: packing, the shared-prompt plan, the forward
(logprobs/entropy), the lr schedule and the stats rules are inherited; what
sharding changes (equal micro-batch counts on every rank, summed instead of
averaged gradients, the global grad norm, gathered exports, DCP) is here.

A rank exits when its control connection closes or when the controller (its
parent) disappears, so no rank outlives the run that started it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import sys
import threading
import time
import traceback
from typing import Any, Callable

from areal_kernel.api.io import TrajectoryBatch
from areal_kernel.engine.packing import pack_row
from areal_kernel.engine.torch_engine import _WEIGHT_SUFFIXES, TorchTrainEngine
from areal_kernel.errors import ArealError, ConfigError
from areal_kernel.platforms import current_platform

from areal_fsdp.config import FSDPEngineConfig

CONTROL_ENV = "AREAL_FSDP_CONTROL"
AUTHKEY_ENV = "AREAL_FSDP_AUTHKEY"


def _torch_dtype(name: str | None) -> Any:
    import torch

    return None if name is None else getattr(torch, name)


def _local(t: Any) -> Any:
    """The rank-local part of a (possibly DTensor) tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def _full(t: Any) -> Any:
    """The whole tensor (an all-gather for a sharded DTensor: every rank must call it)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class FSDPRankEngine(TorchTrainEngine):
    """The model shard and optimizer of one rank."""

    def __init__(self, config: FSDPEngineConfig | dict[str, Any] | None, rank: int, world_size: int) -> None:
        super().__init__(FSDPEngineConfig.parse(config))
        self.config: FSDPEngineConfig
        self.rank = rank
        self.world_size = world_size
        self.transfer_meta: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ setup
    def initialize(self, model_path: str, total_train_steps: int) -> dict[str, Any]:
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

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
        dtype = torch.float32 if cfg.param_dtype == "float32" else torch.bfloat16
        # Every rank reads the (memory-mapped) safetensors and keeps only its
        # shard after fully_shard; the full copy is transient.
        model = self._load_model(model_path, dtype)
        model.to(self.device)
        # What exports and broadcasts send, in order (tied aliases dropped), from
        # the unsharded model: the same list the single-process engine sends.
        self.model = model
        self.transfer_meta = tensor_meta(TorchTrainEngine.named_weights_for_transfer(self))
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

        mesh = init_device_mesh(plat.device_type, (self.world_size,))
        mp = cfg.mixed_precision
        mp_policy = MixedPrecisionPolicy(
            param_dtype=_torch_dtype(mp.param_dtype),
            reduce_dtype=_torch_dtype(mp.reduce_dtype),
            output_dtype=_torch_dtype(mp.output_dtype),
            cast_forward_inputs=mp.cast_forward_inputs,
        )
        # Offloading moves shards from the accelerator to host memory; where
        # they are in host memory already (and FSDP's policy refuses a cpu
        # device) the platform says it cannot, and it is a no-op there.
        offload = CPUOffloadPolicy() if cfg.cpu_offload and plat.supports_cpu_offload else OffloadPolicy()
        kw = dict(mesh=mesh, reshard_after_forward=cfg.reshard_after_forward, mp_policy=mp_policy, offload_policy=offload)
        wrapped = 0
        if cfg.wrap_policy == "decoder_layer":
            block_names = set(getattr(model, "_no_split_modules", None) or [])
            for m in list(model.modules()):
                if type(m).__name__ in block_names:
                    fully_shard(m, **kw)
                    wrapped += 1
        fully_shard(model, **kw)
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
        self.model_path = os.path.abspath(model_path)
        self.total_train_steps = int(total_train_steps)
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=cfg.lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
        )
        self._step = 0
        self._set_lr()
        return {"transfer_meta": self.transfer_meta, "wrapped_blocks": wrapped}

    def _head_split(self) -> None:
        """Always run the whole model. The kernel engine may call the decoder and
        the LM head separately (head on loss positions only); under FSDP that
        would bypass the root unit's hooks, which gather the embedding, final
        norm and head, so the sharded model is only called as a whole."""
        return None

    # ------------------------------------------------------------ collectives
    def _all_reduce(self, values: list[float], op: str) -> list[float]:
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
        return t.cpu().tolist()

    def _comm_device(self) -> Any:
        import torch

        return torch.device("cpu") if current_platform().collectives_on_host else self.device

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    # The kernel engine's shared-prompt plan (``_plan``/``_tree``) is used when
    # the installed kernel has it; plain packing otherwise.
    def _mb_plan(self, part: TrajectoryBatch) -> list[tuple[list[int], Any]]:
        plan = getattr(self, "_plan", None)
        if plan is not None:
            return plan(part)
        return [(mb, None) for mb in self._micro_batches(part)]

    def _tree_row(self, chunks: Any, ids: list[list[int]]) -> Any:
        return self._tree(chunks, ids) if chunks is not None else None

    def _fwd(self, row: Any, *, entropy_grad: bool, scored: Any = None, tree: Any = None) -> tuple[Any, Any]:
        if tree is None:
            return self._forward(row, entropy_grad=entropy_grad, scored=scored)
        return self._forward(row, entropy_grad=entropy_grad, scored=scored, tree=tree)

    def _padded_plan(self, part: TrajectoryBatch) -> tuple[list[Any], int]:
        """This rank's micro-batch plan and the number of micro-batches every
        rank runs (the maximum): FSDP gathers parameters in each forward, so all
        ranks must run the same number of forwards and backwards."""
        plan = self._mb_plan(part) if len(part) else []
        n = int(self._all_reduce([float(len(plan))], "max")[0])
        return plan, n

    def _filler_forward(self, entropy_grad: bool = False) -> Any:
        """A 2-token forward whose output only serves to keep this rank in step
        with ranks that have more micro-batches (its loss is 0)."""
        row = pack_row([0], [[0, 0]], {}, {}, self.device)
        lp, _ = self._fwd(row, entropy_grad=entropy_grad)
        return lp

    # ---------------------------------------------------------------- scoring
    def score_part(self, part: TrajectoryBatch, only_loss_tokens: bool, with_entropy: bool) -> tuple[list, list | None]:
        import torch

        ids = [t.input_ids for t in part.trajectories]
        out_lp: list[list[float]] = [[] for _ in ids]
        out_ent: list[list[float]] = [[] for _ in ids]
        plan, n_mbs = self._padded_plan(part)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for j in range(n_mbs):
                    if j >= len(plan):
                        self._filler_forward()
                        continue
                    mb, chunks = plan[j]
                    tree = self._tree_row(chunks, ids)
                    if only_loss_tokens:
                        masks = {"loss_mask": [[1.0 if m else 0.0 for m in t.loss_mask] for t in part.trajectories]}
                        row = pack_row(mb, ids, masks, {}, self.device)
                        lp, ent = self._fwd(row, entropy_grad=False, scored=row.data["loss_mask"] > 0, tree=tree)
                    else:
                        row = pack_row(mb, ids, {}, {}, self.device)
                        lp, ent = self._fwd(row, entropy_grad=False, tree=tree)
                    lp_l, ent_l = lp.cpu().tolist(), ent.cpu().tolist()
                    for k, i in enumerate(row.seq_index):
                        a, b = row.cu_seqlens[k], row.cu_seqlens[k + 1]
                        out_lp[i] = lp_l[a:b]
                        out_ent[i] = ent_l[a:b]
        finally:
            self.model.train(was_training)
        return out_lp, (out_ent if with_entropy else None)

    # --------------------------------------------------------------- training
    def train_part(
        self,
        part: TrajectoryBatch,
        global_index: list[int],
        loss_fn: Callable[..., Any],
        extra: dict[str, list[list[float]]] | None,
        batch_loss_tokens: int,
        batch_n_seqs: int,
    ) -> dict[str, Any]:
        """This rank's share of one optimizer step. ``part`` holds the
        trajectories ``global_index`` of the batch; the loss normalisers are
        the whole batch's, so summing every rank's gradients gives the
        single-process gradient."""
        import torch

        t0 = time.perf_counter()
        trajs = part.trajectories
        loss_tokens = [int(sum(1 for m in t.loss_mask if m)) for t in trajs]
        ids = [t.input_ids for t in trajs]
        float_fields: dict[str, list[list[float]]] = {
            "loss_mask": [[1.0 if m else 0.0 for m in t.loss_mask] for t in trajs],
            "old_logprobs": [list(t.logprobs) for t in trajs],
            "rewards": [[float(t.reward)] * len(t.input_ids) for t in trajs],
            "seq_loss_tokens": [[float(max(c, 1))] * len(t.input_ids) for c, t in zip(loss_tokens, trajs)],
        }
        float_fields.update(extra or {})
        long_fields = {"versions": [list(t.versions) for t in trajs]}
        dev = self.device
        batch_scalars = {
            "batch_loss_tokens": torch.tensor(float(batch_loss_tokens), device=dev),
            "batch_n_seqs": torch.tensor(float(batch_n_seqs), device=dev),
        }
        to_global = torch.tensor(global_index or [0], dtype=torch.long, device=dev)
        entropy_grad = bool(getattr(loss_fn, "needs_entropy_grad", False))

        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self._set_lr()
        plan, n_mbs = self._padded_plan(part)
        total_loss = 0.0
        entropy_sum = 0.0
        stats: dict[str, float] = {}
        finite = True
        model_tokens = 0
        for j in range(n_mbs):
            if j >= len(plan):
                (self._filler_forward() * 0.0).sum().backward()
                continue
            mb, chunks = plan[j]
            row = pack_row(mb, ids, float_fields, long_fields, dev)
            tree = self._tree_row(chunks, ids)
            model_tokens += (tree or row).n_tokens
            data = dict(row.data)
            # Loss functions see batch-wide sequence ids, as in one process.
            data["seq_ids"] = to_global.index_select(0, data["seq_ids"])
            data.update(batch_scalars)
            logprobs, entropy = self._fwd(row, entropy_grad=entropy_grad, scored=data["loss_mask"] > 0, tree=tree)
            loss, mb_stats = loss_fn(logprobs, entropy, data)
            loss_val = float(loss.detach()) if torch.is_tensor(loss) else float(loss)
            if not math.isfinite(loss_val):
                finite = False
            # Every rank must run every backward (each one reduce-scatters), even
            # after a non-finite loss: the step is then skipped on all ranks.
            if torch.is_tensor(loss) and loss.requires_grad:
                loss.backward()
            else:
                (logprobs * 0.0).sum().backward()
            total_loss += loss_val
            with torch.no_grad():
                entropy_sum += float((entropy.detach() * data["loss_mask"]).sum())
            self._merge_stats(stats, mb_stats or {})

        finite = self._all_reduce([1.0 if finite else 0.0], "min")[0] > 0
        grad_norm = float("nan")
        if finite:
            grad_norm = self._clip_grad_norm()
            finite = math.isfinite(grad_norm)
        if finite:
            self.optimizer.step()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        self._step += 1
        current_platform().synchronize()
        return {
            "loss": total_loss,
            "entropy_sum": entropy_sum,
            "stats": stats,
            "grad_norm": grad_norm,
            "skipped": 0.0 if finite else 1.0,
            "lr": lr,
            "n_mbs": float(len(plan)),
            "n_model_tokens": float(model_tokens),
            "step_time_s": time.perf_counter() - t0,
        }

    def _clip_grad_norm(self) -> float:
        """Global L2 norm of the sharded gradients (each rank sums the squares
        of its shards, one all-reduce adds them up), then clip every shard by
        the same factor. Returns the norm before clipping."""
        import torch

        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        local = 0.0
        if grads:
            sq = torch.stack([_local(g).detach().float().pow(2).sum() for g in grads]).sum()
            local = float(sq)
        total = math.sqrt(self._all_reduce([local], "sum")[0])
        max_norm = self.config.max_grad_norm
        if max_norm is not None and max_norm > 0 and math.isfinite(total):
            coef = max_norm / (total + 1e-6)
            if coef < 1.0:
                with torch.no_grad():
                    for g in grads:
                        _local(g).mul_(coef)
        return total

    # ---------------------------------------------------------------- weights
    def _named_sharded(self) -> dict[str, Any]:
        return dict(self.model.state_dict())

    def _gather_group(self, sd: dict[str, Any], names: list[str]) -> list[tuple[str, Any]]:
        """All-gather ``names`` (collective); only rank 0 keeps the results."""
        out = []
        for name in names:
            full = _full(sd[name]).detach()
            if self.rank == 0:
                out.append((name, full.to("cpu")))  # no copy when it is a host tensor already
            del full
        return out

    def export_hf(self, tmp_dir: str, shard_bytes: int) -> dict[str, Any]:
        """Write an HF directory into ``tmp_dir``: rank 0 gathers at most
        ``shard_bytes`` of weights at a time and writes them as one
        safetensors file, so its memory stays bounded by one file."""
        from safetensors.torch import save_file

        from areal_kernel.weights.broadcast import plan_buckets

        sd = self._named_sharded()
        meta = self.transfer_meta
        shards = plan_buckets(meta, shard_bytes)
        files = (
            ["model.safetensors"]
            if len(shards) == 1
            else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        )
        weight_map: dict[str, str] = {}
        total = 0
        for fname, shard in zip(files, shards):
            named = self._gather_group(sd, [meta[i]["name"] for i in shard])
            if self.rank == 0:
                tensors = {n: t.contiguous() for n, t in named}
                total += sum(t.numel() * t.element_size() for t in tensors.values())
                save_file(tensors, os.path.join(tmp_dir, fname), metadata={"format": "pt"})
                weight_map.update({n: fname for n in tensors})
            del named
        if self.rank == 0:
            if len(files) > 1:
                with open(os.path.join(tmp_dir, "model.safetensors.index.json"), "w") as f:
                    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
            self.model.config.save_pretrained(tmp_dir)
            gen = getattr(self.model, "generation_config", None)
            if gen is not None:
                gen.save_pretrained(tmp_dir)
            self._copy_side_files(tmp_dir)
        self.barrier()
        return {"files": len(files)}

    def _copy_side_files(self, tmp_dir: str) -> None:
        """Tokenizer, chat template etc. from the source model dir (weights and
        configs are written fresh)."""
        import shutil

        src = self.model_path
        if not src or not os.path.isdir(src):
            return
        for name in os.listdir(src):
            s = os.path.join(src, name)
            if not os.path.isfile(s) or name.endswith(_WEIGHT_SUFFIXES) or os.path.exists(os.path.join(tmp_dir, name)):
                continue
            shutil.copy2(s, os.path.join(tmp_dir, name))

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
        # Only rank 0 talks to the inference servers; the other ranks help gather.
        if self.rank == 0:
            super().init_weight_group(master_addr, master_port, world_size, rank, group_name, backend, timeout_s)

    def broadcast_weights(self, bucket_bytes: int) -> dict[str, Any]:
        """Stream the full weights to the servers in buckets of at most
        ``bucket_bytes``: every rank helps all-gather one bucket, rank 0 sends
        it over the weight group, then the next. The receivers plan the same
        buckets from the same metadata (``plan_buckets``)."""
        from areal_kernel.weights.broadcast import plan_buckets, send_buckets

        if self.rank == 0 and self._weight_group is None:
            raise ArealError("broadcast needs the weight group: call init_weight_group(...) first")
        sd = self._named_sharded()
        meta = self.transfer_meta
        n_buckets = 0
        for bucket in plan_buckets(meta, bucket_bytes):
            named = self._gather_group(sd, [meta[i]["name"] for i in bucket])
            if self.rank == 0:
                # One planned bucket re-plans to exactly one bucket on this sub-list.
                send_buckets(self._weight_group, named, bucket_bytes)
            del named
            n_buckets += 1
        current_platform().synchronize()
        return {"buckets": n_buckets}

    def full_weights(self) -> list[tuple[str, Any]] | None:
        """The gathered weights (rank 0; None elsewhere): for tests and small models."""
        named = self._gather_group(self._named_sharded(), [m["name"] for m in self.transfer_meta])
        return named if self.rank == 0 else None

    # ------------------------------------------------------------- checkpoint
    def dcp_save(self, tmp_dir: str) -> None:
        import torch
        import torch.distributed.checkpoint as dcp
        from safetensors.torch import save_file
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(tmp_dir, "dcp"))
        rng = {"torch_cpu": torch.get_rng_state()}
        dev_rng = current_platform().device_rng_state()
        if dev_rng is not None:
            rng["device"] = dev_rng
        save_file(rng, os.path.join(tmp_dir, f"rng-rank{self.rank}.safetensors"))
        self.barrier()

    def dcp_load(self, path: str, step: int) -> None:
        import torch
        import torch.distributed.checkpoint as dcp
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(self.model, self.optimizer)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=os.path.join(path, "dcp"))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        rng_path = os.path.join(path, f"rng-rank{self.rank}.safetensors")
        if os.path.isfile(rng_path):  # absent when resuming with more ranks than were saved
            rng = load_file(rng_path)
            torch.set_rng_state(rng["torch_cpu"])
            current_platform().set_device_rng_state(rng.get("device"))
        self._step = int(step)
        self._set_lr()
        self.barrier()

    def get_step(self) -> int:
        return self._step

    def destroy(self) -> None:
        self.model = None
        self.optimizer = None
        self._weight_group = None


# ---------------------------------------------------------------- the process
def _watch_parent(parent_pid: int) -> None:
    """Exit when the controller is gone (we were re-parented)."""
    while True:
        if os.getppid() != parent_pid:
            print("fsdp rank: controller process is gone; exiting", file=sys.stderr, flush=True)
            os._exit(3)
        time.sleep(0.5)


def _serve(conn: Any, rank: int, world_size: int) -> None:
    import cloudpickle

    engine: FSDPRankEngine | None = None
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            return  # the controller closed the channel (or died)
        cmd, kwargs = cloudpickle.loads(msg)
        try:
            if cmd == "shutdown":
                conn.send_bytes(pickle.dumps(("ok", None)))
                return
            if cmd == "create":
                engine = FSDPRankEngine(kwargs["config"], rank, world_size)
                result: Any = None
            else:
                if engine is None:
                    raise ArealError("fsdp rank: engine not created")
                result = getattr(engine, cmd)(**kwargs)
            reply = ("ok", result)
        except BaseException as e:  # noqa: BLE001 - everything goes back to the controller
            tb = traceback.format_exc()
            try:
                pickle.dumps(e)
                exc: Any = e
            except Exception:  # noqa: BLE001
                exc = None
            reply = ("err", (exc, f"{type(e).__name__}: {e}", tb))
            print(tb, file=sys.stderr, flush=True)
        conn.send_bytes(pickle.dumps(reply))


def main(argv: list[str] | None = None) -> int:
    from multiprocessing.connection import Client

    p = argparse.ArgumentParser(description="one rank of the areal-fsdp train engine")
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--dist-timeout-s", type=float, default=1800.0)
    args = p.parse_args(argv)
    threading.Thread(target=_watch_parent, args=(args.parent_pid,), daemon=True).start()

    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, _, port = os.environ[CONTROL_ENV].rpartition(":")
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ.pop(AUTHKEY_ENV)))
    conn.send_bytes(pickle.dumps(("hello", rank, os.getpid())))
    plat = current_platform()
    # The scheduler made exactly this rank's device visible (a no-op on host cores).
    plat.set_device(0)
    dist.init_process_group(
        backend=plat.dist_backend, timeout=datetime.timedelta(seconds=args.dist_timeout_s)
    )
    try:
        _serve(conn, rank, world_size)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
