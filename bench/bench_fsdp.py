"""areal-fsdp on CPU: training throughput of 2 FSDP ranks vs 1 rank (and the
kernel's single-process torch engine), HF export latency (rank 0 streams
the gathered weights to safetensors) and in-memory broadcast latency to one
embedded server (buckets gathered from the shards, sent over gloo).

    .venv/bin/python bench/bench_fsdp.py [--model smollm2-135m-instruct] [--steps 3]

Every process runs single-threaded (OMP_NUM_THREADS=1): on a 2-core machine
two ranks can at best double the throughput of one. Numbers are medians of
``--steps`` timed steps after one warm-up step; batches are GRPO-shaped
(groups of ``--group`` samples sharing a prompt, variable answer lengths).
Needs the areal-fsdp plugin installed (``pip install -e plugins/areal-fsdp``).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from summary import report  # bench/summary.py: one table of ratios for `make bench`

os.environ.setdefault("OMP_NUM_THREADS", "1")


def make_batch(n_groups: int, group: int, prompt_len: int, max_answer: int, vocab: int, seed: int):
    from areal_kernel.api.io import Trajectory, TrajectoryBatch

    rng = random.Random(seed)
    trajs = []
    for g in range(n_groups):
        prompt = [rng.randrange(10, vocab) for _ in range(prompt_len)]
        for k in range(group):
            ans = [rng.randrange(10, vocab) for _ in range(rng.randint(4, max_answer))]
            n = len(prompt) + len(ans)
            trajs.append(Trajectory(prompt + ans, [0] * len(prompt) + [1] * len(ans),
                                    [0.0] * len(prompt) + [-2.0] * len(ans), [-1] * len(prompt) + [0] * len(ans),
                                    reward=float(k % 2), group_id=f"g{g}"))  # fmt: skip
            assert len(trajs[-1].input_ids) == n
    return TrajectoryBatch(trajs)


def add_batch_args(ap: argparse.ArgumentParser) -> None:
    """The step and batch-shape options of the engine benches (``timed_batches``)."""
    ap.add_argument("--steps", type=int, default=3, help="timed steps per engine (after one warm-up)")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=44)
    ap.add_argument("--max-answer", type=int, default=24)


def timed_batches(args: argparse.Namespace, vocab: int) -> list:
    """One warm-up batch and ``args.steps`` timed ones, shaped by ``add_batch_args``' options."""
    return [make_batch(args.groups, args.group, args.prompt_len, args.max_answer, vocab, s) for s in range(args.steps + 1)]


def time_training(engine, batches, loss_fn) -> tuple[float, float]:
    """(median seconds per step, tokens per second) over ``batches[1:]`` (``batches[0]`` warms up)."""
    times = []
    for i, b in enumerate(batches):
        adv = {"advantages": [[(1.0 if t.reward > 0 else -1.0) * m for m in t.loss_mask] for t in b.trajectories]}
        t0 = time.perf_counter()
        engine.train_batch(b, loss_fn, adv)
        if i:
            times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return med, batches[1].n_tokens / med


def main() -> None:
    from areal_fsdp.engine import FSDPTrainEngine

    from areal_kernel.algo.losses import make_ppo_loss_fn
    from areal_kernel.engine.torch_engine import TorchTrainEngine
    from areal_kernel.inference.client import RemoteInferenceEngine
    from areal_kernel.inference.embedded.backend import EmbeddedProtocol
    from areal_kernel.inference.embedded.launcher import EmbeddedLauncher, EmbeddedServerConfig
    from areal_kernel.models.resolve import resolve_model_path
    from areal_kernel.trainer.weight_sync import BroadcastTransport

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    add_batch_args(ap)
    ap.add_argument("--bucket-mb", type=int, default=64)
    args = ap.parse_args()
    model_dir = resolve_model_path(args.model)
    import json

    vocab = json.load(open(os.path.join(model_dir, "config.json")))["vocab_size"]
    batches = timed_batches(args, vocab)
    loss_fn = make_ppo_loss_fn(eps_clip=0.2)
    cfg = {"lr": 1e-6, "max_tokens_per_mb": 2048}
    rows = []

    ref = TorchTrainEngine(cfg)
    ref.initialize(model_dir, 100)
    s, tps = time_training(ref, batches, loss_fn)
    rows.append(("torch (1 process)", s, tps))
    ref.destroy()
    del ref

    export_rows = []
    for n in (1, 2):
        eng = FSDPTrainEngine(cfg, world_size=n)
        eng.initialize(model_dir, 100)
        try:
            s, tps = time_training(eng, batches, loss_fn)
            rows.append((f"fsdp {n} rank{'s' if n > 1 else ''}", s, tps))
            if n == 2:
                with tempfile.TemporaryDirectory() as d:
                    mb = sum(t.numel() * t.element_size() for _, t in eng.named_weights_for_transfer()) / 2**20
                    t0 = time.perf_counter()
                    eng.save_hf(os.path.join(d, "hf"), max_shard_bytes=64 << 20)
                    export_s = time.perf_counter() - t0
                    export_rows.append(("HF export, 2 ranks -> rank 0 streams 64 MB files", export_s, mb))
                    launcher = EmbeddedLauncher(EmbeddedServerConfig(dtype="float32"), run_dir=d)
                    try:
                        infos = launcher.launch(model_dir, n_servers=1, devices_per_server=0)
                        client = RemoteInferenceEngine([i.address for i in infos], EmbeddedProtocol())
                        tr = BroadcastTransport(eng, client, d, args.bucket_mb << 20)
                        tr.setup()
                        times = []
                        for v in range(1, 4):
                            t0 = time.perf_counter()
                            tr.update(v)
                            times.append(time.perf_counter() - t0)
                        export_rows.append(
                            (f"broadcast 2 ranks -> 1 embedded server ({args.bucket_mb} MB buckets)", statistics.median(times), mb)
                        )
                    finally:
                        launcher.stop()
        finally:
            eng.destroy()

    print(f"\nmodel {args.model}; batch {args.groups} groups x {args.group} samples, prompt {args.prompt_len} tokens, "
          f"answers 4..{args.max_answer} tokens ({batches[1].n_tokens} tokens/step); OMP_NUM_THREADS=1 per process\n")  # fmt: skip
    print("| engine | s/step (median) | tokens/s | vs 1 fsdp rank |")
    print("|---|---|---|---|")
    one = next(r for r in rows if r[0].startswith("fsdp 1"))[2]
    for name, s, tps in rows:
        print(f"| {name} | {s:.2f} | {tps:.0f} | {tps / one:.2f} |")
    for name, s, tps in rows:
        if not name.startswith("fsdp 1"):
            # Information: 2 ranks on 2 cores also pay gloo collectives.
            report(f"{name} / fsdp 1 rank tokens/s", tps / one)
    print("\n| weight path | seconds | MB | MB/s |")
    print("|---|---|---|---|")
    for name, s, mb in export_rows:
        print(f"| {name} | {s:.2f} | {mb:.0f} | {mb / s:.0f} |")


if __name__ == "__main__":
    main()
