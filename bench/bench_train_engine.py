"""TorchTrainEngine vs a plain PyTorch training loop on the same data.

Both train a random Llama (HF transformers, AdamW, sdpa) on the same batch of
variable-length sequences. The plain loop pads the batch to its longest
sequence and runs one forward/backward; the engine packs sequences into
micro-batches of ``--mb-tokens`` tokens. Throughput counts real (non-pad)
tokens per second of optimizer step, median over ``--steps`` timed steps
after one warm-up step each.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/bench_train_engine.py
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


def build_model(path: str, args: argparse.Namespace) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 128),
        max_position_embeddings=max(2048, args.max_len),
    )
    LlamaForCausalLM(cfg).save_pretrained(path)


def make_sequences(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(0)
    return [
        [rng.randrange(args.vocab) for _ in range(rng.randint(args.min_len, args.max_len))]
        for _ in range(args.n_seqs)
    ]


def bench_plain(path: str, seqs: list[list[int]], args: argparse.Namespace) -> list[float]:
    """The textbook loop: pad, attention_mask, labels=-100 on pads, AdamW."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    n = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), n, dtype=torch.long)
    mask = torch.zeros(len(seqs), n, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16)
    times = []
    for _ in range(args.steps + 1):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with autocast:
            out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
    return times[1:]


def bench_engine(path: str, seqs: list[list[int]], args: argparse.Namespace) -> list[float]:
    from areal_kernel.api.io import Trajectory, TrajectoryBatch
    from areal_kernel.engine.torch_engine import TorchTrainEngine

    engine = TorchTrainEngine(
        {"lr": 1e-5, "max_tokens_per_mb": args.mb_tokens, "autocast_bf16": args.bf16, "attn_implementation": "sdpa"}
    )
    engine.initialize(path, args.steps + 1)
    batch = TrajectoryBatch(
        [Trajectory(s, [0] + [1] * (len(s) - 1), [0.0] * len(s), [0] * len(s), 0.0) for s in seqs]
    )

    def nll(logprobs, entropy, data):
        return -(logprobs * data["loss_mask"]).sum() / data["batch_loss_tokens"], {}

    times = []
    for _ in range(args.steps + 1):
        t0 = time.perf_counter()
        engine.train_batch(batch, nll)
        times.append(time.perf_counter() - t0)
    return times[1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--n-seqs", type=int, default=16)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--mb-tokens", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast in both loops")
    args = p.parse_args()

    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    seqs = make_sequences(args)
    real = sum(len(s) for s in seqs)
    padded = len(seqs) * max(len(s) for s in seqs)
    with tempfile.TemporaryDirectory() as d:
        build_model(d, args)
        plain = statistics.median(bench_plain(d, seqs, args))
        ours = statistics.median(bench_engine(d, seqs, args))
    print(
        f"model: llama hidden={args.hidden} layers={args.layers} vocab={args.vocab}; "
        f"{len(seqs)} seqs, {real} real tokens ({padded} padded); bf16_autocast={args.bf16}; "
        f"threads={torch.get_num_threads()}"
    )
    print(f"{'loop':<34}{'s/step':>10}{'tokens/s':>12}{'ratio':>8}")
    print(f"{'plain HF (padded, 1 forward)':<34}{plain:>10.3f}{real / plain:>12.0f}{1.0:>8.2f}")
    label = f"TorchTrainEngine (packed, {args.mb_tokens}/mb)"
    print(f"{label:<34}{ours:>10.3f}{real / ours:>12.0f}{plain / ours:>8.2f}")
    report("torch engine / plain PyTorch loop speed", plain / ours, 1.0)


if __name__ == "__main__":
    main()
