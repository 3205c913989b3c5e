"""Faults injected into real ``areal train`` runs; each test checks that
nothing is lost: failures are counted in the metrics, the run either completes
or stops with one clear line, and what it wrote before (config, metrics,
recovery checkpoints) is still there and readable.

Everything is real: the ``areal`` CLI in a subprocess, embedded inference
server processes, reward worker processes, the torch train engine, on a tiny
random Llama with SmolLM2's tokenizer. The faults come from a real plugin
package (``fault_plugins/areal-fault-inject``, pip-installed into a private
directory) that registers rewards that raise or hang and a loss that wraps
the built-in ``ppo`` loss and turns NaN on chosen steps.

A server that exits at start is also covered one level down, at the
launcher (tests/inference/test_embedded_server.py::
test_port_clash_is_retried_and_broken_model_dir_raises_with_log_tail); here
it is seen through ``areal train``, plus a server that never gets healthy.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from areal_kernel.testing.packages import pip_install_private
from areal_kernel.testing.procs import live_processes
from areal_kernel.utils import prefork

os.environ.setdefault("OMP_NUM_THREADS", "1")

HERE = Path(__file__).resolve().parent
PLUGIN_SRC = HERE / "fault_plugins" / "areal-fault-inject"

pytestmark = pytest.mark.slow

# The smallest loop that still overlaps generation and training: 2 prompts x
# 4 samples per step, 4 new tokens, no held-out evaluation (its reward calls
# would mix with the training ones that the counters are checked against).
BASE = [
    "dataset.type=file", "dataset.eval_fraction=0", "dataset.shuffle=false", "trainer.eval_size=0",
    "trainer.batch_size=2", "rollout.gconfig.n_samples=4", "rollout.gconfig.max_new_tokens=4",
    "algorithm.dynamic_filter=false", "logging.sinks=[jsonl]",
]  # fmt: skip


# -- fixtures -----------------------------------------------------------------


@pytest.fixture(scope="module")
def fault_site(tmp_path_factory) -> Path:
    """The fault plugin, pip-installed into a private directory (put on the
    PYTHONPATH of the ``areal`` processes only)."""
    return pip_install_private(PLUGIN_SRC, tmp_path_factory.mktemp("fault-plugin"))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A tiny random Llama (from a LlamaConfig) with SmolLM2's real tokenizer."""
    from areal_kernel.testing.models import make_tiny_chat_llama

    return make_tiny_chat_llama(tmp_path_factory.mktemp("fault-tiny"))


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> str:
    """16 records whose answers are their index: ``fault_raise_some`` raises
    for answers 3, 7, 11, 15 (one record in four, whatever the order in which
    groups finish, so the failure budget of 0.5 is never reached)."""
    path = tmp_path_factory.mktemp("fault-data") / "train.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i in range(16):
            f.write(json.dumps({"id": f"q{i}", "prompt": f"What is {i} + 0?", "answer": str(i)}) + "\n")
    return str(path)


class Run:
    """A finished ``areal train``: its exit code, output and files."""

    def __init__(self, proc: subprocess.CompletedProcess, run_dir: Path, fault_dir: Path) -> None:
        self.returncode = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr
        self.run_dir = run_dir
        self.fault_dir = fault_dir

    def explain(self) -> str:
        return f"rc={self.returncode}\n--- stdout\n{self.stdout[-3000:]}\n--- stderr\n{self.stderr[-5000:]}"

    def metrics(self) -> list[dict]:
        """Every line must parse: a crash or stop must not leave a torn line."""
        with open(self.run_dir / "metrics.jsonl", encoding="utf-8") as f:
            return [json.loads(line) for line in f]

    def steps(self) -> list[dict]:
        return [r for r in self.metrics() if "perf/step_s" in r]

    def reward_calls(self) -> list[tuple[str, str]]:
        """(answer, outcome) of every reward call, as logged by the fault rewards."""
        log = self.fault_dir / "calls.log"
        if not log.exists():
            return []
        return [tuple(line.split()) for line in log.read_text().splitlines()]


def _processes_with(marker: str) -> list[int]:
    """Pids of live processes whose environment carries ``marker``: the run's
    servers and reward workers inherit it from the ``areal`` process."""
    return [p.pid for p in live_processes(lambda p: p.environ_has(marker))]


