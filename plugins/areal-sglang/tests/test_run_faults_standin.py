"""Fault tests through ``areal train`` with ``rollout.backend: sglang``, on
STAND-IN SGLang servers (SGLang cannot run on these machines): the servers
are ``sglang_standin.py`` in its real-model mode (``HFModel``: the run's tiny
Llama, sampled token by token at the request's temperature, logprobs as
SGLang reports them), started by the real ``SGLangLauncher`` as
``python -m sglang.launch_server`` from a STAND-IN SGLang environment
(``rollout.sglang.python``: the ``sglang_standin_env_python`` fixture),
spoken to by the real SGLang protocol, every launch command and request
body checked by SGLang's own classes (the oracle).

The faults come from the fault plugin of tests/faults (pip-installed into a
private directory, as tests/faults/test_run_faults.py does): the servers
sampling at a quarter of the trainer's temperature (the mismatch alarm), one
tensor flipped by one ulp on disk between the trainer's write and the
servers' load, and an adapter update that never reaches the second server
(the weight-delivery check). One clean two-server run is the control of the
first two; the adapter run's first step (and version 0) is its own clean
part (and the clean adapter path is tested in test_weight_check_standin.py).
"""

from __future__ import annotations

import json
import os
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
REPO = HERE.parent.parent.parent
FAULT_PLUGIN = REPO / "tests" / "faults" / "fault_plugins" / "areal-fault-inject"

pytestmark = pytest.mark.slow

# As tests/faults: 2 prompts x 4 samples per step, 4 new tokens, no evaluation;
# max_staleness=0 makes every token one the alarm reads (docs/monitoring.md).
BASE = [
    "dataset.type=file", "dataset.eval_fraction=0", "dataset.shuffle=false", "trainer.eval_size=0",
    "trainer.batch_size=2", "rollout.gconfig.n_samples=4", "rollout.gconfig.max_new_tokens=4",
    "algorithm.dynamic_filter=false", "logging.sinks=[jsonl]", "reward.type=fault_spread",
    "rollout.max_staleness=0", "monitor.mismatch.action=error", "monitor.mismatch.patience=2",
    "monitor.weights.action=error", "rollout.sglang.startup_timeout_s=300",
]  # fmt: skip
LORA = ["actor.torch.lora={rank: 4, alpha: 8, name: policy}"]
CORRUPTED = "model.layers.1.mlp.down_proj.weight"

# One run per case: (overrides, extra environment). The weight cases have two
# servers (the check names one), through the fault plugin's disk transport
# (AREAL_FAULT_CORRUPT / AREAL_FAULT_STALE set, "none": nothing changed).
CASES: dict[str, tuple[list[str], dict[str, str]]] = {
    # The control of every fault below: both monitors on, the fault transport passing everything.
    "clean": (["rollout.backend=sglang:d2", "trainer.max_steps=3"], {"AREAL_FAULT_CORRUPT": "none"}),
    "cold": (["rollout.backend=sglang", "trainer.max_steps=4", "workflow.type=fault_hot_rlvr",
              "workflow.fault_hot_rlvr.temperature_factor=0.25"], {}),
    "corrupt": (["rollout.backend=sglang:d2", "trainer.max_steps=4"], {"AREAL_FAULT_CORRUPT": f"2:{CORRUPTED}"}),
    "adapter_dropped": (["rollout.backend=sglang:d2", *LORA, "trainer.max_steps=4"], {"AREAL_FAULT_STALE": "2"}),
    # Not a fault: several policies (docs/multi-policy.md) on two servers, the kernel's disk transport.
    "policies": (["rollout.backend=sglang:d2", "trainer.max_steps=2", "weight_update.mode=disk",
                  "policies={ask: {lora: {rank: 4, alpha: 8}}, tell: {lora: {rank: 2, alpha: 4}}}"], {}),
}  # fmt: skip
# Runs at once: each is a trainer plus one or two single-threaded servers.
PARALLEL_RUNS = 2


