"""Async vs sync GRPO on the same config and machine.

Runs `areal train` twice on the demo config for the same number of steps:
max_staleness 0 (generate, then train) and max_staleness >= 1 (both
overlap), and prints trained samples per second side by side.

    .venv/bin/python bench/bench_async_vs_sync.py [--steps 8] [--staleness 1]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from summary import report  # bench/summary.py: one table of ratios for `make bench`

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(staleness: int, steps: int, root: str, extra: list[str]) -> dict:
    name = f"bench-s{staleness}"
    cmd = [
        sys.executable, "-m", "areal_kernel.cli", "train", os.path.join(REPO, "examples", "grpo_arithmetic.yaml"),
        f"experiment_name={name}", f"run_dir={os.path.join(root, name)}", f"trainer.max_steps={steps}",
        f"rollout.max_staleness={staleness}", "trainer.eval_size=0", "logging.sinks=[jsonl]", *extra,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd, check=True, env=env, cwd=REPO)
    rows = [json.loads(line) for line in open(os.path.join(root, name, "metrics.jsonl"))]
    steps_rows = [r for r in rows if "perf/step_s" in r]
    # Skip the first step: both modes start with an empty pipeline.
    tail = steps_rows[1:]
    secs = sum(r["perf/step_s"] for r in tail)
    samples = sum(r["batch/sequences"] for r in tail)
    return {
        "samples_per_s": samples / secs,
        "step_s": secs / len(tail),
        "wait_rollout_s": sum(r["perf/wait_rollout_s"] for r in tail) / len(tail),
        "train_s": sum(r["perf/train_s"] for r in tail) / len(tail),
        "staleness": sum(r["rollout/staleness_mean"] for r in tail) / len(tail),
        "reward": sum(r["reward/mean"] for r in tail) / len(tail),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--staleness", type=int, default=1)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as root:
        sync = run(0, args.steps, root, args.overrides)
        asyn = run(args.staleness, args.steps, root, args.overrides)
    print()
    print("| mode | samples/s | step s | wait for rollout s | train s | staleness | reward |")
    print("|---|---|---|---|---|---|---|")
    for name, r in (("sync (max_staleness 0)", sync), (f"async (max_staleness {args.staleness})", asyn)):
        print(f"| {name} | {r['samples_per_s']:.2f} | {r['step_s']:.1f} | {r['wait_rollout_s']:.1f} | "
              f"{r['train_s']:.1f} | {r['staleness']:.2f} | {r['reward']:.3f} |")
    print(f"\nasync / sync throughput ratio: {asyn['samples_per_s'] / sync['samples_per_s']:.2f}")
    report("async / sync training samples/s (demo config)", asyn["samples_per_s"] / sync["samples_per_s"], 1.8)


if __name__ == "__main__":
    main()
