"""The ``slurm`` scheduler on a real two-node Slurm cluster (``slurm_cluster``):
the same small GRPO run (tiny random model with SmolLM2's tokenizer, one
embedded server, two FSDP ranks on gloo) inside an ``salloc`` allocation and
through a job the scheduler submits with ``sbatch``; ``scancel`` of a running
run's job leaves no process. Where each process ran is read from Slurm
itself (``squeue --steps``), not from the run's own logs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid

import pytest

from areal_kernel.testing.procs import live_processes, wait_gone

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
EXAMPLE = os.path.join(REPO, "plugins", "areal-fsdp", "examples", "grpo_arithmetic_fsdp.yaml")


def grpo_args(model_dir: str, run_dir: str, steps: int = 2) -> list[str]:
    return [
        "train", EXAMPLE, f"model.path={model_dir}", f"run_dir={run_dir}", f"trainer.max_steps={steps}",
        "trainer.batch_size=2", "trainer.eval_size=0", "rollout.gconfig.n_samples=4",
        "rollout.gconfig.max_new_tokens=6", "weight_update.mode=disk", "algorithm.dynamic_filter=false",
        "logging.sinks=[jsonl]", "scheduler.type=slurm",
    ]  # fmt: skip


class SlurmWatch:
    """Polls the cluster while a run goes on: every step seen (name -> node)
    and every job seen (id -> node list)."""

    def __init__(self, cluster) -> None:
        self.cluster = cluster
        self.steps: dict[str, str] = {}
        self.jobs: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "SlurmWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            for line in self.cluster.run("squeue", "-h", "-s", "-o", "%j %N", check=False).stdout.splitlines():
                name, _, node = line.partition(" ")
                self.steps.setdefault(name, node.strip())
            for line in self.cluster.run("squeue", "-h", "-t", "R", "-o", "%i %N", check=False).stdout.splitlines():
                job, _, nodes = line.partition(" ")
                self.jobs.setdefault(job, nodes.strip())
            time.sleep(0.25)

    def role_nodes(self, role: str) -> dict[int, str]:
        """Index -> node of each step of ``role`` (names: areal-<role>-<index>-...)."""
        out = {}
        for name, node in self.steps.items():
            parts = name.split("-")
            if len(parts) >= 3 and parts[0] == "areal" and parts[1] == role:
                out[int(parts[2])] = node
        return out


def marked_env(cluster) -> tuple[dict[str, str], str]:
    """The cluster's environment plus a unique variable that every process of
    the run inherits (srun and sbatch pass the environment on)."""
    value = uuid.uuid4().hex
    env = dict(cluster.env, AREAL_SLURM_TEST_RUN=value)
    return env, f"AREAL_SLURM_TEST_RUN={value}"


def assert_nothing_left(marker: str, exclude: int | None = None) -> None:
    left = [p for p in live_processes(lambda q: q.environ_has(marker)) if p.pid != exclude]
    still = [f"{p.pid} {' '.join(p.argv[:4])}" for p in left if not wait_gone(p.pid, 30)]
    assert not still, f"processes of the run outlived it: {still}"


def assert_no_job_left(cluster) -> None:
    """No job in the queue (a cancelled job is listed while it completes, briefly)."""
    deadline = time.monotonic() + 30
    while cluster.run("squeue", "-h", check=False).stdout.strip():
        assert time.monotonic() < deadline, cluster.run("squeue", check=False).stdout
        time.sleep(0.2)


def check_run(run_dir: str, proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.load(open(os.path.join(run_dir, "result.json")))
    assert result["steps"] == 2 and result["samples"] == 16
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["version"] for r in rows if "perf/step_s" in r] == [1, 2]
    # One log per process, on the controller's machine.
    assert os.path.getsize(os.path.join(run_dir, "server-0.log")) > 0
    assert sorted(os.listdir(os.path.join(run_dir, "fsdp-ranks"))) == ["rank-0.log", "rank-1.log"]


def test_settings_are_validated(slurm_cluster, run_areal, areal_tiny_chat_model_dir, tmp_path):
    env = slurm_cluster.env
    bad = run_areal("validate", EXAMPLE, "scheduler.type=slurm", "scheduler.slurm.time_limit=soon", env=env)
    assert bad.returncode == 2 and "scheduler.slurm.time_limit" in bad.stderr, bad.stderr
    typo = run_areal("validate", EXAMPLE, "scheduler.type=slurm", "scheduler.slurm.cpus=2", env=env)
    assert typo.returncode == 2 and "scheduler.slurm.cpus" in typo.stderr, typo.stderr
    # No job to run in: the plan says a job will be submitted, and nothing is.
    plan = run_areal("plan", *grpo_args(areal_tiny_chat_model_dir, str(tmp_path / "r"))[1:], env=env)
    assert plan.returncode == 0, plan.stderr
    assert "submitted when the run starts" in plan.stdout and "heterogeneous" not in plan.stdout, plan.stdout
    assert not slurm_cluster.run("squeue", "-h").stdout.strip()
    # Inside an allocation: placements on its nodes.
    salloc = slurm_cluster.run(
        "salloc", "-N2", "-n3", sys.executable, "-m", "areal_kernel.cli", "plan", "--json",
        *grpo_args(areal_tiny_chat_model_dir, str(tmp_path / "r"))[1:], timeout=120,
    )  # fmt: skip
    placed = json.loads(salloc.stdout[salloc.stdout.index("{") :])["placement"]["roles"]
    nodes = {(role, p["index"]): p["node"] for role, ps in placed.items() for p in ps}
    assert set(nodes) == {("actor", 0), ("actor", 1), ("rollout", 0)}, placed
    assert set(nodes.values()) == {"n1", "n2"}, placed  # 3 one-CPU processes need both nodes
    assert all(p["host"] == "127.0.0.1" for ps in placed.values() for p in ps), placed  # the nodes' NodeAddr


def test_grpo_inside_an_salloc_allocation(slurm_cluster, areal_tiny_chat_model_dir, tmp_path):
    run_dir = str(tmp_path / "run")
    env, marker = marked_env(slurm_cluster)
    cmd = [
        "salloc",
        "-N2",
        "-n3",
        sys.executable,
        "-m",
        "areal_kernel.cli",
        *grpo_args(areal_tiny_chat_model_dir, run_dir),
    ]
    with SlurmWatch(slurm_cluster) as watch:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    check_run(run_dir, proc)
    # Every process was a step of the allocation, and the three filled both nodes.
    ranks, servers = watch.role_nodes("actor"), watch.role_nodes("rollout")
    assert sorted(ranks) == [0, 1] and sorted(servers) == [0], watch.steps
    assert set(ranks.values()) | set(servers.values()) == {"n1", "n2"}, watch.steps
    assert_nothing_left(marker)


def test_grpo_through_a_submitted_heterogeneous_job(slurm_cluster, areal_tiny_chat_model_dir, tmp_path):
    run_dir = str(tmp_path / "run")
    env, marker = marked_env(slurm_cluster)
    # Servers ask for 2 CPUs, ranks for 1: one job component per role.
    cmd = [sys.executable, "-m", "areal_kernel.cli", *grpo_args(areal_tiny_chat_model_dir, run_dir),
           "scheduler.slurm.mode=submit", "scheduler.slurm.rollout.cpus_per_process=2"]  # fmt: skip
    with SlurmWatch(slurm_cluster) as watch:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    check_run(run_dir, proc)
    components = {j: n for j, n in watch.jobs.items() if "+" in j}
    assert len(components) == 2, watch.jobs  # JOB+0 (actor) and JOB+1 (rollout)
    actor_node = next(n for j, n in components.items() if j.endswith("+0"))
    rollout_node = next(n for j, n in components.items() if j.endswith("+1"))
    assert set(watch.role_nodes("actor").values()) == {actor_node}, (watch.steps, components)
    assert set(watch.role_nodes("rollout").values()) == {rollout_node}, (watch.steps, components)
    # The job is cancelled when the run ends.
    assert_no_job_left(slurm_cluster)
    assert_nothing_left(marker)


def test_a_killed_server_is_restarted_as_a_new_step_and_scancel_leaves_no_process(
    slurm_cluster, areal_tiny_chat_model_dir, tmp_path
):
    """A run in a submitted job: its server's process is killed on its node
    (the supervisor sees the step end and starts the server again, as a new
    step on the same node, and training goes on), then ``scancel`` of the job
    ends the run and every process of it."""
    run_dir = str(tmp_path / "run")
    env, marker = marked_env(slurm_cluster)
    cmd = [sys.executable, "-m", "areal_kernel.cli", *grpo_args(areal_tiny_chat_model_dir, run_dir, steps=100000),
           "scheduler.slurm.mode=submit"]  # fmt: skip
    out = open(tmp_path / "controller.out", "w+")
    metrics = os.path.join(run_dir, "metrics.jsonl")

    def rows() -> list[dict]:
        if not os.path.exists(metrics):
            return []
        with open(metrics) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]

    def wait_for(what: str, ok) -> None:
        deadline = time.monotonic() + 300
        while not ok():
            assert proc.poll() is None, f"the run ended while waiting for {what}: " + open(out.name).read()[-3000:]
            assert time.monotonic() < deadline, f"waited 300s for {what}: " + open(out.name).read()[-3000:]
            time.sleep(0.2)

    with SlurmWatch(slurm_cluster) as watch:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_for("the first training step", lambda: len(rows()) > 0)
            # The server's pid on its node is the first line its step logged.
            log = open(os.path.join(run_dir, "server-0.log")).read()
            pid = int(next(ln for ln in log.splitlines() if ln.startswith("=== areal-step pid")).split()[3])
            os.kill(pid, 9)
            first_steps = {n for n in watch.steps if n.startswith("areal-rollout-0-")}
            assert len(first_steps) == 1, watch.steps
            wait_for("a step after the restart", lambda: any(r.get("rollout/server_restarts") == 1 for r in rows()))
            # A training step can finish on trajectories buffered before the kill,
            # so the restarted server's step may not be running yet: wait until
            # Slurm lists a rollout step that is not the first one.
            now: dict[str, str] = {}

            def restarted_step_runs() -> bool:
                steps = slurm_cluster.run("squeue", "-h", "-s", "-o", "%j %N").stdout.split("\n")
                now.clear()
                now.update(ln.split() for ln in steps if ln.startswith("areal-rollout-0-"))
                return bool(set(now) - first_steps)

            wait_for("the restarted server's step", restarted_step_runs)
            done = len(rows())
            wait_for("a training step after the restarted server runs", lambda: len(rows()) > done)
            jobs = slurm_cluster.run("squeue", "-h", "-o", "%F").stdout.split()
            assert len(set(jobs)) == 1, jobs
            assert len([p for p in live_processes(lambda q: q.environ_has(marker)) if p.pid != proc.pid]) >= 4
            slurm_cluster.run("scancel", jobs[0])
            rc = proc.wait(120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert rc != 0, open(out.name).read()[-3000:]
    # The restarted server is another step than the first one, on the same node.
    new = {n: node for n, node in now.items() if n not in first_steps}
    first = {n: watch.steps[n] for n in first_steps}
    assert len(new) == 1, (now, watch.steps)
    assert set(new.values()) == set(first.values()), (new, first)
    assert_nothing_left(marker, exclude=proc.pid)
    assert_no_job_left(slurm_cluster)