def _run_areal_train(
    overrides: list[str], *, site: Path, model: str, data: str, workdir: Path, env: dict[str, str], timeout: float
) -> Run:
    """``areal train`` with the fault plugin installed; afterwards no process
    of the run (server, reward worker) may be left behind."""
    run_dir = workdir / "run"
    fault_dir = workdir / "faults"
    fault_dir.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex
    full_env = dict(os.environ)
    full_env.update(
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p),
        AREAL_FAULT_DIR=str(fault_dir),
        AREAL_FAULT_RUN=tag,
    )
    full_env.update(env)
    args = [
        sys.executable, "-m", "areal_kernel.cli", "train", "/dev/null",
        f"model.path={model}", f"run_dir={run_dir}", f"dataset.path={data}", *BASE, *overrides,
    ]  # fmt: skip
    popen = prefork.popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env, start_new_session=True
    )
    try:
        out, err = popen.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(popen.pid, signal.SIGTERM)  # the run turns SIGTERM into a clean stop
        out, err = popen.communicate()
        raise AssertionError(f"areal train did not finish within {timeout} s (a fault made it hang)\n{err[-5000:]}")
    # Servers and reward workers live in their own sessions: the run must
    # have stopped them (a worker also exits within ~1 s of its parent).
    marker = f"AREAL_FAULT_RUN={tag}"
    deadline = time.monotonic() + 20
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _processes_with(marker)
    for pid in left:  # clean up before failing, so other tests are not disturbed
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"processes of the run left behind: {left}\n{err[-3000:]}"
    return Run(subprocess.CompletedProcess(args, popen.returncode, out, err), run_dir, fault_dir)


