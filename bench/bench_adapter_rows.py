"""What a batch that mixes adapters costs the embedded server's adapter hooks.

One forward of SmolLM2-135M (the decode-step shape: ``--rows`` rows of one
new token each, over a ``--context``-token KV cache) with two rank-16 adapters
on every linear layer of the decoder loaded (examples/grpo_lora.yaml's), the
rows using: no adapter; one adapter; the two adapters half and half (what a
two-policy run's server batches). Side by side in one process on the
platform's device (``AREAL_PLATFORM`` to choose). The mixed batch's ratio to
the one-adapter batch is the price of serving both policies together instead
of one after the other (1.0: free; 2.0: no better than apart). The table
also counts the tensor operations of each forward: on a GPU each is a kernel
launch, which bounds a small model's decode step.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_adapter_rows.py [--rows 32] [--context 48] [--repeats 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from summary import report  # bench/summary.py: one table of ratios for `make bench`

os.environ.setdefault("OMP_NUM_THREADS", "1")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=32, help="batch rows (default 32: 4 prompts x 8 samples)")
    ap.add_argument("--context", type=int, default=48, help="tokens already in the KV cache (default 48)")
    ap.add_argument("--repeats", type=int, default=30, help="timed forwards per setting (median; default 30)")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--json", help="also write the numbers to this file (bench/gpu_check.py reads them)")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from areal_kernel.inference.embedded.lora import AdapterSet
    from areal_kernel.models.resolve import resolve_model_path
    from areal_kernel.platforms import current_platform

    plat = current_platform()
    dev = plat.device()
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(args.model), dtype=torch.float32).to(dev).eval()
    adapters = AdapterSet(model)
    g = torch.Generator().manual_seed(0)
    for name in ("add", "sub"):
        tensors = []
        for mname, mod in model.named_modules():
            if mname.rsplit(".", 1)[-1] in TARGETS:
                tensors.append(
                    (f"base_model.model.{mname}.lora_A.weight", torch.randn(16, mod.in_features, generator=g) * 0.01)
                )
                tensors.append(
                    (f"base_model.model.{mname}.lora_B.weight", torch.randn(mod.out_features, 16, generator=g) * 0.01)
                )
        adapters.load(name, {"r": 16, "lora_alpha": 32}, tensors, version=1)

    ctx = torch.randint(0, 49152, (args.rows, args.context), generator=g).to(dev)
    step = torch.randint(0, 49152, (args.rows, 1), generator=g).to(dev)
    settings = {
        "no adapter": [None] * args.rows,
        "one adapter": ["add"] * args.rows,
        "two adapters, half each": ["add", "sub"] * (args.rows // 2),
    }

    def forward(rows: list[str | None]) -> float:
        adapters.rows = rows
        with torch.no_grad():
            cache = DynamicCache()
            model(input_ids=ctx, past_key_values=cache, use_cache=True)  # the prompt: not timed
            plat.synchronize()
            t0 = time.perf_counter()
            model(input_ids=step, past_key_values=cache, use_cache=True)
            plat.synchronize()
            return time.perf_counter() - t0

    def operations(rows: list[str | None]) -> int:
        """Tensor operations in one decode forward: each is a kernel launch on
        a GPU, where a small model's decode step is bound by launches."""
        from torch.utils._python_dispatch import TorchDispatchMode

        ran = [0]

        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                ran[0] += 1
                return func(*args, **(kwargs or {}))

        adapters.rows = rows
        with torch.no_grad():
            cache = DynamicCache()
            model(input_ids=ctx, past_key_values=cache, use_cache=True)
            with Count():
                model(input_ids=step, past_key_values=cache, use_cache=True)
        return ran[0]

    for rows in settings.values():  # warm-up
        forward(rows)
    ops = {k: operations(rows) for k, rows in settings.items()}
    times: dict[str, list[float]] = {k: [] for k in settings}
    for _ in range(args.repeats):  # interleaved, so drift hits every setting alike
        for k, rows in settings.items():
            times[k].append(forward(rows))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{os.path.basename(args.model)} on {dev}, {args.rows} rows x 1 new token over {args.context} cached, "
          f"2 adapters rank 16 on {len(TARGETS)} modules x {model.config.num_hidden_layers} layers; "
          f"median of {args.repeats}")  # fmt: skip
    print("\n| rows use | ms per decode forward | vs one adapter | tensor operations per forward |")
    print("|---|---|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v * 1e3:.2f} | {v / med['one adapter']:.2f} | {ops[k]} |")
    ratio = med["two adapters, half each"] / med["one adapter"]
    report(
        "adapter rows: two adapters half each / one adapter, decode forward", ratio, goal=1.2, higher_is_better=False
    )
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"device": str(dev), "rows": args.rows, "context": args.context, "ms": {k: v * 1e3 for k,
                       v in med.items()}, "operations": ops, "mixed_over_one": ratio}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
