"""Two policies in one run vs two single-policy runs, on SmolLM2-135M.

One ``areal train`` run with ``policies:`` (docs/multi-policy.md) trains two
LoRA adapters on one frozen SmolLM2-135M: ``add`` on single-digit sums,
``sub`` on single-digit differences, each with its own held-out set. Against
it: two single-policy LoRA runs, one after the other, one per task, with the
same steps, adapter, batch and held-out set per policy. The two-policy run
is examples/two_tasks_arithmetic.yaml, the single runs
examples/grpo_lora.yaml (embedded server, torch engine, max_staleness 1; the
two files agree on everything else).

Printed per run: wall time of the whole ``areal train`` process (start,
held-out evaluations, training, export), the training loop alone
(``result.json``'s ``train_seconds``), the peak memory of the process tree
(the trainer, its inference server and reward workers: the sum of their RSS,
sampled every 0.5 s with psutil; RSS counts pages shared between processes
once per process, so the sum overstates what the tree takes from the
machine), the CPU seconds of the tree (user + system, the last sample of
each process: the work done, which other jobs on the machine stretch less
than the wall time), the mean wait for a batch and train time per step, and
each policy's held-out greedy accuracy before and after.
Ratios: wall time of the two single runs together over the multi-policy run
(goal >= 1.5) and the multi-policy run's peak over the peaks of the two
single runs added (what running them side by side takes; goal <= 0.6).

The base model must stay the base: while each run trains, a few prompts are
sent to its inference server greedily with no adapter (first as soon as the
server answers, then every ``--probe-every`` seconds and once right after
the last training step) and every answer must equal the first.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_multi_policy.py [--steps 8] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any

from prompts import chat_prompt_ids  # bench/prompts.py
from summary import report  # bench/summary.py: one table of ratios for `make bench`

os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "grpo_lora.yaml")  # the single runs
# The two-policy run: each policy is grpo_lora.yaml's adapter for its task
# (tests/algo/test_examples.py checks that the two files agree).
TWO_TASKS = os.path.join(REPO, "examples", "two_tasks_arithmetic.yaml")
SERVER_MODULE = "areal_kernel.inference.embedded.server"
TASKS = {"add": "+", "sub": "-"}
PROBES = ["What is 3 + 4?", "What is 8 - 5?", "Name a colour.", "What is 12 + 9? Answer with just the number."]


@dataclass
class Run:
    name: str
    wall_s: float = 0.0
    peak_rss: int = 0  # bytes, sum over the process tree
    peak_procs: int = 0
    cpu_s: dict[int, float] = field(default_factory=dict)  # CPU seconds (user + system) last seen per process
    result: dict[str, Any] = field(default_factory=dict)
    probes: list[tuple[float, list[list[int]]]] = field(default_factory=list)  # (time, outputs)
    total_steps: int = 0
    probed_after_step: int = -1  # the steps done when the last successful probe was sent
    probe_errors: list[str] = field(default_factory=list)
    steps: list[dict[str, float]] = field(default_factory=list)  # per training step: perf/* (any policy)
    gpu_mib: float | None = None  # peak GPU memory in use during the run, over what was in use before it


def _tree(pid: int) -> list[Any]:
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _rss(procs: list[Any]) -> int:
    import psutil

    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass  # gone between the listing and the read
    return total


def _gpu_used_mib() -> float | None:
    """GPU memory in use on this machine now, MiB (every GPU together), or
    None without ``nvidia-smi``. Per process it is often not reported inside
    containers, so the run's share is the peak over what was in use before
    it started (nothing else uses the GPU while a benchmark runs)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    try:
        return sum(float(x) for x in out.stdout.split())
    except ValueError:
        return None


def _server_address(procs: list[Any]) -> str | None:
    import psutil

    for p in procs:
        try:
            cmd = p.cmdline()
        except psutil.Error:
            continue
        if SERVER_MODULE in cmd and "--port" in cmd:
            host = cmd[cmd.index("--host") + 1] if "--host" in cmd else "127.0.0.1"
            return f"{host}:{cmd[cmd.index('--port') + 1]}"
    return None


