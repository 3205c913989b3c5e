"""Soak: the same GRPO run without faults and with inference servers killed
at random, side by side.

Each mode runs the real trainer (``areal train``'s ``RLTrainer``, embedded
servers, disk weight updates) in its own process for ``--steps`` steps. In
the fault mode a seeded thread sends ``SIGKILL`` to a random server's
process group every ``--kill-every`` seconds (+-50% jitter); the supervisor
restarts it on the same address with the current weights and the client
fails its requests over (only serving servers are killed: killing one
mid-restart would measure process start-up, not recovery). Every admitted record is followed by id to its
outcome (trained, failed, stale-dropped, still queued or in flight at the
end): "lost" counts admitted records with no outcome and must be 0, as must
"duplicated" (a record trained twice or an episode started twice). "failed
episodes" are accounted for, not lost: a request that fails more than
``rollout.request_retries`` times gives up (a guard against requests that
crash servers), which only happens when kills come faster than restarts.

    .venv/bin/python bench/bench_soak.py [--steps 12] [--kill-every 10] [--model tiny|smollm2] [--servers 2]
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from summary import report  # bench/summary.py: one table of ratios for `make bench`

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model_path(kind: str, root: str) -> str:
    if kind == "smollm2":
        return "smollm2-135m-instruct"
    from areal_kernel.models.resolve import resolve_model_path
    from areal_kernel.testing.models import make_tiny_llama

    # A tiny random Llama with SmolLM2's real tokenizer: the loop's costs
    # without a real model's (the scheduling and recovery are what is measured).
    return make_tiny_llama(os.path.join(root, "tiny"), tokenizer_from=resolve_model_path("smollm2-135m-instruct"))


def child(args: argparse.Namespace) -> None:
    """One training run, instrumented; writes its numbers to ``args.out``."""
    from areal_kernel.config import load_config
    from areal_kernel.plugins import get_registry
    from areal_kernel.logging import setup_logging
    from areal_kernel.api.trainer import TrainerContext
    from areal_kernel.trainer.run import RLTrainer

    overrides = [
        f"model.path={args.model_path}", f"run_dir={args.run_dir}", f"trainer.max_steps={args.steps}",
        f"trainer.batch_size={args.batch_size}", "trainer.eval_size=0", f"rollout.gconfig.n_samples={args.n_samples}",
        f"rollout.gconfig.max_new_tokens={args.max_new_tokens}", f"rollout.backend=embedded:d{args.servers}",
        "weight_update.mode=disk", "algorithm.dynamic_filter=false", "logging.sinks=[jsonl]", "logging.level=" + os.environ.get("SOAK_LOG", "error"),
        *args.overrides,
    ]  # fmt: skip
    cfg = load_config(os.path.join(REPO, "examples", "grpo_arithmetic.yaml"), overrides, get_registry())
    setup_logging(level=cfg.logging.level, json_logs=cfg.logging.json_logs)

    ids: dict[int, int] = {}  # id(record object) -> admission number
    keep_alive: list[dict] = []
    starts: dict[int, int] = {}
    outcome: dict[int, str] = {}
    trained: list[int] = []
    counter = itertools.count()

    class SoakTrainer(RLTrainer):
        def setup(self) -> None:
            super().setup()
            ex, wf = self.executor, self.rollout.workflow
            next_record, run_episode = ex.next_record, wf.arun_episode
            too_stale, get_batch = ex._too_stale, ex.get_batch

            def next_rec():
                rec = next_record()
                if rec is None:
                    return None
                rec = dict(rec)  # a distinct object per admission (epochs repeat records)
                keep_alive.append(rec)
                ids[id(rec)] = next(counter)
                return rec

            async def episode(engine, record):
                sid = ids[id(record)]
                starts[sid] = starts.get(sid, 0) + 1
                try:
                    g = await run_episode(engine, record)
                except asyncio.CancelledError:
                    outcome[sid] = "in flight at the end"
                    raise
                except Exception:
                    outcome[sid] = "failed"
                    raise
                if g is None:
                    outcome[sid] = "rejected"
                    return None
                g._soak_sid = sid
                outcome[sid] = "finished, not trained"
                return g

            def stale(g):
                s = too_stale(g)
                if s:
                    outcome[g._soak_sid] = "stale-dropped"
                return s

            def batch(n, timeout=None):
                groups = get_batch(n, timeout)
                for g in groups:
                    trained.append(g._soak_sid)
                    outcome[g._soak_sid] = "trained"
                return groups

            ex.next_record, wf.arun_episode, ex._too_stale, ex.get_batch = next_rec, episode, stale, batch
            if self.rollout.supervisor is not None:
                self.rollout.supervisor.max_restarts = 10**6  # the soak kills far more often than a real run fails

    trainer = SoakTrainer(TrainerContext.for_config(cfg))
    kills = 0
    stop_killing = threading.Event()

    def killer() -> None:
        nonlocal kills
        rng = random.Random(args.seed)
        while not stop_killing.wait(args.kill_every * rng.uniform(0.5, 1.5)):
            launcher = trainer.rollout.backend.launcher
            servers = [s for i, s in enumerate(launcher.servers) if i not in launcher.exited()]
            held = {s.address for s in trainer.rollout.engine.servers if s.held}
            # Only a serving server: killing one that is still restarting
            # measures the machine's process start-up time, not recovery.
            serving = [s for s in servers if s.address not in held]
            if not serving:
                continue
            try:
                os.killpg(rng.choice(serving).pid, signal.SIGKILL)
                kills += 1
            except ProcessLookupError:
                pass

    status = "failed"
    t0 = time.monotonic()
    try:
        trainer.setup()
        if args.kill_every > 0:
            threading.Thread(target=killer, daemon=True).start()
        result = trainer.train()
        status = "completed"
    finally:
        stop_killing.set()
        wall = time.monotonic() - t0
        failovers = trainer.rollout.engine.stats.get("failovers", 0) if trainer.rollout else 0
        sup = trainer.rollout.supervisor if trainer.rollout else None
        restarts = sup.total_restarts if sup is not None else 0
        if trainer.executor is not None:
            trainer.executor.stop()
            q = trainer.executor._out
            while not q.empty():
                item = q.get_nowait()
                g = item[-1] if isinstance(item, tuple) else item  # (seq, group) in newer executors
                outcome[g._soak_sid] = "queued at the end"
        trainer.close(status)
    admitted = set(ids.values())
    counts: dict[str, int] = {}
    for sid in admitted:
        k = outcome.get(sid, "LOST")
        counts[k] = counts.get(k, 0) + 1
    dup = sum(1 for v in starts.values() if v > 1) + (len(trained) - len(set(trained)))
    rows = [json.loads(line) for line in open(os.path.join(args.run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if "perf/step_s" in r]
    out = {
        "steps": len(steps),
        "samples": result["samples"],
        "full_batches": all(r["batch/sequences"] == args.batch_size * args.n_samples for r in steps),
        "admitted": len(admitted),
        "trained_records": len(set(trained)),
        "outcomes": counts,
        "lost": counts.get("LOST", 0),
        "failed": counts.get("failed", 0),
        "duplicated": dup,
        "kills": kills,
        "restarts": restarts,
        "failovers": failovers,
        "wall_s": wall,
        "train_s": result["train_seconds"],
        "samples_per_s": result["samples"] / result["train_seconds"],
    }
    with open(args.out, "w") as f:
        json.dump(out, f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--kill-every", type=float, default=10.0, help="seconds between kills in the fault run (jittered)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--n-samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model-path", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="extra config overrides for both runs")
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    os.environ["OMP_NUM_THREADS"] = "1"
    results = {}
    with tempfile.TemporaryDirectory() as root:
        model = _model_path(args.model, root)
        for mode, kill_every in (("no faults", 0.0), (f"kill every ~{args.kill_every:g}s", args.kill_every)):
            out = os.path.join(root, f"{len(results)}.json")
            cmd = [
                sys.executable, os.path.abspath(__file__), "--child", mode, "--model-path", model,
                "--run-dir", os.path.join(root, f"run{len(results)}"), "--out", out, "--steps", str(args.steps),
                "--kill-every", str(kill_every), "--seed", str(args.seed), "--servers", str(args.servers),
                "--batch-size", str(args.batch_size), "--n-samples", str(args.n_samples),
                "--max-new-tokens", str(args.max_new_tokens), *args.overrides,
            ]  # fmt: skip
            subprocess.run(cmd, check=True, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))
            results[mode] = json.load(open(out))
    print()
    print(f"soak: {args.steps} steps, model {args.model}, {args.servers} embedded server(s), "
          f"batch {args.batch_size}x{args.n_samples}, seed {args.seed}")
    print("| mode | steps | samples trained | full batches | records admitted | lost | duplicated | failed episodes "
          "| kills | restarts | failovers | wall s | train samples/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for mode, r in results.items():
        print(f"| {mode} | {r['steps']} | {r['samples']} | {r['full_batches']} | {r['admitted']} | {r['lost']} | "
              f"{r['duplicated']} | {r['failed']} | {r['kills']} | {r['restarts']} | {r['failovers']} | "
              f"{r['wall_s']:.0f} | {r['samples_per_s']:.2f} |")
    (clean, faulty) = results.values()
    print(f"\nthroughput with faults / without: {faulty['samples_per_s'] / clean['samples_per_s']:.2f}x")
    report("soak: samples/s with server kills / without", faulty["samples_per_s"] / clean["samples_per_s"], 0.5)
    for mode, r in results.items():
        print(f"record outcomes ({mode}): {r['outcomes']}")
    bad = [m for m, r in results.items() if r["lost"] or r["duplicated"] or not r["full_batches"]]
    if bad:
        print(f"FAILED: records lost/duplicated or a batch short in {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
