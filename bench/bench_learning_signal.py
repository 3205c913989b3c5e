"""Can the end-to-end learning tests tell learning from noise?

Runs the demo config for a few steps (its peak lr held constant, as the
tests do) several times with its learning rate and
several times with ``lr=0`` (the negative control: same sampling, same data
order, weights frozen), and reports, for each candidate statistic, its mean
and standard deviation in both arms and the separation between them in
units of their pooled standard deviation. The e2e tests assert on the
statistic with the widest separation, with a margin set from these numbers.

Statistics (per run):
- ``trend``: mean sampling reward over steps 3..end minus step 1's
  (``areal_kernel.testing.trends.sampling_reward_trend``);
- ``trend12``: mean over the second half of the steps minus the mean of
  steps 1 and 2 (with staleness 1, step 2 still samples mostly from the
  initial weights: a baseline twice as large, biased towards no gain);
- ``eval_gain``: held-out greedy accuracy after minus before (the same fixed
  held-out sums in every run; greedy, so a frozen policy scores exactly its
  "before" figure).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_learning_signal.py [--runs 4] [--controls 2] [--steps 6] [key=value ...]

The same for the plugins' learning tests (vLLM rollout; FSDP ranks):

    ... bench_learning_signal.py --runs 3 --controls 3 trainer.eval_size=0 rollout.backend=vllm \
        weight_update.mode=broadcast rollout.vllm.startup_timeout_s=1200
    ... bench_learning_signal.py --runs 3 --controls 3 --engine-section actor.fsdp \
        --example plugins/areal-fsdp/examples/grpo_arithmetic_fsdp.yaml trainer.eval_size=0
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
sys.path.insert(0, REPO)
from areal_kernel.testing.trends import sampling_reward_trend  # noqa: E402

EXAMPLE = os.path.join(REPO, "examples", "grpo_arithmetic.yaml")


def run(seed: int, steps: int, lr0: bool, root: str, overrides: list[str], example: str, section: str) -> dict:
    run_dir = os.path.join(root, f"{'lr0' if lr0 else 'lr'}-seed{seed}")
    cmd = [sys.executable, "-m", "areal_kernel.cli", "train", example, f"seed={seed}", f"run_dir={run_dir}",
           f"trainer.max_steps={steps}", "logging.sinks=[jsonl]", f"{section}.lr_scheduler=constant",
           *([f"{section}.lr=0"] if lr0 else []),
           *overrides]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"seed {seed} (lr0={lr0}): areal train failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    step_rows = [r for r in rows if "perf/step_s" in r]
    first, later, rewards = sampling_reward_trend(step_rows)
    result = json.load(open(os.path.join(run_dir, "result.json")))
    # NaN when the run had no held-out evaluation (trainer.eval_size=0).
    gain = result["after"] - result["before"] if "after" in result and "before" in result else float("nan")
    return {"seed": seed, "lr0": lr0, "later": later, "trend": later - first, "trend12": trend12(rewards),
            "eval_gain": gain, "rewards": rewards, "wall_s": time.monotonic() - t0}


def trend12(rewards: list[float]) -> float:
    half = [x for x in rewards[len(rewards) // 2 :] if x == x]  # NaN: a step without finished rollouts
    base = [x for x in rewards[:2] if x == x]
    return sum(half) / len(half) - sum(base) / len(base)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=4, help="runs with the config's learning rate (seeds 1..N)")
    ap.add_argument("--controls", type=int, default=2, help="runs with lr=0 (seeds 1..N)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--example", default=EXAMPLE, help="the config every run starts from")
    ap.add_argument("--engine-section", default="actor.torch", help="where the train engine's lr lives")
    ap.add_argument("overrides", nargs="*", help="config overrides passed to every run")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for lr0, n in ((False, args.runs), (True, args.controls)):
            for seed in range(1, n + 1):
                r = run(seed, args.steps, lr0, root, args.overrides, args.example, args.engine_section)
                print(f"{'lr=0' if lr0 else 'lr  '} seed {seed}: later {r['later']:.3f}, trend {r['trend']:+.3f}, trend12 {r['trend12']:+.3f}, "
                      f"eval gain {r['eval_gain']:+.3f}; per step {[round(x, 3) for x in r['rewards']]} "
                      f"({r['wall_s']:.0f} s)", flush=True)  # fmt: skip
                rows.append(r)
    print("\n| statistic | lr: mean | lr: std | lr=0: mean | lr=0: std | separation (pooled std) |")
    print("|---|---|---|---|---|---|")
    for stat in ("later", "trend", "trend12", "eval_gain"):
        a = [r[stat] for r in rows if not r["lr0"] and r[stat] == r[stat]]
        b = [r[stat] for r in rows if r["lr0"] and r[stat] == r[stat]]
        if not a or not b:
            continue
        sa = statistics.stdev(a) if len(a) > 1 else 0.0
        sb = statistics.stdev(b) if len(b) > 1 else 0.0
        pooled = max(((sa**2 + sb**2) / 2) ** 0.5, 1e-9)
        sep = (statistics.mean(a) - statistics.mean(b)) / pooled
        print(f"| {stat} | {statistics.mean(a):+.3f} | {sa:.3f} | {statistics.mean(b):+.3f} | {sb:.3f} | {sep:.1f} |")
        print(f"  {stat} min with lr: {min(a):+.3f}; max with lr=0: {max(b):+.3f}")
        # The tests assert on ``later``; the others are reported for comparison.
        goal = 3.0 if stat == "later" else None
        report(f"learning signal, {stat}: separation of lr from lr=0 in pooled std ({args.steps} steps)", sep, goal)
    return 0


if __name__ == "__main__":
    sys.exit(main())
