"""What a recovery checkpoint costs, next to the training step it protects.

SmolLM2-135M (fp32) in the torch train engine: one RL-sized optimizer step,
then a recovery checkpoint written through ``CheckpointManager`` (engine
state: weights + AdamW moments + RNG, fsynced, renamed) and loaded back into
a fresh engine (what ``recover: auto`` does at start). Prints one table with
the seconds of each and the ratio to the step.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_recovery.py [--repeats 2]
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


def _batch(n_seqs: int, prompt: int, gen: int, vocab: int):
    from areal_kernel.api.io import Trajectory, TrajectoryBatch

    rng = random.Random(0)
    trajs = []
    for _ in range(n_seqs):
        ids = [rng.randrange(vocab) for _ in range(prompt + gen)]
        trajs.append(Trajectory(ids, [0] * prompt + [1] * gen, [0.0] * prompt + [-1.0] * gen,
                                [-1] * prompt + [0] * gen, reward=rng.random()))
    return TrajectoryBatch(trajs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--n-seqs", type=int, default=32, help="sequences per step (the demo: 4 prompts x 8)")
    args = ap.parse_args()

    from areal_kernel.checkpoint import CheckpointManager
    from areal_kernel.engine.torch_engine import TorchTrainEngine
    from areal_kernel.models.resolve import resolve_model_path

    model = resolve_model_path("smollm2-135m-instruct")
    cfg = {"lr": 1e-6, "param_dtype": "float32", "autocast_bf16": False, "max_tokens_per_mb": 320}
    engine = TorchTrainEngine(cfg)
    engine.initialize(model, 100)
    batch = _batch(args.n_seqs, 40, 12, 49152)

    def loss_fn(logprobs, entropy, data):
        # A policy-gradient surrogate: enough to fill every AdamW moment.
        mask = data["loss_mask"]
        return -((data["rewards"] - 0.5) * logprobs * mask).sum() / data["batch_loss_tokens"], {}

    step_s, save_s, load_s = [], [], []
    with tempfile.TemporaryDirectory() as root:
        mgr = CheckpointManager(os.path.join(root, "recover"), keep_last=2)
        fresh = TorchTrainEngine(cfg)
        fresh.initialize(model, 100)
        for i in range(args.repeats):
            t0 = time.perf_counter()
            engine.train_batch(batch, loss_fn)
            step_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ckpt = mgr.save(i + 1, lambda p: engine.save_state(os.path.join(p, "engine")))
            save_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            fresh.load_state(os.path.join(ckpt.path, "engine"))
            load_s.append(time.perf_counter() - t0)
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ckpt.path) for f in fs)

    step, save, load = (statistics.median(x) for x in (step_s, save_s, load_s))
    print(f"SmolLM2-135M fp32, {args.n_seqs} sequences per step, checkpoint {size / 2**20:.0f} MiB, "
          f"median of {args.repeats}")
    print(f"{'what':<36}{'seconds':>10}{'x train step':>14}")
    for name, s in (("train step (optimizer step)", step), ("write recovery checkpoint", save),
                    ("load it into a fresh engine", load)):
        print(f"{name:<36}{s:>10.2f}{s / step:>14.2f}")
    print(f"a checkpoint every 10 steps costs {save / (10 * step):.1%} of training time (drain not included)")
    report("recovery checkpoint write / train step", save / step, 0.5, higher_is_better=False)


if __name__ == "__main__":
    main()