def _no_weights_model(tiny_model: str, workdir: Path) -> str:
    """A model directory with a config and a tokenizer (what the trainer
    reads) but no weights: the server process exits while loading it."""
    broken = workdir / "no-weights"
    shutil.copytree(tiny_model, broken, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    return str(broken)


# max_staleness=0: every step's tokens were sampled with the trainer's weights,
# the ones the alarm reads (docs/monitoring.md).
MONITOR_BASE = ["reward.type=fault_spread", "monitor.mismatch.action=error", "monitor.mismatch.patience=2",
                "rollout.max_staleness=0"]  # fmt: skip
LORA = ["actor.torch.lora={rank: 4, alpha: 8, name: policy}"]
WEIGHTS_BASE = ["reward.type=fault_spread", "monitor.weights.action=error", "rollout.backend=embedded:d2"]
CORRUPTED = "model.layers.1.mlp.down_proj.weight"
NAN_BASE = ["reward.type=fault_spread", "algorithm.loss=fault_nan_ppo", "checkpoint.save_every=1"]

# One ``areal train`` run per test: (overrides, extra environment, model
# directory maker or None for the tiny model). Longest first.
CASES: dict[str, tuple[list[str], dict[str, str], object]] = {
    # The first two calls sleep for an hour; reward.timeout_s=2 kills them (the
    # other calls are instant: the fault module is imported at worker start-up).
    # One worker: every later call waits behind the hung ones, so both are
    # over before step 1 can be assembled.
    "hang": (["reward.type=fault_hang_first", "reward.timeout_s=2", "reward.workers=1", "trainer.max_steps=2"],
             {"AREAL_FAULT_HANGS": "2"}, None),
    "nan_isolated": ([*NAN_BASE, "algorithm.fault_nan_ppo={nan_steps: [2]}", "trainer.max_steps=4",
                      "checkpoint.keep_last=3"], {}, None),
    # Step 1 trains, steps 2.. are NaN; max_skipped_steps=1 allows one in a row.
    "nan_streak": ([*NAN_BASE, "algorithm.fault_nan_ppo={nan_steps: [2, 3, 4, 5, 6]}", "trainer.max_skipped_steps=1",
                    "trainer.max_steps=6", "checkpoint.keep_last=2"], {}, None),
    "raise": (["reward.type=fault_raise_some", "trainer.max_steps=3"], {}, None),
    # Two episodes at a time and no run-ahead: the budget (checked once 20
    # calls were made) trips at step 2 or 3, after a recovery checkpoint.
    "budget": (["reward.type=fault_always_raise", "trainer.max_steps=8", "checkpoint.save_every=1",
                "checkpoint.keep_last=8", "rollout.max_concurrent_rollouts=2", "rollout.max_staleness=0"], {}, None),
    # The mismatch monitor set to stop the run at its second mismatched step:
    # the clean run must finish, the one whose servers sample at a quarter of
    # the trainer's temperature must stop at step 2.
    "mismatch_clean": ([*MONITOR_BASE, "trainer.max_steps=3"], {}, None),
    "mismatch_cold": ([*MONITOR_BASE, "trainer.max_steps=4", "workflow.type=fault_hot_rlvr",
                       "workflow.fault_hot_rlvr.temperature_factor=0.25"], {}, None),
    # Every weight update through the fault plugin's disk transport; the
    # corrupted run gets one tensor of version 2 changed by one ulp per element
    # between the trainer's write and the servers' load, its clean twin the
    # same transport with nothing changed. Two servers: the check names the
    # server, and both loaded the corrupted file.
    "weights_clean": ([*WEIGHTS_BASE, "trainer.max_steps=3"], {"AREAL_FAULT_CORRUPT": "none"}, None),
    "weights_corrupt": ([*WEIGHTS_BASE, "trainer.max_steps=4"], {"AREAL_FAULT_CORRUPT": f"2:{CORRUPTED}"}, None),
    # The same transport; update 2 reaches only the first server, the second
    # is told version 2 and keeps serving version 1's weights.
    "weights_stale": ([*WEIGHTS_BASE, "trainer.max_steps=4"], {"AREAL_FAULT_STALE": "2"}, None),
    # A LoRA run: adapter update 2 never reaches the second server.
    "adapter_dropped": ([*WEIGHTS_BASE, *LORA, "trainer.max_steps=4"], {"AREAL_FAULT_STALE": "2"}, None),
    "adapter_clean": ([*WEIGHTS_BASE, *LORA, "trainer.max_steps=3"], {"AREAL_FAULT_CORRUPT": "none"}, None),
    "server_exits": (["trainer.max_steps=2"], {}, _no_weights_model),
    # Python alone takes longer than 1 s to start the server: it is alive but
    # not yet answering /health when the launcher gives up and kills it.
    # Plain server starts (no prefork server): a fresh interpreter takes
    # seconds to import torch, a preforked server is healthy within 1 s.
    "server_unhealthy": (["trainer.max_steps=2", "rollout.embedded.startup_timeout_s=1"],
                         {prefork.PREFORK_ENV: ""}, None),
}  # fmt: skip

# Runs at once: each is mostly one busy process (trainer or server start-up),
# so a 2-core machine finishes the set in about half the sequential time.
PARALLEL_RUNS = 3


@pytest.fixture(scope="module")
def fault_runs(request, fault_site, tiny_model, data_file, tmp_path_factory) -> dict:
    """Start the runs of every selected test at once (a few at a time); each
    test waits for its own (TEST_CASE maps tests to CASES)."""
    from concurrent.futures import ThreadPoolExecutor

    selected = {getattr(item, "originalname", item.name) for item in request.session.items}
    direct = {TEST_CASE[t] for t in selected if t in TEST_CASE}
    wanted = [case for case in CASES if case in direct or direct & set(ALSO_FOR.get(case, ()))]
    pool = ThreadPoolExecutor(PARALLEL_RUNS, thread_name_prefix="areal-fault-run")

    def one(name: str) -> Run:
        overrides, env, make_model = CASES[name]
        workdir = tmp_path_factory.mktemp(f"fault-{name}")
        model = make_model(tiny_model, workdir) if make_model else tiny_model
        return _run_areal_train(
            overrides, site=fault_site, model=model, data=data_file, workdir=workdir, env=env, timeout=420
        )

    futures = {name: pool.submit(one, name) for name in wanted}
    yield futures
    pool.shutdown(wait=True)


@pytest.fixture
def run(request, fault_runs) -> Run:
    return fault_runs[TEST_CASE[request.node.originalname]].result()


def _one_line_error(r: Run) -> str:
    """The run's error: exactly one ``areal: error:`` line, last on stderr, no traceback."""
    assert r.returncode != 0, r.explain()
    assert "Traceback" not in r.stderr, r.explain()
    errors = [line for line in r.stderr.splitlines() if line.startswith("areal: error:")]
    assert len(errors) == 1, r.explain()
    assert r.stderr.rstrip().splitlines()[-1] == errors[0], r.explain()
    return errors[0]


def _weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def _same(a: dict, b: dict) -> bool:
    import torch

    assert a.keys() == b.keys()
    return all(torch.equal(a[k], b[k]) for k in a)


def _complete_recovery(run_dir: Path) -> dict[int, Path]:
    """``recover/step<N>`` directories that carry the COMPLETE marker, by N;
    each must be readable: its marker and trainer state parse, its weights load."""
    import torch

    root = run_dir / "recover"
    out = {}
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        if d.name.startswith("step") and (d / "COMPLETE").is_file():
            json.loads((d / "COMPLETE").read_text())
            state = json.loads((d / "trainer_state.json").read_text())
            assert state["step"] == int(d.name[4:])
            w = _weights(d / "engine" / "model.safetensors")
            assert w and all(torch.isfinite(t).all() for t in w.values()), f"non-finite weights in {d}"
            out[int(d.name[4:])] = d
    return out


# -- rewards ------------------------------------------------------------------


def test_reward_that_raises_is_scored_zero_and_counted(run):
    r = run
    assert r.returncode == 0, r.explain()
    assert json.loads((r.run_dir / "result.json").read_text())["steps"] == 3
    steps = r.steps()
    assert [s["step"] for s in steps] == [1, 2, 3]
    # Counted: per step (since the previous step) and in total, and nothing is
    # lost between the two.
    totals = [s["reward/failures_total"] for s in steps]
    assert totals == sorted(totals) and totals[-1] > 0, totals
    assert sum(s["reward/failures"] for s in steps) == totals[-1]
    assert all(0 <= s["reward/failures"] <= s["reward/calls"] for s in steps)
    # Every raise the reward function made was seen (later ones happen after
    # the last step's line, while the executor is still generating ahead).
    calls = r.reward_calls()
    raised = sum(1 for _, outcome in calls if outcome == "raise")
    assert totals[-1] <= raised and sum(s["reward/calls"] for s in steps) <= len(calls)
    # Scored 0, not dropped: the trained groups are known from samples.jsonl
    # (uid e<epoch>-<index>; the record's answer is its index), and each
    # step's mean reward is exactly the share of groups whose reward worked.
    trained = [json.loads(line) for line in (r.run_dir / "samples.jsonl").read_text().splitlines()]
    assert [t["step"] for t in trained] == [1, 2, 3]
    failing_groups = 0
    for t, s in zip(trained, steps):
        idx = [int(uid.split("-")[1]) for uid in t["uids"]]
        ok = [0.0 if i % 4 == 3 else 1.0 for i in idx]
        failing_groups += ok.count(0.0)
        assert s["reward/mean"] == pytest.approx(sum(ok) / len(ok)), (t, s)
        assert s["batch/sequences"] == 8  # no sample was dropped
    assert failing_groups > 0, "no failing group was trained on; the data order no longer exercises the fault"


def test_reward_that_hangs_times_out_and_is_counted(run):
    # The run stops two calls that would hang for an hour (see CASES["hang"]).
    r = run
    assert r.returncode == 0, r.explain()
    steps = r.steps()
    assert [s["step"] for s in steps] == [1, 2]
    assert [s["reward/failures_total"] for s in steps] == [2, 2], steps
    assert sum(s["reward/failures"] for s in steps) == 2
    assert [o for _, o in r.reward_calls()].count("hang") == 2
    assert json.loads((r.run_dir / "result.json").read_text())["samples"] == 16


def test_failure_budget_stops_the_run_and_keeps_what_was_written(run):
    import yaml

    r = run
    line = _one_line_error(r)
    assert "reward calls failed" in line and "reward.max_failure_fraction=0.5" in line, line
    assert "injected reward failure (always)" in line, line  # the cause, not only the count
    assert not (r.run_dir / "result.json").exists()
    cfg = yaml.safe_load((r.run_dir / "config.yaml").read_text())
    assert cfg["reward"]["type"] == "fault_always_raise"
    steps = r.steps()
    assert steps, "no step was logged before the budget stopped the run"
    assert steps[-1]["step"] < 8
    for s in steps:  # every call failed, and every failure is counted
        assert s["reward/failures"] == s["reward/calls"] and s["reward/mean"] == 0.0
    assert steps[-1]["reward/failures_total"] == sum(s["reward/failures"] for s in steps) > 0
    assert steps[-1]["reward/failures_total"] <= len(r.reward_calls())
    # The recovery checkpoints written before the stop are complete and readable.
    ckpts = _complete_recovery(r.run_dir)
    # Saved after every step but the one that tripped the budget.
    assert sorted(ckpts) == list(range(1, steps[-1]["step"])), (sorted(ckpts), steps[-1]["step"])
    state = json.loads((ckpts[max(ckpts)] / "trainer_state.json").read_text())
    calls, failures = state["reward_counts"]
    assert calls == failures > 0


# -- non-finite loss ----------------------------------------------------------


def test_isolated_nan_step_is_skipped_and_leaves_weights_unchanged(run):
    r = run
    assert r.returncode == 0, r.explain()
    steps = r.steps()
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert [s["train/skipped"] for s in steps] == [0.0, 1.0, 0.0, 0.0]
    assert steps[1]["train/loss"] is None  # NaN is written as null
    assert json.loads((r.run_dir / "result.json").read_text())["steps"] == 4
    # No recovery checkpoint is written right after a skipped step (the
    # newest ones stay ones taken after a step that trained); that a skipped
    # step leaves weights and moments untouched is shown on the engine itself
    # (tests/engine/test_torch_engine.py::test_nan_loss_skips_step_then_recovers).
    ckpts = _complete_recovery(r.run_dir)
    assert sorted(ckpts) == [1, 3]
    w1, w3 = (_weights(ckpts[k] / "engine" / "model.safetensors") for k in (1, 3))
    assert all(bool(t.isfinite().all()) for t in w3.values()), "NaN reached the weights"
    assert not _same(w1, w3), "step 3 did not change the weights: training did not go on after the skipped step"


def test_nan_streak_stops_the_run_and_keeps_the_last_good_checkpoint(run):
    r = run
    line = _one_line_error(r)
    assert "2 consecutive training steps had non-finite loss or gradients" in line, line
    assert "trainer.max_skipped_steps=1" in line, line
    assert not (r.run_dir / "result.json").exists()
    steps = r.steps()
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert [s["train/skipped"] for s in steps] == [0.0, 1.0, 1.0]
    # The message names the newest complete recovery checkpoint: step 1's,
    # the last step that trained (none is written during the streak) ...
    named = Path(line.split("Last good checkpoint:", 1)[1].strip())
    ckpts = _complete_recovery(r.run_dir)
    assert sorted(ckpts) == [1] and named == ckpts[1], (named, ckpts)
    # ... and its weights are those step 1 produced: nothing NaN reached them.
    assert _same(_weights(ckpts[1] / "engine" / "model.safetensors"), _weights(named / "engine" / "model.safetensors"))


# -- train/inference mismatch monitor ------------------------------------------


def _mismatch(steps: list[dict]) -> list[float]:
    return [s["mismatch/fresh_k3"] for s in steps]


def test_mismatch_monitor_stays_quiet_on_a_clean_run(run):
    r = run
    assert r.returncode == 0, r.explain()
    steps = r.steps()
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(s["mismatch/tokens"] == s["train/n_loss_tokens"] > 0 for s in steps), steps
    assert all(s["monitor/mismatch_alarm"] == 0.0 and s["monitor/mismatch_streak"] == 0.0 for s in steps), steps
    # Every step sampled with the weights the trainer holds (max_staleness=0):
    # the two log-probabilities of each token come from the same weights.
    assert all(s["mismatch/fresh_tokens"] == s["mismatch/tokens"] for s in steps), steps
    assert "train/inference mismatch" not in r.stdout + r.stderr, r.explain()


def test_mismatch_monitor_stops_a_run_whose_servers_sample_at_another_temperature(run, fault_runs):
    r = run
    line = _one_line_error(r)
    assert "train/inference mismatch at step 2" in line, line
    assert "monitor.mismatch.bound=0.01 for 2 consecutive checked steps" in line, line
    assert "temperature" in line, line  # what to check
    assert not (r.run_dir / "result.json").exists()
    steps = r.steps()  # the step that fired is logged before the stop
    assert [s["step"] for s in steps] == [1, 2], steps
    assert [s["monitor/mismatch_streak"] for s in steps] == [1.0, 2.0]
    assert [s["monitor/mismatch_alarm"] for s in steps] == [0.0, 1.0]
    # Against the noise floor of the clean run over the same steps: the
    # faulted run's k3 is far above its largest (measured: 1.3e-13 to
    # 1.6e-13 clean, 0.16-0.21 faulted on this tiny model).
    clean = fault_runs["mismatch_clean"].result()
    assert clean.returncode == 0, clean.explain()
    floor = max(_mismatch(clean.steps()))
    assert min(_mismatch(steps)) > 0.01 > floor, (_mismatch(steps), floor)
    assert min(_mismatch(steps)) > 1000 * floor, (_mismatch(steps), floor)


# -- weight-delivery check ------------------------------------------------------


def test_weight_check_passes_every_update_of_a_clean_run(run):
    r = run
    assert r.returncode == 0, r.explain()
    steps = r.steps()
    assert [s["step"] for s in steps] == [1, 2, 3]
    # The tiny Llama's 20 tensors all fit in one update's sample (40 per update), on both servers.
    n = steps[0]["monitor/weights_checked"]
    assert n > 0 and n % 2 == 0 and all(s["monitor/weights_servers"] == 2 for s in steps), steps
    assert all(s["monitor/weights_checked"] == n and s["monitor/weights_mismatch"] == 0 for s in steps), steps
    assert not (r.fault_dir / "corrupted.log").exists()
    assert "weight delivery check" not in r.stdout + r.stderr, r.explain()


def test_weight_check_names_the_tensor_corrupted_in_transit_in_that_update(run, fault_runs):
    r = run
    line = _one_line_error(r)
    assert (r.fault_dir / "corrupted.log").read_text().split() == ["2", CORRUPTED]
    assert "weight delivery check failed at version 2: server 127.0.0.1:" in line, line
    assert f"tensor '{CORRUPTED}' at version 2" in line, line
    assert "(and 1 more: tensors ['" + CORRUPTED + "'])" in line, line  # the other server loaded the same file
    assert "weight_update.mode" in line, line  # what to check
    steps = r.steps()  # the update's step is logged before the stop
    assert [s["step"] for s in steps] == [1, 2], steps
    assert [s["monitor/weights_mismatch"] for s in steps] == [0.0, 2.0]
    assert not (r.run_dir / "result.json").exists()
    # The clean twin, same transport and steps: no mismatch (its own test checks the rest).
    clean = fault_runs["weights_clean"].result()
    assert clean.returncode == 0, clean.explain()
    assert [s["monitor/weights_mismatch"] for s in clean.steps()[:2]] == [0.0, 0.0]


def test_weight_check_names_the_server_left_on_old_weights(run, fault_runs):
    """A weight sync that did not land on one server (it was told version 2,
    kept version 1's weights): the check at update 2 names that server, and
    only that one; the run stops there. The clean twin (same transport,
    every update delivered) is the control."""
    r = run
    line = _one_line_error(r)
    version, stale = (r.fault_dir / "stale.log").read_text().split()
    assert version == "2"
    assert f"weight delivery check failed at version 2: server {stale}: tensor '" in line, line
    steps = r.steps()
    assert [s["step"] for s in steps] == [1, 2], steps
    # Every trained tensor differs on the stale server; the other server matches.
    n_tensors = steps[0]["monitor/weights_checked"] / 2
    assert steps[0]["monitor/weights_mismatch"] == 0 and 0 < steps[1]["monitor/weights_mismatch"] <= n_tensors, steps
    assert not (r.run_dir / "result.json").exists()
    clean = fault_runs["weights_clean"].result()
    assert clean.returncode == 0 and not (clean.fault_dir / "stale.log").exists(), clean.explain()


def test_weight_check_names_the_server_an_adapter_update_never_reached(run, fault_runs):
    """LoRA: adapter update 2 is loaded by the first server only; the second
    keeps serving version 1 of the adapter. The check (over the adapter's
    tensors) stops the run at step 2 naming that server only; the clean
    LoRA run through the same transport is the control."""
    r = run
    line = _one_line_error(r)
    version, stale = (r.fault_dir / "stale.log").read_text().split()
    assert version == "2"
    assert f"weight delivery check failed at version 2: server {stale}: tensor '" in line, line
    assert "lora" in line, line  # an adapter tensor
    steps = r.steps()
    assert [s["step"] for s in steps] == [1, 2], steps
    assert steps[0]["monitor/weights_mismatch"] == 0 and steps[1]["monitor/weights_mismatch"] > 0, steps
    clean = fault_runs["adapter_clean"].result()
    assert clean.returncode == 0, clean.explain()
    steps = clean.steps()
    assert [s["step"] for s in steps] == [1, 2, 3] and all(s["monitor/weights_mismatch"] == 0 for s in steps)
    assert all(s["monitor/weights_checked"] > 0 for s in steps), steps


# -- inference servers --------------------------------------------------------


def _server_error(r: Run) -> tuple[str, str]:
    """(the message's own part, the server log tail it quotes); the part
    written by ``areal`` has no traceback (the tail may: it is the server's)."""
    assert r.returncode == 2, r.explain()
    err = r.stderr
    assert "areal: error: embedded server" in err, r.explain()
    head, sep, tail = err.partition("--- last 30 log lines ---")
    assert sep, r.explain()
    assert "Traceback" not in head and "areal_kernel/cli.py" not in err, r.explain()
    return head, tail


def test_server_that_exits_at_start_is_reported_with_its_log_tail(run):
    r = run
    broken = Path(run.run_dir).parent / "no-weights"
    head, tail = _server_error(r)
    assert "exited with code 1 before becoming healthy" in head, r.explain()
    assert str(r.run_dir / "server-0.log") in head
    assert f"failed to load model from '{broken}'" in tail, r.explain()  # the server's own last words
    assert not (r.run_dir / "metrics.jsonl").exists() or not r.steps()


def test_server_never_healthy_within_startup_timeout(run):
    r = run
    head, _ = _server_error(r)
    assert "not healthy after 1 s" in head and "startup_timeout_s" in head, r.explain()
    assert str(r.run_dir / "server-0.log") in head


# Runs that a test of another case also reads: case -> those cases.
ALSO_FOR = {
    "mismatch_clean": ("mismatch_cold",),  # the cold run's noise floor
    "weights_clean": ("weights_corrupt", "weights_stale"),  # the faulted runs' clean twin
    "adapter_clean": ("adapter_dropped",),  # the dropped adapter update's clean twin
}

TEST_CASE = {
    test_reward_that_raises_is_scored_zero_and_counted.__name__: "raise",
    test_reward_that_hangs_times_out_and_is_counted.__name__: "hang",
    test_failure_budget_stops_the_run_and_keeps_what_was_written.__name__: "budget",
    test_isolated_nan_step_is_skipped_and_leaves_weights_unchanged.__name__: "nan_isolated",
    test_nan_streak_stops_the_run_and_keeps_the_last_good_checkpoint.__name__: "nan_streak",
    test_mismatch_monitor_stays_quiet_on_a_clean_run.__name__: "mismatch_clean",
    test_mismatch_monitor_stops_a_run_whose_servers_sample_at_another_temperature.__name__: "mismatch_cold",
    test_weight_check_passes_every_update_of_a_clean_run.__name__: "weights_clean",
    test_weight_check_names_the_tensor_corrupted_in_transit_in_that_update.__name__: "weights_corrupt",
    test_weight_check_names_the_server_left_on_old_weights.__name__: "weights_stale",
    test_weight_check_names_the_server_an_adapter_update_never_reached.__name__: "adapter_dropped",
    test_server_that_exits_at_start_is_reported_with_its_log_tail.__name__: "server_exits",
    test_server_never_healthy_within_startup_timeout.__name__: "server_unhealthy",
}