@pytest.fixture(scope="module")
def fault_site(tmp_path_factory) -> Path:
    return pip_install_private(FAULT_PLUGIN, tmp_path_factory.mktemp("fault-plugin"))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from areal_kernel.testing.models import make_tiny_chat_llama

    return make_tiny_chat_llama(tmp_path_factory.mktemp("sglang-fault-tiny"))


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("sglang-fault-data") / "train.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i in range(16):
            f.write(json.dumps({"id": f"q{i}", "prompt": f"What is {i} + 0?", "answer": str(i)}) + "\n")
    return str(path)


class Run:
    def __init__(self, proc: subprocess.CompletedProcess, run_dir: Path, fault_dir: Path, wall_s: float) -> None:
        self.returncode, self.stdout, self.stderr = proc.returncode, proc.stdout, proc.stderr
        self.run_dir, self.fault_dir, self.wall_s = run_dir, fault_dir, wall_s

    def explain(self) -> str:
        logs = ""
        for log in sorted(self.run_dir.glob("**/sglang-*.log")):
            logs += f"\n--- {log.name}\n" + log.read_text(errors="replace")[-2000:]
        return f"rc={self.returncode}\n--- stdout\n{self.stdout[-3000:]}\n--- stderr\n{self.stderr[-5000:]}{logs}"

    def steps(self) -> list[dict]:
        with open(self.run_dir / "metrics.jsonl", encoding="utf-8") as f:
            return [r for r in map(json.loads, f) if "perf/step_s" in r]


def _areal_train(overrides, env, *, site, model, data, python, oracle_url, workdir: Path) -> Run:
    run_dir, fault_dir = workdir / "run", workdir / "faults"
    fault_dir.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex
    full_env = dict(os.environ, OMP_NUM_THREADS="1", AREAL_FAULT_DIR=str(fault_dir), AREAL_FAULT_RUN=tag)
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    full_env.update(env)
    # The servers: the stand-in's real-model mode, their bodies checked by the oracle.
    server_env = json.dumps({"AREAL_SGLANG_STANDIN_MODEL": "hf", "AREAL_SGLANG_ORACLE_URL": oracle_url})
    args = [
        sys.executable, "-m", "areal_kernel.cli", "train", "/dev/null", f"model.path={model}", f"run_dir={run_dir}",
        f"dataset.path={data}", f"rollout.sglang.python={python}", f"rollout.sglang.extra_env={server_env}",
        *BASE, *overrides,
    ]  # fmt: skip
    t0 = time.monotonic()
    # Through the prefork server (as tests/faults/test_run_faults.py): the
    # trainer starts with torch and transformers already imported.
    popen = prefork.popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env, start_new_session=True
    )
    try:
        out, err = popen.communicate(timeout=480)
    except subprocess.TimeoutExpired:
        os.killpg(popen.pid, signal.SIGTERM)  # the run turns SIGTERM into a clean stop
        out, err = popen.communicate()
        raise AssertionError(f"areal train did not finish within 480 s\n{err[-5000:]}") from None
    wall = time.monotonic() - t0
    # The servers live in their own sessions: the run must have stopped them.
    marker = f"AREAL_FAULT_RUN={tag}"
    deadline = time.monotonic() + 20
    while (left := [p.pid for p in live_processes(lambda p: p.environ_has(marker))]) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"processes of the run left behind: {left}\n{err[-3000:]}"
    return Run(subprocess.CompletedProcess(args, popen.returncode, out, err), run_dir, fault_dir, wall)


@pytest.fixture(scope="module")
def runs(request, fault_site, tiny_model, data_file, sglang_standin_env_python, oracle_url, tmp_path_factory) -> dict:
    """Every case's run, started at once (PARALLEL_RUNS at a time); each test
    waits for the ones it reads."""
    from concurrent.futures import ThreadPoolExecutor

    selected = {getattr(item, "originalname", item.name) for item in request.session.items}
    wanted = [c for c in CASES if any(c in NEEDS.get(t, ()) for t in selected)]
    pool = ThreadPoolExecutor(PARALLEL_RUNS, thread_name_prefix="areal-sglang-fault-run")

    def one(name: str) -> Run:
        overrides, env = CASES[name]
        return _areal_train(
            overrides, env, site=fault_site, model=tiny_model, data=data_file, python=sglang_standin_env_python,
            oracle_url=oracle_url, workdir=tmp_path_factory.mktemp(f"sglang-fault-{name}"),
        )  # fmt: skip

    futures = {name: pool.submit(one, name) for name in wanted}
    yield futures
    pool.shutdown(wait=True)


