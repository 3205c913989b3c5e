"""An elastic rollout fleet: what a second server joining a running job buys,
and what the join costs (docs/elastic.md).

One ``areal train grpo-arithmetic`` run per weight-update mode starts with one
embedded server; the run pauses after step ``--join-after``
(``AREAL_TEST_PAUSE_AFTER_STEPS``, the trainer's testing aid) while a second
server, started beforehand outside the run, is announced with
``areal fleet add``; the run then goes on with both. Side by side, from the
runs' ``metrics.jsonl``:

1. rollout throughput before vs after the join: trained samples/s and
   generated tokens/s over the steps before and after (the first step, which
   loads everything, and the join's own step left out), the trainer's wait
   for rollouts and the rollouts' mean latency;
2. the time to bring the new server to the current weights:
   ``weights/admit_s`` (the fleet's admit: a weight group of the trainer and
   the newcomer and one transfer under broadcast, a reload of the last
   directory under disk) and the wall time of ``areal fleet add --wait``
   (the CLI's start, the checks of the server, the admit, until it is active);
3. under broadcast, the pause of the first update after the membership
   changed (``weights/reform_s``: the group re-formed over both servers while
   they keep generating, then ``weights/pause_s``) vs a normal update.

On a 2-core machine the second server competes for the CPU with the trainer
and the first server (three single-threaded processes on two cores): the
ratio says what the fleet gains here, not on separate machines.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_elastic.py [--model tiny|smollm2-135m-instruct] [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from summary import report  # bench/summary.py: one table of ratios for `make bench`

os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _areal(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    full = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "areal_kernel.cli", *args], capture_output=True, text=True, env=full, timeout=timeout
    )


def _steps(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if "perf/step_s" in r]


def _window(rows: list[dict]) -> dict[str, float]:
    """Throughput over consecutive steps: totals over their wall time."""
    secs = sum(r["perf/step_s"] for r in rows)
    seqs = sum(r["batch/sequences"] for r in rows)
    gen = sum(r["batch/sequences"] * r["rollout/gen_len_mean"] for r in rows)
    return {
        "steps": float(len(rows)),
        "samples_per_s": seqs / secs,
        "gen_tokens_per_s": gen / secs,
        "wait_fraction": sum(r["perf/wait_rollout_s"] for r in rows) / secs,
        "latency_s": statistics.mean(r["rollout/latency_mean_s"] for r in rows),
        "step_s": secs / len(rows),
    }


def one_run(mode: str, model: str, args: argparse.Namespace, root: str) -> dict:
    """A run of ``args.steps`` steps under ``weight_update.mode=mode``; a second
    server joins after step ``args.join_after``."""
    from areal_kernel.inference.embedded.launcher import EmbeddedLauncher, EmbeddedServerConfig
    from areal_kernel.trainer.recovery import PAUSE_ENV, PAUSED_MARKER

    run_dir = os.path.join(root, f"run-{mode}")
    outside = EmbeddedLauncher(EmbeddedServerConfig(dtype="float32"), run_dir=os.path.join(root, f"outside-{mode}"))
    try:
        (b,) = outside.launch(model, n_servers=1, devices_per_server=0)
        train = [
            "train", "grpo_arithmetic", f"model.path={model}", f"run_dir={run_dir}",
            f"trainer.max_steps={args.steps}", f"trainer.batch_size={args.batch}",
            f"rollout.gconfig.n_samples={args.samples}", f"rollout.gconfig.max_new_tokens={args.max_new_tokens}",
            "trainer.eval_size=0", "logging.sinks=[jsonl]", f"weight_update.mode={mode}",
            "algorithm.dynamic_filter=false", "checkpoint.save_every=0",
        ]  # fmt: skip
        if args.model == "tiny":
            train += ["reward.type=char_share", "actor.torch.lr=3e-2"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", PAUSE_ENV: str(args.join_after)}
        log_path = os.path.join(root, f"train-{mode}.log")
        t_start = time.monotonic()
        with open(log_path, "wb") as logf:
            proc = subprocess.Popen(
                [sys.executable, "-m", "areal_kernel.cli", *train], stdout=logf, stderr=subprocess.STDOUT,
                env=env, cwd=REPO, start_new_session=True,
            )  # fmt: skip

        def tail() -> str:
            with open(log_path, errors="replace") as f:
                return f.read()[-4000:]

        try:
            marker = os.path.join(run_dir, PAUSED_MARKER.format(step=args.join_after))
            while not os.path.exists(marker):
                if proc.poll() is not None:
                    raise SystemExit(f"the {mode} run ended before the join:\n{tail()}")
                time.sleep(0.1)
            t0 = time.monotonic()
            added = _areal("fleet", "add", run_dir, b.address, "--wait", "300")
            add_wall = time.monotonic() - t0
            if added.returncode != 0:
                raise SystemExit(f"areal fleet add failed ({mode}): {added.stderr}")
            os.unlink(marker)
            proc.wait(timeout=3600)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
        if proc.returncode != 0:
            raise SystemExit(f"the {mode} run failed:\n{tail()}")
        wall = time.monotonic() - t_start
    finally:
        outside.stop()
    rows = _steps(run_dir)
    j = args.join_after
    # Rows by step: rows[j - 1] is step j (the last before the join), rows[j]
    # the step the newcomer's admit and the first update over both fall in.
    joined = rows[j]
    before, after = rows[1:j], rows[j + 1 :]
    normal_pause = statistics.median(r["weights/pause_s"] for r in rows[1:j] + rows[j + 1 :])
    admit = next((r["weights/admit_s"] for r in rows if "weights/admit_s" in r), float("nan"))
    return {
        "mode": mode,
        "wall_s": wall,
        "before": _window(before),
        "after": _window(after),
        "admit_s": admit,
        "add_wall_s": add_wall,
        "reform_s": joined.get("weights/reform_s", 0.0),
        "join_pause_s": joined["weights/pause_s"],
        "normal_pause_s": normal_pause,
        "servers": [int(r.get("rollout/servers", 0)) for r in rows],
        "full": all(r["batch/sequences"] == args.batch * args.samples for r in rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="'tiny' (a random byte-level Llama, seconds per run) or a known model / directory")  # fmt: skip
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--join-after", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--modes", nargs="+", default=["broadcast", "disk"])
    args = ap.parse_args()
    if not 2 <= args.join_after <= args.steps - 2:
        ap.error("--join-after must leave a step before it (after the first) and one after the join's own step")
    with tempfile.TemporaryDirectory() as root:
        if args.model == "tiny":
            from areal_kernel.models.tiny import make_tiny_byte_chat_llama

            model = make_tiny_byte_chat_llama(os.path.join(root, "model"))
        else:
            from areal_kernel.models.resolve import resolve_model_path

            model = resolve_model_path(args.model)
        runs = [one_run(mode, model, args, root) for mode in args.modes]

    print(f"\nmodel {args.model}, {args.batch} prompts x {args.samples} samples, {args.max_new_tokens} new tokens, "
          f"{args.steps} steps, second server joins after step {args.join_after}; one run per mode, this machine "
          f"({os.cpu_count()} cores)")  # fmt: skip
    print("\n| mode | window | steps | step s | samples/s | gen tokens/s | trainer waits | rollout latency s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        for name in ("before", "after"):
            w = r[name]
            label = "1 server (steps 2.." + str(args.join_after) + ")" if name == "before" else (
                f"2 servers (steps {args.join_after + 2}..{args.steps})")  # fmt: skip
            print(f"| {r['mode']} | {label} | {w['steps']:.0f} | {w['step_s']:.2f} | {w['samples_per_s']:.2f} | "
                  f"{w['gen_tokens_per_s']:.1f} | {w['wait_fraction']:.0%} | {w['latency_s']:.2f} |")  # fmt: skip
    print(
        "\n| mode | admit s (weights/admit_s) | `areal fleet add --wait` s | reform s | pause s, update after "
        "the join | pause s, normal update (median) | servers per step | every batch full |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        reform = f"{r['reform_s']:.3f}" if r["mode"] == "broadcast" else "— (no group)"
        print(f"| {r['mode']} | {r['admit_s']:.3f} | {r['add_wall_s']:.2f} | {reform} | {r['join_pause_s']:.3f} | "
              f"{r['normal_pause_s']:.3f} | {r['servers']} | {r['full']} |")  # fmt: skip
    for r in runs:
        ratio = r["after"]["samples_per_s"] / r["before"]["samples_per_s"]
        print(f"\n{r['mode']}: samples/s 2 servers / 1 server = {ratio:.2f}; generated tokens/s "
              f"{r['after']['gen_tokens_per_s'] / r['before']['gen_tokens_per_s']:.2f}")  # fmt: skip
        report(f"elastic fleet ({r['mode']}, {args.model}): samples/s with 2 servers / 1 server", ratio)
        if r["mode"] == "broadcast":
            report(
                f"elastic fleet (broadcast, {args.model}): update pause after a join / normal update pause",
                (r["reform_s"] + r["join_pause_s"]) / r["normal_pause_s"],
                higher_is_better=False,
            )
        report(f"elastic fleet ({r['mode']}, {args.model}): admit s / normal update pause s",
               r["admit_s"] / r["normal_pause_s"], higher_is_better=False)  # fmt: skip


if __name__ == "__main__":
    main()
