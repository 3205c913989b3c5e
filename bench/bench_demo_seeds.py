"""The README's main job over several seeds: is the demo good on every seed a
user might get?

Runs `areal train examples/grpo_arithmetic.yaml seed=S` for each seed, one
after another, on the demo's fixed held-out set (`dataset.arithmetic.split_seed`:
the same 32 unseen sums for every seed; the seed orders training and sampling),
and prints held-out greedy accuracy before/after and wall time per seed.
Goals: median after >= 0.875, minimum after >= 0.85, every run under 6 minutes.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_demo_seeds.py [--seeds 1 2 3 4 5] [key=value ...]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from summary import report  # bench/summary.py: one table of ratios for `make bench`

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "grpo_arithmetic.yaml")


def run(seed: int, root: str, overrides: list[str]) -> dict:
    run_dir = os.path.join(root, f"seed{seed}")
    cmd = [sys.executable, "-m", "areal_kernel.cli", "train", EXAMPLE, f"seed={seed}", f"run_dir={run_dir}",
           "logging.sinks=[jsonl]", *overrides]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=REPO, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"seed {seed}: areal train failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.load(open(os.path.join(run_dir, "result.json")))
    return {"seed": seed, "before": result["before"], "after": result["after"], "wall_s": wall,
            "train_s": result["train_seconds"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("overrides", nargs="*", help="config overrides passed to every run")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for seed in args.seeds:
            r = run(seed, root, args.overrides)
            print(f"seed {seed}: {r['before']:.3f} -> {r['after']:.3f} in {r['wall_s']:.0f} s", flush=True)
            rows.append(r)
    print("\n| seed | held-out before | held-out after | wall s | training s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seed']} | {r['before']:.3f} | {r['after']:.3f} | {r['wall_s']:.0f} | {r['train_s']:.0f} |")
    after = [r["after"] for r in rows]
    print(f"\nafter: median {statistics.median(after):.3f}, min {min(after):.3f}, max {max(after):.3f}; "
          f"slowest run {max(r['wall_s'] for r in rows):.0f} s")
    report(f"demo held-out accuracy after, median of {len(rows)} seeds", statistics.median(after), 0.875)
    report(f"demo held-out accuracy after, minimum of {len(rows)} seeds", min(after), 0.85)
    report("demo slowest run wall minutes", max(r["wall_s"] for r in rows) / 60, 6.0, higher_is_better=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