def _one_line_error(r: Run) -> str:
    """Exactly one ``areal: error:`` line, last on stderr, no traceback."""
    assert r.returncode != 0, r.explain()
    assert "Traceback" not in r.stderr, r.explain()
    errors = [line for line in r.stderr.splitlines() if line.startswith("areal: error:")]
    assert len(errors) == 1 and r.stderr.rstrip().splitlines()[-1] == errors[0], r.explain()
    return errors[0]


def _k3(steps: list[dict]) -> list[float]:
    return [s["mismatch/fresh_k3"] for s in steps]


def _report(name: str, r: Run) -> None:
    # The measured values, for docs/monitoring.md (shown with -s).
    steps = r.steps()
    print(f"\n{name}: {r.wall_s:.0f} s, fresh_k3 {_k3(steps)}, abs_max {[s['mismatch/fresh_abs_max'] for s in steps]}")


def test_clean_run_passes_both_monitors(runs):
    r = runs["clean"].result()
    assert r.returncode == 0, r.explain()
    _report("clean", r)
    steps = r.steps()
    assert [s["step"] for s in steps] == [1, 2, 3], r.explain()
    # Every token fresh and compared; the real model's logprobs agree with the
    # trainer's recompute to float rounding (measured: fresh_k3 1.4e-13 to
    # 2.6e-13, abs_max 9.5e-7 to 1.9e-6, float32).
    assert all(s["mismatch/fresh_tokens"] == s["mismatch/tokens"] == s["train/n_loss_tokens"] > 0 for s in steps)
    assert all(s["monitor/mismatch_alarm"] == 0.0 and s["monitor/mismatch_streak"] == 0.0 for s in steps), steps
    # (Its k3 is the noise floor the temperature fault is compared against, in that test.)
    # Both servers answered every check, over every tensor, with no mismatch.
    n = steps[0]["monitor/weights_checked"]
    assert n > 0 and n % 2 == 0 and all(s["monitor/weights_servers"] == 2 for s in steps), steps
    assert all(s["monitor/weights_checked"] == n and s["monitor/weights_mismatch"] == 0 for s in steps), steps
    assert "train/inference mismatch" not in r.stdout + r.stderr, r.explain()
    assert "weight delivery check failed" not in r.stdout + r.stderr, r.explain()


def test_servers_sampling_at_another_temperature_trip_the_mismatch_alarm(runs):
    r = runs["cold"].result()
    line = _one_line_error(r)
    _report("cold", r)
    assert "train/inference mismatch at step 2" in line, line
    assert "monitor.mismatch.bound=0.01 for 2 consecutive checked steps" in line and "temperature" in line, line
    steps = r.steps()
    assert [s["step"] for s in steps] == [1, 2], steps
    assert [s["monitor/mismatch_alarm"] for s in steps] == [0.0, 1.0]
    # Against the clean run's noise floor, measured here on the same stand-in
    # (measured: 0.066 to 0.10 faulted, at most 2.6e-13 clean).
    clean = runs["clean"].result()
    assert clean.returncode == 0, clean.explain()
    floor = max(_k3(clean.steps()))
    assert min(_k3(steps)) > 0.01 > floor, (_k3(steps), floor)
    assert min(_k3(steps)) > 1000 * floor, (_k3(steps), floor)


def test_weight_check_names_the_tensor_corrupted_in_transit(runs):
    r = runs["corrupt"].result()
    line = _one_line_error(r)
    assert (r.fault_dir / "corrupted.log").read_text().split() == ["2", CORRUPTED]
    # Read back through SGLang's /get_weights_by_name from both servers, which loaded the same file.
    assert "weight delivery check failed at version 2: server 127.0.0.1:" in line, line
    assert f"tensor '{CORRUPTED}' at version 2" in line, line
    assert "(and 1 more: tensors ['" + CORRUPTED + "'])" in line, line
    steps = r.steps()
    assert [s["step"] for s in steps] == [1, 2], steps
    assert [s["monitor/weights_mismatch"] for s in steps] == [0.0, 2.0]


