"""Can the end-to-end learning tests tell learning from noise?

For each backend, runs the configuration its learning test runs several
times with the test's learning rate and several times with every learning
rate at 0 (the negative control: same sampling, same data order, weights
frozen), and reports the test's statistic (``areal_kernel.testing.learning``)
for both arms: the frozen runs' mean and standard deviation, the learning
runs' minimum, the bar, and where the bar sits in frozen standard deviations
(goal: at least 3 above the frozen mean, and below every learning run).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_learning_signal.py --backend torch --seeds 3 [--out runs.jsonl]
    ... --backend lora | multi_turn | vlm         (cheap: a few GB, one process each; multi_turn: a tiny model)
    ... --backend fsdp | megatron | vllm          (several GB: two ranks, or a vLLM server)
    ... --table runs.jsonl [more.jsonl ...]       (the table again from saved runs, no run)

Each run is one line of JSON in ``--out`` (backend, arm, seed, per-step
sampling reward, wall time), so a long measurement can be stopped and its
table printed from what finished. ``--steps`` and extra ``key=value``
overrides change every run (the bar is then not the test's).
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
from areal_kernel.testing import learning  # noqa: E402

ARITH = ["trainer.eval_size=0", "logging.sinks=[jsonl]"]
# What each backend's learning test runs: its config, every learning rate it
# trains with, its steps and its check (the statistic and the bar).
BACKENDS: dict[str, dict] = {
    "torch": {"example": "examples/grpo_arithmetic.yaml", "lr": ["actor.torch.lr"], "steps": 6,
              "check": learning.ARITHMETIC, "overrides": [*ARITH, "actor.torch.lr_scheduler=constant"]},
    "lora": {"example": "examples/grpo_lora.yaml", "lr": ["actor.torch.lr"], "steps": 6,
             "check": learning.ARITHMETIC, "overrides": [*ARITH, "actor.torch.lr_scheduler=constant"]},
    "multi_turn": {"example": "examples/grpo_multi_turn.yaml", "lr": ["actor.torch.lr"],
                   "steps": learning.TINY_MULTI_TURN_STEPS, "check": learning.MULTI_TURN, "tiny_byte_model": True,
                   "overrides": [*ARITH, *learning.TINY_MULTI_TURN_OVERRIDES]},
    "vlm": {"example": "examples/vlm_shapes.yaml", "lr": ["actor.torch.lr"], "steps": 20,
            "check": learning.VLM_SHAPES, "overrides": ARITH, "sft": "examples/vlm_shapes_sft.yaml"},
    "fsdp": {"example": "plugins/areal-fsdp/examples/grpo_arithmetic_fsdp.yaml", "lr": ["actor.fsdp.lr"],
             "steps": learning.TINY_STEPS, "check": learning.TINY_CHARS, "tiny_byte_model": True,
             "overrides": [*ARITH, *learning.TINY_OVERRIDES, f"actor.fsdp.lr={learning.TINY_LR}"]},
    "megatron": {"example": "plugins/areal-megatron/examples/grpo_arithmetic_megatron.yaml",
                 "lr": ["actor.megatron.lr"], "steps": learning.TINY_STEPS, "check": learning.TINY_CHARS,
                 "tiny_byte_model": True,
                 "overrides": [*ARITH, *learning.TINY_OVERRIDES, f"actor.megatron.lr={learning.TINY_LR}"]},
    "vllm": {"example": "examples/grpo_arithmetic.yaml", "lr": ["actor.torch.lr"], "steps": learning.TINY_STEPS,
             "check": learning.TINY_CHARS_VLLM, "tiny_byte_model": learning.TINY_VLLM_MODEL,
             "overrides": [*ARITH, *learning.TINY_VLLM_OVERRIDES]},
}  # fmt: skip


def areal(args: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "areal_kernel.cli", *args], env=dict(os.environ, OMP_NUM_THREADS="1"),
                          cwd=REPO, capture_output=True, text=True)  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"areal {' '.join(args)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def run(backend: str, seed: int, frozen: bool, steps: int, root: str, extra: list[str]) -> dict:
    spec = BACKENDS[backend]
    arm = "frozen" if frozen else "learning"
    run_dir = os.path.join(root, f"{backend}-{arm}-seed{seed}")
    t0 = time.monotonic()
    model: list[str] = []
    if spec.get("tiny_byte_model"):  # the test's tiny model, built once per measurement (same seed: same weights)
        shape = spec["tiny_byte_model"] if isinstance(spec["tiny_byte_model"], dict) else {}
        model_dir = os.path.join(root, "tiny-byte-model" + "".join(f"-{k}{v}" for k, v in sorted(shape.items())))
        if not os.path.isfile(os.path.join(model_dir, "model.safetensors")):
            from areal_kernel.testing.models import make_tiny_byte_chat_llama

            make_tiny_byte_chat_llama(model_dir, **shape)
        model = [f"model.path={model_dir}"]
    if "sft" in spec:  # stage 1 (SFT) once per seed, shared by both arms
        sft_dir = os.path.join(root, f"{backend}-sft-seed{seed}")
        if not os.path.isdir(os.path.join(sft_dir, "checkpoints", "final")):
            areal(["train", spec["sft"], f"seed={seed}", f"run_dir={sft_dir}", "logging.sinks=[jsonl]"])
        model = [f"model.path={sft_dir}/checkpoints/final"]
    t1 = time.monotonic()
    areal(["train", spec["example"], f"seed={seed}", f"run_dir={run_dir}", f"trainer.max_steps={steps}",
           *model, *spec["overrides"], *(learning.frozen_overrides(*spec["lr"]) if frozen else []), *extra])  # fmt: skip
    rows = learning.step_rows(run_dir)
    return {"backend": backend, "arm": arm, "seed": seed, "steps": steps,
            "rewards": spec["check"].series(rows), "wall_s": time.monotonic() - t1, "sft_s": t1 - t0}  # fmt: skip


def table(rows: list[dict]) -> None:
    print("\n| backend | check | frozen: n, mean, std | learning: n, min, mean | bar | bar - frozen mean (frozen std) "
          "| wall s per run: learning / frozen |")
    print("|---|---|---|---|---|---|---|")
    for backend, spec in BACKENDS.items():
        check: learning.LearningCheck = spec["check"]
        mine = [r for r in rows if r["backend"] == backend and r["steps"] == spec["steps"]]
        stat = {arm: [check.statistic([{check.metric: x} for x in r["rewards"]]) for r in mine if r["arm"] == arm]
                for arm in ("learning", "frozen")}  # fmt: skip
        wall = {arm: [r["wall_s"] for r in mine if r["arm"] == arm] for arm in ("learning", "frozen")}
        if not stat["learning"] and not stat["frozen"]:
            continue
        fz, ln = stat["frozen"], stat["learning"]
        f_mean = statistics.mean(fz) if fz else float("nan")
        f_std = statistics.stdev(fz) if len(fz) > 1 else float("nan")
        sigmas = (check.bar - f_mean) / f_std if len(fz) > 1 and f_std > 0 else float("nan")
        ln_text = f"{len(ln)}, {min(ln):.3f}, {statistics.mean(ln):.3f}" if ln else "0"
        w = " / ".join(f"{statistics.mean(v):.0f}" if v else "-" for v in wall.values())
        print(f"| {backend} | {check.name} | {len(fz)}, {f_mean:.3f}, {f_std:.3f} | {ln_text} | {check.bar:.2f} "
              f"| {sigmas:.1f} | {w} |")  # fmt: skip
        for arm in ("learning", "frozen"):
            for r in mine:
                if r["arm"] == arm:
                    print(f"    {arm} seed {r['seed']}: {[round(x, 3) for x in r['rewards']]}")
        if len(fz) > 1 and ln:
            report(f"learning signal {backend}: (bar - frozen mean) / frozen std", sigmas, 3.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", action="append", choices=sorted(BACKENDS), help="repeatable; default torch")
    ap.add_argument("--seeds", type=int, default=3, help="seeds 1..N, each run with lr and with lr=0")
    ap.add_argument("--seed", type=int, action="append", help="these seeds instead of 1..N (repeatable)")
    ap.add_argument("--arm", choices=["learning", "frozen"], default=None,
                    help="only this arm (e.g. learning for a backend whose test shares another's lr=0 control)")
    ap.add_argument("--steps", type=int, default=None, help="override the test's number of steps")
    ap.add_argument("--out", default=None, help="append each run as a JSON line here")
    ap.add_argument("--table", nargs="+", default=None, help="print the table from saved runs and stop")
    ap.add_argument("overrides", nargs="*", help="config overrides passed to every run")
    args = ap.parse_args()
    if args.table:
        table([json.loads(line) for path in args.table for line in open(path) if line.strip()])
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="learning-signal-") as root:
        for backend in args.backend or ["torch"]:
            steps = args.steps or BACKENDS[backend]["steps"]
            for seed in args.seed or range(1, args.seeds + 1):
                for frozen in [f for f in (False, True) if args.arm in (None, "frozen" if f else "learning")]:
                    r = run(backend, seed, frozen, steps, root, args.overrides)
                    rows.append(r)
                    print(f"{backend} {r['arm']} seed {seed}: {[round(x, 3) for x in r['rewards']]} "
                          f"({r['wall_s']:.0f} s)", flush=True)  # fmt: skip
                    if args.out:
                        with open(args.out, "a") as f:
                            f.write(json.dumps(r) + "\n")
    table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
