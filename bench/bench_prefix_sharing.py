"""Shared-prompt packing vs plain packing on a GRPO-shaped batch.

A GRPO batch holds ``--group-size`` samples of each prompt. With
``share_prompts`` the torch engine runs each prompt once per micro-batch (see
``areal_kernel/engine/prefix_tree.py``); without it every copy is packed.
Both engines train SmolLM2-135M-Instruct (fp32, the demo's settings) on the
same batch: chat-templated arithmetic prompts, completions of random length.
Reports the median optimizer-step time over ``--steps`` timed steps after one
warm-up step, and the tokens each engine pushed through the model.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_prefix_sharing.py
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from summary import report  # bench/summary.py: one table of ratios for `make bench`

os.environ.setdefault("OMP_NUM_THREADS", "1")


def make_batch(tokenizer, args):
    from areal_kernel.api.io import Trajectory, TrajectoryBatch
    from areal_kernel.data.arithmetic import arithmetic_records

    rng = random.Random(0)
    trajs = []
    for g, rec in enumerate(arithmetic_records(args.groups, seed=0)):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": rec["prompt"]}], add_generation_prompt=True, tokenize=False
        )
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        for k in range(args.group_size):
            c = rng.randint(args.min_completion, args.max_completion)
            comp = [rng.randrange(100, 40000) for _ in range(c)]
            trajs.append(
                Trajectory(
                    input_ids=p_ids + comp,
                    loss_mask=[0] * len(p_ids) + [1] * c,
                    logprobs=[0.0] * len(p_ids) + [-2.0] * c,
                    versions=[-1] * len(p_ids) + [0] * c,
                    reward=float(k % 2),
                    group_id=f"g{g}",
                )
            )
    return TrajectoryBatch(trajs)


def loss_fn(logprobs, entropy, data):
    adv = data["rewards"] - 0.5
    loss = -(adv * logprobs * data["loss_mask"]).sum() / data["batch_loss_tokens"]
    return loss, {}


def run(model_dir: str, batch, share: bool, steps: int, mb: int) -> tuple[float, float]:
    from areal_kernel.engine.torch_engine import TorchTrainEngine

    eng = TorchTrainEngine({"lr": 1e-6, "max_tokens_per_mb": mb, "share_prompts": share})
    eng.initialize(model_dir, steps + 1)
    times = []
    stats = {}
    for i in range(steps + 1):
        t0 = time.perf_counter()
        stats = eng.train_batch(batch, loss_fn)
        if i:
            times.append(time.perf_counter() - t0)
    eng.destroy()
    return statistics.median(times), stats["n_model_tokens"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--min-completion", type=int, default=2)
    ap.add_argument("--max-completion", type=int, default=12)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--mb-tokens", type=int, default=320)
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    from areal_kernel.models.resolve import resolve_model_path

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model_dir = resolve_model_path("smollm2-135m-instruct@float32")
    batch = make_batch(AutoTokenizer.from_pretrained(model_dir), args)
    n_tokens = batch.n_tokens
    rows = []
    for share in (False, True):
        t, model_tokens = run(model_dir, batch, share, args.steps, args.mb_tokens)
        rows.append((share, t, model_tokens))
    print(f"\nbatch: {args.groups} prompts x {args.group_size} samples, {n_tokens} tokens, mb budget {args.mb_tokens}")
    print(f"{'share_prompts':>14} {'model tokens':>13} {'step s':>8} {'seq tok/s':>10}")
    for share, t, mt in rows:
        print(f"{str(share):>14} {int(mt):>13} {t:>8.2f} {n_tokens / t:>10.1f}")
    print(f"speed-up: {rows[0][1] / rows[1][1]:.2f}x")
    report("shared-prompt / plain packing train step speed-up", rows[0][1] / rows[1][1], 2.0)


if __name__ == "__main__":
    main()
