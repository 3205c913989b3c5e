"""The N-D train engines on CPU: training tokens/s of megatron t2, d2 and p2
and areal-fsdp d2, t2 (DTensor tensor parallel) and p2 (torch.distributed.pipelining,
1F1B) against the kernel's single-process torch engine, on the same batches.

    .venv/bin/python bench/bench_megatron.py [--steps 3] [--layers 30]

The model is a random-init Llama of SmolLM2-135M's width and depth (hidden
576, 30 layers, vocab 49152) with 8 attention heads / 4 KV heads instead of
9 / 3, so that 2 tensor-parallel ranks can split it (SmolLM2-135M's 9 heads
cannot be split t2). Every process runs single-threaded (OMP_NUM_THREADS=1):
on a 2-core machine two ranks can at best double one process. Numbers are
medians of ``--steps`` timed steps after one warm-up step; batches are GRPO-
shaped. Megatron runs padded micro-batches (no shared-prompt rows), so the
engines run with ``share_prompts: false`` here for a like-for-like count.
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
    from areal_kernel.testing.models import make_tiny_llama

    ap = argparse.ArgumentParser()
    add_batch_args(ap)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--only", default="", help="comma-separated subset of engine names")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-megatron-")
    vocab = 49152
    model_dir = make_tiny_llama(os.path.join(tmp, "model"), vocab_size=vocab, hidden=576, layers=args.layers,
                                heads=8, kv_heads=4, seed=0)  # fmt: skip
    batches = timed_batches(args, vocab)
    loss_fn = make_ppo_loss_fn(eps_clip=0.2)
    cfg = {"lr": 1e-6, "max_tokens_per_mb": 2048, "share_prompts": False}
    engines = {
        "torch (1 process)": lambda: TorchTrainEngine(cfg),
        "fsdp d2": lambda: FSDPTrainEngine(cfg, world_size=2),
        "fsdp t2": lambda: FSDPTrainEngine(cfg, "fsdp:t2"),
        "fsdp p2": lambda: FSDPTrainEngine(cfg, "fsdp:p2"),
        "megatron d2": lambda: MegatronTrainEngine(cfg, "megatron:d2"),
        "megatron t2": lambda: MegatronTrainEngine(cfg, "megatron:t2"),
        "megatron p2": lambda: MegatronTrainEngine(cfg, "megatron:p2"),
    }
    only = [x.strip() for x in args.only.split(",") if x.strip()]
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

    print(f"\nmodel: random Llama hidden 576, {args.layers} layers, 8 heads / 4 KV heads, vocab {vocab}; batch "
          f"{args.groups} groups x {args.group} samples, prompt {args.prompt_len}, answers 4..{args.max_answer} "
          f"({batches[1].n_tokens} tokens/step); OMP_NUM_THREADS=1 per process\n")  # fmt: skip
    base = {n: tps for n, _, tps in rows}
    torch_tps, fsdp_tps = base.get("torch (1 process)"), base.get("fsdp d2")
    print("| engine | s/step (median) | tokens/s | vs torch | vs fsdp d2 |")
    print("|---|---|---|---|---|")
    for name, s, tps in rows:
        vt = f"{tps / torch_tps:.2f}" if torch_tps else "-"
        vf = f"{tps / fsdp_tps:.2f}" if fsdp_tps else "-"
        print(f"| {name} | {s:.2f} | {tps:.0f} | {vt} | {vf} |")
    for name, _, tps in rows:
        if (name.startswith("megatron") or name in ("fsdp t2", "fsdp p2")) and fsdp_tps:
            report(f"{name} / fsdp d2 tokens/s", tps / fsdp_tps)


if __name__ == "__main__":
    main()
