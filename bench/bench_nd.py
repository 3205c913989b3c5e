"""The N-D train engines on CPU, side by side on the same batches: training
tokens/s of every layout of the torch-native engine (areal-fsdp: d2, t2
(DTensor tensor parallel, vocabulary split too), d2t2 (4 ranks), p2 with 1F1B and interleaved 1F1B
(torch.distributed.pipelining), c2 (context parallel)) and of megatron-core (d2, t2, p2), against the
kernel's single-process torch engine and ``fsdp:d2``; then, on a mixture-of-
experts model, ``fsdp:d2e2`` (expert parallel) against ``fsdp:d2``.

    .venv/bin/python bench/bench_nd.py [--steps 3] [--layers 30] [--only "fsdp d2,fsdp t2"]

The dense model is a random-init Llama of SmolLM2-135M's width and depth
(hidden 576, 30 layers, vocab 49152) with 8 attention heads / 4 KV heads
instead of 9 / 3, so that 2 tensor-parallel ranks can split it (SmolLM2-135M's
9 heads cannot be split t2). The MoE model is a random Qwen3-MoE (hidden 256,
4 layers, 16 experts, top-2, vocab 4096). Every process runs single-threaded
(OMP_NUM_THREADS=1): on a 2-core machine two ranks can at best double one
process, and a 4-rank layout shares 2 cores among 4. Numbers are medians of
``--steps`` timed steps after one warm-up step; batches are GRPO-shaped.
Megatron runs padded micro-batches (no shared-prompt rows), so the engines
run with ``share_prompts: false`` here for a like-for-like count.
"""

from __future__ import annotations

import argparse
import os
import tempfile

from bench_fsdp import add_batch_args, time_training, timed_batches
from summary import report

os.environ.setdefault("OMP_NUM_THREADS", "1")


def main() -> None:
    from areal_fsdp.engine import FSDPTrainEngine
    from areal_megatron.engine import MegatronTrainEngine

    from areal_kernel.algo.losses import make_ppo_loss_fn
    from areal_kernel.engine.torch_engine import TorchTrainEngine
    from areal_kernel.testing.models import make_tiny_llama, make_tiny_qwen3_moe

    ap = argparse.ArgumentParser()
    add_batch_args(ap)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--only", default="", help="comma-separated subset of engine names")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-nd-")
    vocab = 49152
    model_dir = make_tiny_llama(os.path.join(tmp, "model"), vocab_size=vocab, hidden=576, layers=args.layers,
                                heads=8, kv_heads=4, seed=0)  # fmt: skip
    batches = timed_batches(args, vocab)
    loss_fn = make_ppo_loss_fn(eps_clip=0.2)
    cfg = {"lr": 1e-6, "max_tokens_per_mb": 2048, "share_prompts": False}
    interleaved = {**cfg, "pipeline_schedule": "interleaved_1f1b"}
    engines = {
        "torch (1 process)": lambda: TorchTrainEngine(cfg),
        "fsdp d2": lambda: FSDPTrainEngine(cfg, world_size=2),
        "fsdp t2": lambda: FSDPTrainEngine(cfg, "fsdp:t2"),
        "fsdp d2t2": lambda: FSDPTrainEngine(cfg, "fsdp:d2t2"),
        "fsdp p2": lambda: FSDPTrainEngine(cfg, "fsdp:p2"),
        "fsdp p2 interleaved": lambda: FSDPTrainEngine(interleaved, "fsdp:p2"),
        "fsdp c2": lambda: FSDPTrainEngine(cfg, "fsdp:c2"),
        "megatron d2": lambda: MegatronTrainEngine(cfg, "megatron:d2"),
        "megatron t2": lambda: MegatronTrainEngine(cfg, "megatron:t2"),
        "megatron p2": lambda: MegatronTrainEngine(cfg, "megatron:p2"),
    }
    only = [x.strip() for x in args.only.split(",") if x.strip()]
    rows = _time_all(engines, only, model_dir, batches, loss_fn)
    print(f"\nmodel: random Llama hidden 576, {args.layers} layers, 8 heads / 4 KV heads, vocab {vocab}; batch "
          f"{args.groups} groups x {args.group} samples, prompt {args.prompt_len}, answers 4..{args.max_answer} "
          f"({batches[1].n_tokens} tokens/step); OMP_NUM_THREADS=1 per process\n")  # fmt: skip
    _table(rows, "fsdp d2")
    fsdp_tps = dict((n, t) for n, _, t in rows).get("fsdp d2")
    for name, _, tps in rows:
        if name not in ("torch (1 process)", "fsdp d2") and fsdp_tps:
            report(f"{name} / fsdp d2 tokens/s", tps / fsdp_tps)

    # Mixture of experts: expert parallel against plain data parallel.
    moe_vocab = 4096
    moe_dir = make_tiny_qwen3_moe(os.path.join(tmp, "moe"), vocab_size=moe_vocab, hidden=256, layers=4, experts=16,
                                  top_k=2, moe_intermediate=128, heads=4, kv_heads=2, seed=0)  # fmt: skip
    moe_batches = timed_batches(args, moe_vocab)
    moe_engines = {
        "torch (1 process) moe": lambda: TorchTrainEngine(cfg),
        "fsdp d2 moe": lambda: FSDPTrainEngine(cfg, world_size=2),
        "fsdp d2e2 moe": lambda: FSDPTrainEngine(cfg, "fsdp:d2e2"),
    }
    moe_rows = _time_all(moe_engines, only, moe_dir, moe_batches, loss_fn)
    print(f"\nmodel: random Qwen3-MoE hidden 256, 4 layers, 16 experts (top 2, intermediate 128), vocab {moe_vocab}; "
          f"{moe_batches[1].n_tokens} tokens/step\n")  # fmt: skip
    _table(moe_rows, "fsdp d2 moe")
    moe = dict((n, t) for n, _, t in moe_rows)
    if "fsdp d2 moe" in moe and "fsdp d2e2 moe" in moe:
        report("fsdp d2e2 / fsdp d2 tokens/s (MoE)", moe["fsdp d2e2 moe"] / moe["fsdp d2 moe"])


def _time_all(engines: dict, only: list[str], model_dir: str, batches: list, loss_fn: object) -> list:
    rows = []
    for name, make in engines.items():
        if only and name not in only:
            continue
        eng = make()
        eng.initialize(model_dir, 100)
        try:
            s, tps = time_training(eng, batches, loss_fn)
        finally:
            eng.destroy()
        rows.append((name, s, tps))
        print(f"{name}: {s:.2f} s/step, {tps:.0f} tokens/s", flush=True)
    return rows


def _table(rows: list, ref: str) -> None:
    base = {n: tps for n, _, tps in rows}
    torch_tps = next((t for n, t in base.items() if n.startswith("torch")), None)
    ref_tps = base.get(ref)
    print(f"| engine | s/step (median) | tokens/s | vs torch | vs {ref} |")
    print("|---|---|---|---|---|")
    for name, s, tps in rows:
        vt = f"{tps / torch_tps:.2f}" if torch_tps else "-"
        vf = f"{tps / ref_tps:.2f}" if ref_tps else "-"
        print(f"| {name} | {s:.2f} | {tps:.0f} | {vt} | {vf} |")


if __name__ == "__main__":
    main()
