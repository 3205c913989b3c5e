"""Two policies' training steps with the base computed once, against one after the other.

SmolLM2-135M in the torch engine with two rank-16 adapters on every linear
layer of the decoder (examples/grpo_lora.yaml's adapter, one per policy),
each policy with a GRPO-sized batch of its own (``--prompts`` prompts x 8
samples, a ``--prompt-len``-token prompt shared by each group,
``--completion``-token completions). Side by side in one process on the
platform's device, interleaved so that drift hits both alike:

- one after the other: ``engine.policy("add").train_batch`` then
  ``engine.policy("sub").train_batch`` (what ``trainer.policy_order:
  weight`` and ``ready`` do, one policy per step);
- together: ``engine.train_policies`` (``policy_order: together``): the two
  policies' micro-batches in shared forwards, the base computed once for both.

The table gives the median seconds of the two steps and the tensor
operations of each (on a GPU each is a kernel launch). The ratio is
one-after-the-other / together: above 1 is what computing the base once
saves.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_train_together.py [--prompts 4] [--repeats 5] [--max-tokens-per-mb 8192]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from summary import report  # bench/summary.py: one table of ratios for `make bench`

os.environ.setdefault("OMP_NUM_THREADS", "1")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per policy's batch, x8 samples (default 4)")
    ap.add_argument("--prompt-len", type=int, default=40, help="prompt tokens (default 40)")
    ap.add_argument("--completion", type=int, default=16, help="completion tokens (default 16)")
    ap.add_argument(
        "--max-tokens-per-mb", type=int, default=8192,
        help="micro-batch budget (default 8192, the engine's: room for both policies' chunks; at 320, "
        "grpo_lora.yaml's, a 168-token chunk leaves no room for another policy's and nothing mixes)",
    )  # fmt: skip
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per setting (median; default 5)")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--json", help="also write the numbers to this file")
    args = ap.parse_args()

    import torch

    from areal_kernel.api.io import Trajectory, TrajectoryBatch
    from areal_kernel.engine.together import PolicyJob
    from areal_kernel.engine.torch_engine import TorchTrainEngine
    from areal_kernel.models.resolve import resolve_model_path
    from areal_kernel.platforms import current_platform

    plat = current_platform()
    lora = {"rank": 16, "alpha": 32, "target_modules": TARGETS}
    engine = TorchTrainEngine(
        {
            "lr": 1e-5, "max_tokens_per_mb": args.max_tokens_per_mb,
            "adapters": [{**lora, "name": "add"}, {**lora, "name": "sub"}],
        }
    )  # fmt: skip
    engine.initialize(resolve_model_path(args.model), 10_000)
    vocab = engine.model.config.vocab_size
    rng = random.Random(0)

    def batch() -> TrajectoryBatch:
        trajs = []
        for _ in range(args.prompts):
            prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
            for _ in range(8):
                ids = prompt + [rng.randrange(vocab) for _ in range(args.completion)]
                n, p = len(ids), args.prompt_len
                trajs.append(
                    Trajectory(
                        input_ids=ids, loss_mask=[0] * p + [1] * (n - p),
                        logprobs=[0.0] * p + [-rng.uniform(1.0, 4.0) for _ in range(n - p)],
                        versions=[-1] * p + [0] * (n - p), reward=float(rng.random() < 0.5),
                    )
                )  # fmt: skip
        return TrajectoryBatch(trajs)

    def loss(logprobs, entropy, data):
        mask = data["loss_mask"]
        ratio = torch.exp((logprobs - data["old_logprobs"]) * mask)
        return (-(data["advantages"] * ratio) * mask).sum() / data["batch_loss_tokens"], {}

    def adv(b: TrajectoryBatch) -> dict[str, list[list[float]]]:
        return {"advantages": [[(t.reward - 0.5) * m for m in t.loss_mask] for t in b.trajectories]}

    batches = {"add": batch(), "sub": batch()}
    jobs = {name: PolicyJob(b, loss, adv(b)) for name, b in batches.items()}

    def apart() -> None:
        for name, job in jobs.items():
            engine.policy(name).train_batch(job.batch, job.loss_fn, job.extra)

    def together() -> None:
        out = engine.train_policies(jobs)
        assert all(s["joint"] == 1.0 for s in out.values()), out

    settings = {"one after the other": apart, "together": together}

    def timed(fn) -> float:
        plat.synchronize()
        t0 = time.perf_counter()
        fn()
        plat.synchronize()
        return time.perf_counter() - t0

    def operations(fn) -> int:
        from torch.utils._python_dispatch import TorchDispatchMode

        ran = [0]

        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                ran[0] += 1
                return func(*args, **(kwargs or {}))

        with Count():
            fn()
        return ran[0]

    for fn in settings.values():  # warm-up
        fn()
    ops = {k: operations(fn) for k, fn in settings.items()}
    times: dict[str, list[float]] = {k: [] for k in settings}
    for _ in range(args.repeats):
        for k, fn in settings.items():
            times[k].append(timed(fn))
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = sum(b.n_tokens for b in batches.values())
    print(
        f"\n{os.path.basename(args.model)} on {plat.device()}, two policies x {args.prompts} prompts x 8 samples "
        f"({args.prompt_len} prompt + {args.completion} completion tokens; {tokens} tokens in all), rank-16 adapters "
        f"on {len(TARGETS)} modules, micro-batches of {args.max_tokens_per_mb} tokens; median of {args.repeats}"
    )
    print("\n| both policies' steps | s | tensor operations |")
    print("|---|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v:.3f} | {ops[k]} |")
    ratio = med["one after the other"] / med["together"]
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"seconds": med, "operations": ops, "ratio": ratio, "device": str(plat.device())}, f, indent=1)
    report("train together: two policies one after the other / together, seconds per step", ratio)


if __name__ == "__main__":
    main()