def test_weight_check_names_the_server_an_adapter_update_never_reached(runs):
    """LoRA: adapter update 2 reaches the first server only. SGLang cannot
    read an adapter's weights back; the check compares the directory each
    server serves it from (``/v1/models``) with the one the trainer wrote."""
    r = runs["adapter_dropped"].result()
    line = _one_line_error(r)
    version, stale = (r.fault_dir / "stale.log").read_text().split()
    assert version == "2"
    assert f"weight delivery check failed at version 2: server {stale}: tensor '*' at version 2: " in line, line
    assert "the server reports serving weight version 1 (it serves adapter 'policy' from '" in line, line
    assert line.count("server 127.0.0.1:") == 1, line  # the other server is not named
    steps = r.steps()
    assert [s["step"] for s in steps] == [1, 2], steps
    # Step 1 is the clean part: both servers serve version 1's directory (one comparison each).
    assert [s["monitor/weights_checked"] for s in steps] == [2.0, 2.0], steps
    assert [s["monitor/weights_mismatch"] for s in steps] == [0.0, 1.0], steps
    # Said once: the adapter's bytes are not compared.
    assert (r.stdout + r.stderr).count("answers the version of adapter 'policy' only, not its bytes") == 1, r.explain()


def test_two_policies_share_the_servers(runs):
    """Several policies on two SGLang (stand-in) servers: each step trains
    one policy and loads that adapter alone on both servers (unload + load:
    SGLang replaces an adapter so); the weight-delivery check finds both
    servers serving each policy's newest directory; every trained sample
    names its policy's adapter, and both servers generated."""
    r = runs["policies"].result()
    assert r.returncode == 0, r.explain()
    # Started from the first policy's config, the servers serve both adapters
    # (largest rank 4, both and the base in one batch), checked by SGLang's parser.
    command = next(
        line for line in (next(r.run_dir.glob("**/sglang-0.log"))).read_text().splitlines() if "--model-path" in line
    )
    assert "--enable-lora --max-lora-rank 4" in command and "--max-loras-per-batch 3" in command, command
    with open(r.run_dir / "metrics.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    order = [n for row in rows for n in ("ask", "tell") if f"policy/{n}/step" in row]
    assert order == ["ask", "tell", "ask", "tell"], order
    for name in ("ask", "tell"):
        mine = [row for row in rows if f"policy/{name}/step" in row]
        assert [row[f"policy/{name}/version"] for row in mine] == [1, 2]
        assert all(row[f"policy/{name}/monitor/weights_servers"] == 2 for row in mine), mine
        assert all(row[f"policy/{name}/monitor/weights_mismatch"] == 0 for row in mine), mine
        assert all(0 < row[f"policy/{name}/weights/mb"] < 1 for row in mine)  # the adapter alone
        # SGLang replaces an adapter between requests: the servers are paused for its update.
        assert all(row[f"policy/{name}/weights/pause_s"] > 0 for row in mine)
    with open(r.run_dir / "samples.jsonl", encoding="utf-8") as f:
        logged = [json.loads(line) for line in f if line.strip()]
    assert [{s["adapter"] for s in line["samples"]} for line in logged] == [{n} for n in order]
    assert len({s["server"] for line in logged for s in line["samples"]}) == 2


# The runs each test reads (only the selected tests' runs are started).
NEEDS = {
    test_clean_run_passes_both_monitors.__name__: ("clean",),
    test_servers_sampling_at_another_temperature_trip_the_mismatch_alarm.__name__: ("cold", "clean"),
    test_weight_check_names_the_tensor_corrupted_in_transit.__name__: ("corrupt",),
    test_weight_check_names_the_server_an_adapter_update_never_reached.__name__: ("adapter_dropped",),
    test_two_policies_share_the_servers.__name__: ("policies",),
}