def _post(address: str, path: str, body: dict[str, Any] | None, timeout: float = 60.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{address}{path}", data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _base_outputs(address: str, prompts: list[list[int]], eos: int, errors: list[str]) -> list[list[int]] | None:
    """Greedy answers of the base model (no adapter) to ``prompts``, or None
    when the server does not answer (not up yet, or gone; why: ``errors``)."""
    out = []
    for ids in prompts:
        for _ in range(50):
            body = {
                "rid": f"probe-{uuid.uuid4().hex}",
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": 8, "greedy": True, "temperature": 1.0, "stop_token_ids": [eos]},
                "adapter": None,
            }
            try:
                data = _post(address, "/generate", body)
            except (urllib.error.URLError, OSError, ValueError) as e:
                errors.append(f"{time.strftime('%H:%M:%S')} {type(e).__name__}: {e}")
                return None
            if data.get("finish_reason") != "abort":  # aborted by a weight update's pause: ask again
                out.append([int(x) for x in data["output_ids"]])
                break
            time.sleep(0.2)
        else:
            errors.append("aborted 50 times in a row")
            return None
    return out


def _steps_logged(run_dir: str) -> int:
    """Training steps done so far: ``samples.jsonl`` has a line per step and
    is flushed at every step (``metrics.jsonl`` may sit in a buffer)."""
    try:
        with open(os.path.join(run_dir, "samples.jsonl")) as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 0


def _step_perf(run_dir: str) -> list[dict[str, float]]:
    """Each training step's ``perf/*`` numbers (a multi-policy step's with its ``policy/<name>/`` prefix dropped)."""
    out = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            perf = {k.rsplit("perf/", 1)[1]: v for k, v in row.items() if "perf/" in k}
            if "step_s" in perf:
                out.append(perf)
    return out


def _check_two_tasks() -> None:
    """The two-policy example trains TASKS' policies, each on its operator
    (the single runs are built from TASKS): read off each policy's config
    as the run resolves it."""
    from areal_kernel.config.loader import check_policies, load_config
    from areal_kernel.plugins import get_registry

    reg = get_registry()
    policies = check_policies(load_config(TWO_TASKS, registry=reg), reg)
    ops = {n: list(c.dataset.arithmetic.ops) for n, c in policies.items()}
    if ops != {n: [op] for n, op in TASKS.items()}:
        sys.exit(f"{TWO_TASKS}: its policies' ops {ops} are not this benchmark's tasks {TASKS}")


def run(name: str, config: str, overrides: list[str], root: str, total_steps: int, prompts: list[list[int]], eos: int,
        probe_every: float) -> Run:  # fmt: skip
    run_dir = os.path.join(root, name)
    cmd = [
        sys.executable, "-m", "areal_kernel.cli", "train", config, f"experiment_name=bench-{name}",
        f"run_dir={run_dir}", "logging.sinks=[jsonl]", *overrides,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = Run(name, total_steps=total_steps)
    gpu_before = _gpu_used_mib()
    log_path = os.path.join(root, f"{name}.log")
    print(f"--- {name}: {' '.join(cmd[3:])}", flush=True)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            procs = _tree(proc.pid)
            rss = _rss(procs)
            if rss > out.peak_rss:
                out.peak_rss, out.peak_procs = rss, len(procs)
            if gpu_before is not None and (used := _gpu_used_mib()) is not None:
                out.gpu_mib = max(out.gpu_mib or 0.0, used - gpu_before)
            for p in procs:
                try:
                    t = p.cpu_times()
                    out.cpu_s[p.pid] = t.user + t.system
                except Exception:
                    pass  # gone meanwhile: its last sample stands
            done.wait(0.5)

    def probe() -> None:
        # As soon as the server answers, every probe_every seconds, and after
        # every training step is logged (the last one's probe may find the
        # server already stopping).
        address, next_at = None, 0.0
        while not done.is_set():
            if address is None:
                address = _server_address(_tree(proc.pid))
            steps = _steps_logged(run_dir)
            if address is not None and (steps > out.probed_after_step or time.monotonic() >= next_at):
                got = _base_outputs(address, prompts, eos, out.probe_errors)
                if got is not None:
                    out.probes.append((time.monotonic() - t0, got))
                    next_at = time.monotonic() + probe_every
                    out.probed_after_step = max(out.probed_after_step, steps)
            done.wait(0.2)

    threads = [threading.Thread(target=sample, daemon=True), threading.Thread(target=probe, daemon=True)]
    for t in threads:
        t.start()
    rc = proc.wait()
    out.wall_s = time.monotonic() - t0
    done.set()
    for t in threads:
        t.join(timeout=120)
    if rc != 0:
        with open(log_path) as f:
            tail = f.read()[-4000:]
        raise SystemExit(f"{name}: areal train exited {rc}:\n{tail}")
    with open(os.path.join(run_dir, "result.json")) as f:
        out.result = json.load(f)
    out.steps = _step_perf(run_dir)
    # Other work on the machine stretches every number: say how busy it was.
    load = os.getloadavg()[1]
    print(
        f"--- {name}: {out.wall_s:.0f} s, peak RSS {out.peak_rss / 2**20:.0f} MiB; load average {load:.1f}", flush=True
    )
    return out


def _prompts(model: str) -> tuple[list[list[int]], int]:
    from transformers import AutoTokenizer

    from areal_kernel.models.resolve import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path(model))
    return chat_prompt_ids(tok, PROBES), int(tok.eos_token_id)


def _unchanged(r: Run) -> bool:
    """Whether the run was probed and every probe got the first probe's answers."""
    return bool(r.probes) and all(outs == r.probes[0][1] for _, outs in r.probes)


def _identical(r: Run) -> str:
    if not r.probes:
        return "not probed"
    same = _unchanged(r)
    return (
        f"{'yes' if same else '**no**'} ({len(r.probes)} probes, the last after step "
        f"{max(0, r.probed_after_step)} of {r.total_steps})"
    )


# Every run's optimizer steps do the same work (one policy's batch of the same
# shape, the same model), so their median time per step is the machine's
# speed: a run whose steps took this much longer than another's ran on a
# slower machine (other load, a cold start), and a wall-time ratio across them
# measures that too. Quiet runs here differ by under 10%.
SPEED_TOLERANCE = 1.25


def speed_changed(runs: "tuple[Run, ...]") -> str | None:
    """Why the runs' wall times cannot be compared (None when they can): the
    slowest run's median training step over the fastest's, past ``SPEED_TOLERANCE``."""
    import statistics

    per_step = {r.name: statistics.median(x["train_s"] for x in r.steps) for r in runs if r.steps}
    if len(per_step) < 2:
        return None
    slow, fast = max(per_step, key=per_step.__getitem__), min(per_step, key=per_step.__getitem__)
    if per_step[slow] <= SPEED_TOLERANCE * per_step[fast]:
        return None
    return (
        f"a training step took {per_step[slow]:.2f} s in {slow} and {per_step[fast]:.2f} s in {fast} "
        f"(median; more than {SPEED_TOLERANCE:g}x apart for the same work)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8, help="RL steps per policy (default 8)")
    ap.add_argument("--quick", action="store_true", help="2 steps per policy, 16 held-out questions: a smoke run")
    ap.add_argument("--eval-size", type=int, default=32, help="held-out questions per policy (default 32)")
    ap.add_argument("--batch-size", type=int, default=4, help="prompts per step (x8 samples; default 4)")
    ap.add_argument("--probe-every", type=float, default=30.0, help="seconds between base-model probes")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument(
        "--policy-order", choices=("weight", "ready", "together"), default="weight",
        help="trainer.policy_order of the multi-policy run (default weight: the fixed order; together: both "
        "policies at every step, in shared forwards)",
    )  # fmt: skip
    ap.add_argument("--keep", default=None, help="keep the runs' directories and logs here (default: a temp dir)")
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="a config override for every run (e.g. rollout.share_devices=true on a one-GPU machine); repeatable",
    )  # fmt: skip
    ap.add_argument("--json", default=None, help="also write the numbers to this file")
    args = ap.parse_args()
    steps, eval_size = (2, 16) if args.quick else (args.steps, args.eval_size)
    common = [
        f"model.path={args.model}", f"trainer.max_steps={steps}", f"trainer.batch_size={args.batch_size}",
        f"trainer.eval_size={eval_size}", f"dataset.arithmetic.n_eval={eval_size}", *args.set,
    ]  # fmt: skip
    _check_two_tasks()
    prompts, eos = _prompts(args.model)
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-multi-policy-") as tmp:
        root = args.keep or tmp
        singles = {
            name: run(
                f"single-{name}", EXAMPLE,
                # The example's adapter, named after the policy as in the two-policy run.
                [*common, f"dataset.arithmetic.ops=['{op}']", f"actor.torch.lora.name={name}"],
                root, steps, prompts, eos, args.probe_every,
            )
            for name, op in TASKS.items()
        }  # fmt: skip
        multi = run(
            "multi", TWO_TASKS, [*common, f"trainer.policy_order={args.policy_order}"],
            root, 2 * steps, prompts, eos, args.probe_every,
        )  # fmt: skip

    single_wall = sum(r.wall_s for r in singles.values())
    single_train = sum(r.result["train_seconds"] for r in singles.values())
    single_peak_sum = sum(r.peak_rss for r in singles.values())
    single_peak_max = max(r.peak_rss for r in singles.values())
    mib = 2**20
    print(f"\n{os.path.basename(args.model.rstrip('/'))}, LoRA rank 16 per policy, {steps} steps per policy, batch {args.batch_size} x 8 samples, "
          f"{eval_size} held-out questions per policy, policy_order {args.policy_order}; one run at a time on this "
          "machine")  # fmt: skip
    print(
        "\n| run | wall s | CPU s (tree) | training loop s | per step: waiting for the batch s / training s | "
        "peak RSS MiB (tree sum, procs) | base greedy outputs unchanged |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in (*singles.values(), multi):
        wait = sum(x["wait_rollout_s"] for x in r.steps) / max(1, len(r.steps))
        train = sum(x["train_s"] for x in r.steps) / max(1, len(r.steps))
        print(
            f"| {r.name} | {r.wall_s:.0f} | {sum(r.cpu_s.values()):.0f} | {r.result['train_seconds']:.0f} | "
            f"{wait:.1f} / {train:.1f} "
            f"({len(r.steps)} steps) | {r.peak_rss / mib:.0f} ({r.peak_procs}) | {_identical(r)} |"
        )
    single_cpu = sum(sum(r.cpu_s.values()) for r in singles.values())
    print(f"| two single runs, one after the other | {single_wall:.0f} | {single_cpu:.0f} | {single_train:.0f} | | "
          f"max {single_peak_max / mib:.0f}, sum {single_peak_sum / mib:.0f} | |")  # fmt: skip
    print("\n| policy | held-out accuracy, single run (before -> after) | in the multi-policy run (before -> after) |")
    print("|---|---|---|")
    for name in TASKS:
        s, m = singles[name].result, multi.result["policies"][name]
        print(f"| {name} | {s['before']:.3f} -> {s['after']:.3f} | {m['before']:.3f} -> {m['after']:.3f} |")
    wall_ratio = single_wall / multi.wall_s
    mem_ratio = multi.peak_rss / single_peak_sum
    print(f"\ntwo single runs / multi-policy run, wall time: {wall_ratio:.2f}x "
          f"(training loops alone: {single_train / multi.result['train_seconds']:.2f}x)")  # fmt: skip
    print(f"two single runs / multi-policy run, CPU seconds: {single_cpu / sum(multi.cpu_s.values()):.2f}x")
    print(f"multi-policy peak / (single peaks added): {mem_ratio:.2f} "
          f"(/ the larger single peak: {multi.peak_rss / single_peak_max:.2f})")  # fmt: skip
    runs = (*singles.values(), multi)
    unreliable = speed_changed(runs)
    if unreliable:
        print(f"WARNING: {unreliable}: the wall-time ratio compares runs on a machine of another speed; run the "
              "bench again on a quiet machine", flush=True)  # fmt: skip
    unchanged = all(_unchanged(r) for r in runs)
    gpu = [r.gpu_mib for r in runs]
    gpu_ratio = None
    if all(g is not None and g > 0 for g in gpu):
        gpu_ratio = gpu[-1] / (gpu[0] + gpu[1])  # type: ignore[operator]
        print(f"GPU memory in use, peak MiB: {', '.join(f'{r.name} {r.gpu_mib:.0f}' for r in runs)}"
              f"; multi-policy / (singles added): {gpu_ratio:.2f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "model": args.model, "steps_per_policy": steps, "overrides": args.set,
                    "wall_s": {r.name: round(r.wall_s, 1) for r in runs},
                    "train_s": {r.name: round(r.result["train_seconds"], 1) for r in runs},
                    "wall_ratio": round(wall_ratio, 3), "rss_ratio": round(mem_ratio, 3),
                    "gpu_mib": {r.name: r.gpu_mib for r in runs}, "gpu_ratio": gpu_ratio,
                    "accuracy": {
                        n: {"single": [singles[n].result["before"], singles[n].result["after"]],
                            "multi": [multi.result["policies"][n]["before"], multi.result["policies"][n]["after"]]}
                        for n in TASKS
                    },
                    "base_unchanged": unchanged,
                },
                f, indent=1,
            )  # fmt: skip
    report(
        "multi-policy: two single-policy runs / one two-policy run, wall seconds", wall_ratio, goal=1.5,
        unreliable=unreliable,
    )  # fmt: skip
    report(
        "multi-policy: two-policy run / two single runs side by side, peak RSS", mem_ratio, goal=0.6,
        higher_is_better=False,
    )  # fmt: skip
    if not unchanged:
        print("WARNING: the base model's greedy outputs changed during a run (see the table)", flush=True)


if __name__ == "__main__":
    main()
