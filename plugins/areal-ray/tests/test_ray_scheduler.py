"""The ``ray`` scheduler on a real two-node Ray cluster (``ray.cluster_utils.Cluster``,
both nodes on this machine, loopback only; one cluster for the module).

- the kernel's scheduler contract suite;
- ``areal plan`` shows the placement across both nodes and leaves nothing;
- GRPO with ``rollout.backend: embedded:d2`` and ``actor.backend: fsdp:d2``
  placed across both nodes (where each process ran is read from Ray's state
  API and the process table); one server's process is killed mid-run and
  restarted with no trajectory lost; the controller is then killed and
  ``recover: auto`` finishes the run; after each run nothing is left: no
  actor, no placement group (Ray's state API), no process (process table);
- an elastic fleet (``rollout.elastic: {min: 1, max: 2}``) grows while the
  trainer waits for rollouts: the scheduler reserves one more placement
  group mid-run (``extra_placement``), the new server runs on a Ray node
  and joins; nothing is left after the run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from typing import Any

import pytest

from areal_kernel.config import validate_config
from areal_kernel.plugins import get_registry
from areal_kernel.testing import SchedulerContract
from areal_kernel.testing.procs import live_processes
from areal_kernel.testing.recovery import read_samples, run_train
from areal_kernel.testing.waits import wait_until
from areal_kernel.utils.network import find_free_port

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
# The kernel's GRPO example with the fsdp engine (its actor.fsdp section).
EXAMPLE = os.path.join(REPO, "plugins", "areal-fsdp", "examples", "grpo_arithmetic_fsdp.yaml")
RAY_EXAMPLE = os.path.join(REPO, "plugins", "areal-ray", "examples", "grpo_arithmetic_ray.yaml")
SERVER = "areal_kernel.inference.embedded.server"
RANK = "areal_fsdp.rank"
STEPS = 30


@pytest.fixture(scope="module")
def ray_cluster() -> Any:
    """A head and one worker node, 2 logical CPUs each, on 127.0.0.1 (the
    state API's dashboard on a free port)."""
    # Without it Ray swaps 127.0.0.1 for the interface address (../shared/FACTS.md);
    # the nodes and every driver (the runs below) inherit it.
    old = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2, "node_ip_address": "127.0.0.1", "include_dashboard": True,
            "dashboard_host": "127.0.0.1", "dashboard_port": find_free_port(),
        },
    )  # fmt: skip
    try:
        cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes(timeout=120)
        yield cluster
    finally:
        cluster.shutdown()
        if old is None:
            os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
        else:
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = old


def _ray_section(cluster: Any) -> dict[str, Any]:
    # STRICT_SPREAD: each role's two processes on two different nodes.
    return {"address": cluster.address, "actor_strategy": "STRICT_SPREAD", "rollout_strategy": "STRICT_SPREAD",
            "cpus_per_process": 0.5, "timeout_s": 30}  # fmt: skip


def _node_ids(cluster: Any) -> set[str]:
    return {cluster.head_node.node_id, *(n.node_id for n in cluster.worker_nodes)}


def _state(cluster: Any) -> tuple[list[Any], list[Any]]:
    """Alive actors and placement groups not removed, from Ray's state API."""
    from ray.util.state import list_actors, list_placement_groups

    actors = list_actors(
        address=cluster.address, filters=[("state", "=", "ALIVE")], timeout=30, raise_on_missing_output=False
    )
    pgs = list_placement_groups(address=cluster.address, timeout=30, raise_on_missing_output=False)
    return actors, [p for p in pgs if p.state != "REMOVED"]


def _assert_nothing_left(cluster: Any, mark: str) -> None:
    """No actor or placement group of a run on the cluster, and no server or
    rank process carrying ``mark`` (an environment variable of the run,
    inherited by everything it starts) in the process table."""

    def clean() -> bool:
        actors, pgs = _state(cluster)
        return not [a for a in actors if (a.name or "").startswith("areal-")] and not pgs

    wait_until(clean, timeout_s=60, interval_s=0.5, what="the run's actors and placement groups to be gone")
    wait_until(
        lambda: not live_processes(lambda p: (p.runs(SERVER) or p.runs(RANK)) and p.environ_has(mark)),
        timeout_s=60, interval_s=0.2, what="the run's servers and ranks to be gone (process table)",
    )  # fmt: skip


@pytest.fixture
def run_mark(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> str:
    """An environment variable every process of this test's runs inherits."""
    mark = f"areal-ray-test-{os.getpid()}-{abs(hash(str(tmp_path)))}"
    monkeypatch.setenv("AREAL_RAY_TEST_MARK", mark)
    return mark


# -- the kernel's contract --------------------------------------------------------------------


class TestRaySchedulerContract(SchedulerContract):
    @pytest.fixture
    def scheduler_name(self) -> str:
        return "ray"

    @pytest.fixture
    def scheduler_config(self, ray_cluster: Any) -> dict[str, Any]:
        return {
            "actor": {"backend": "torch:d2"},
            "rollout": {"backend": "embedded", "embedded": {"dtype": "float32"}},
            "scheduler": {"ray": _ray_section(ray_cluster)},
        }


def test_plan_spreads_roles_over_both_nodes_and_leaves_nothing(ray_cluster, run_areal, run_mark):
    # The plugin's example (fsdp:d2 + embedded:d2), pointed at this cluster.
    args = ["plan", RAY_EXAMPLE, "--json"] + [f"scheduler.ray.{k}={v}" for k, v in _ray_section(ray_cluster).items()]
    proc = run_areal(*args, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    plan = json.loads(proc.stdout)
    assert plan["scheduler"] == "ray"
    roles = plan["placement"]["roles"]
    for role in ("actor", "rollout"):
        nodes = [p["node"] for p in roles[role]]
        assert sorted(nodes) == sorted(_node_ids(ray_cluster)), (role, roles[role])
        assert all(p["host"] == "127.0.0.1" for p in roles[role])
    _assert_nothing_left(ray_cluster, run_mark)


def test_without_an_address_a_local_cluster_is_started_and_ended(ray_cluster, run_areal):
    """``scheduler.ray.address`` unset: the run starts its own one-node
    cluster (here beside the module's) and ends it; its raylet is gone after."""

    def raylets() -> set[int]:
        return {p.pid for p in live_processes(lambda p: p.runs("raylet"))}

    before = raylets()
    proc = run_areal("plan", RAY_EXAMPLE, "--json", "scheduler.ray.address=null", timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    placement = json.loads(proc.stdout)["placement"]
    nodes = {p["node"] for ps in placement["roles"].values() for p in ps}
    assert len(nodes) == 1 and not nodes & _node_ids(ray_cluster), nodes  # its own node, not the module's
    assert {p["host"] for ps in placement["roles"].values() for p in ps} == {"127.0.0.1"}
    wait_until(lambda: raylets() <= before, timeout_s=30, interval_s=0.2, what="the local cluster's raylet to end")


def test_invalid_ray_section_names_the_field(run_areal):
    proc = run_areal("validate", EXAMPLE, "scheduler.type=ray", "scheduler.ray.timeout_s=0")
    assert proc.returncode == 2
    assert "scheduler.ray.timeout_s" in proc.stderr, proc.stderr


# -- GRPO across both nodes, a lost server, a lost controller -----------------------------------


def _train_args(model: str, run_dir: str, cluster: Any) -> list[str]:
    args = [
        "train", EXAMPLE, f"model.path={model}", f"run_dir={run_dir}", "scheduler.type=ray",
        "actor.backend=fsdp:d2", "rollout.backend=embedded:d2", f"trainer.max_steps={STEPS}",
        "trainer.batch_size=2", "trainer.eval_size=0", "rollout.gconfig.n_samples=4",
        "rollout.gconfig.max_new_tokens=8", "rollout.max_staleness=1", "weight_update.mode=disk",
        "algorithm.dynamic_filter=false", "checkpoint.save_every=1", "logging.sinks=[jsonl]",
    ]  # fmt: skip
    return args + [f"scheduler.ray.{k}={v}" for k, v in _ray_section(cluster).items()]


def _agents(cluster: Any) -> dict[str, Any]:
    """The run's agent actors by name (``areal-<run>-<role>-<i>``): node id and pid."""
    actors, _ = _state(cluster)
    return {a.name: a for a in actors if (a.name or "").startswith("areal-")}


def _children(pid: int, what: str) -> list[Any]:
    return [p for p in live_processes(lambda p: p.ppid == pid and p.runs(what))]


def _steps(run_dir: str) -> list[dict[str, Any]]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [r for r in (json.loads(line) for line in open(path) if line.strip()) if "perf/step_s" in r]


def test_grpo_across_two_nodes_survives_a_lost_server_and_a_lost_controller(ray_cluster, tmp_path, run_mark):
    from areal_kernel.testing.models import make_tiny_chat_llama

    model = make_tiny_chat_llama(tmp_path / "model")
    run_dir = str(tmp_path / "run")
    args = _train_args(model, run_dir, ray_cluster)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log_path = tmp_path / "train.log"
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "areal_kernel.cli", *args], stdout=logf,
                                stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)  # fmt: skip
    placed: dict[str, tuple[str, int]] = {}
    try:
        # 1. Where every process runs: each agent's node (Ray's state API), and
        #    the server or rank it started (its child in the process table).
        def all_running() -> bool:
            assert proc.poll() is None, log_path.read_text(errors="replace")[-4000:]
            agents = _agents(ray_cluster)
            found = {}
            for name, a in agents.items():
                kind = SERVER if "-rollout-" in name else RANK
                kids = _children(a.pid, kind)
                if len(kids) == 1:
                    found[name] = (a.node_id, kids[0].pid)
            placed.update(found)
            return len(found) == 4 and bool(_steps(run_dir))

        wait_until(all_running, timeout_s=240, interval_s=0.5, what="both roles' processes to run and a step to train")
        for role in ("actor", "rollout"):
            nodes = [node for name, (node, _) in placed.items() if f"-{role}-" in name]
            assert sorted(nodes) == sorted(_node_ids(ray_cluster)), (role, placed)
        # 2. Kill one server's process: the supervisor restarts it through its agent.
        victim = next(pid for name, (_, pid) in placed.items() if name.endswith("-rollout-0"))
        os.killpg(victim, signal.SIGKILL)
        killed_at = len(_steps(run_dir))

        # 3. Once the restarted server served a later step and its checkpoint is
        #    complete, kill the controller's whole process group.
        def restarted_and_checkpointed() -> bool:
            assert proc.poll() is None, log_path.read_text(errors="replace")[-4000:]
            done = len(_steps(run_dir))
            marker = os.path.join(run_dir, "recover", f"step{done}", "COMPLETE")
            text = re.sub(r"\x1b\[[0-9;]*m", "", log_path.read_text(errors="replace"))
            return "inference server restarted" in text and done > killed_at and done < STEPS and os.path.isfile(marker)

        wait_until(
            restarted_and_checkpointed,
            timeout_s=240,
            interval_s=0.05,
            what="the server's restart and a later checkpoint",
        )
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    out = log_path.read_text(errors="replace")
    interrupted_at = len(_steps(run_dir))
    assert 0 < interrupted_at < STEPS, out[-3000:]
    # The dead controller leaves nothing: Ray ends its agents, their processes follow.
    _assert_nothing_left(ray_cluster, run_mark)

    # 4. recover: auto resumes from the newest checkpoint and finishes.
    resumed = run_train(args, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    result = json.load(open(os.path.join(run_dir, "result.json")))
    assert result["resumed_from_step"] >= 1, result
    samples = read_samples(run_dir)
    assert [s["step"] for s in samples] == list(range(1, STEPS + 1)), samples
    # No trajectory lost: every step, the one during the failover too, trained a full batch.
    assert all(len(s["uids"]) == 2 for s in samples), samples  # batch_size prompt groups
    assert all(r["batch/sequences"] == 2 * 4 for r in _steps(run_dir))  # x n_samples, each step
    assert "restarting server" in open(os.path.join(run_dir, "server-0.log")).read()
    _assert_nothing_left(ray_cluster, run_mark)


# -- an elastic fleet growing through the scheduler ----------------------------------------------

ELASTIC_STEPS = 5
ELASTIC_PAUSE = 2  # the run waits after this step until the test saw the fleet grow


def _fleet_status(run_dir: str) -> dict[str, Any]:
    proc = run_train(["fleet", "status", run_dir, "--json"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_an_elastic_fleet_grows_onto_a_ray_node(ray_cluster, tmp_path, run_mark):
    """``rollout.elastic: {min: 1, max: 2}`` on one server: the trainer waits
    for rollouts, the fleet asks the scheduler for one more placement (a new
    placement group of one bundle with its agent), the server started there
    joins and serves the later steps. The cheapest run that shows it: the
    tiny byte-level model, the in-process torch engine, five steps."""
    from areal_kernel.models.tiny import make_tiny_byte_chat_llama
    from areal_kernel.trainer.recovery import PAUSE_ENV, PAUSED_MARKER

    model = make_tiny_byte_chat_llama(tmp_path / "model")
    run_dir = str(tmp_path / "run")
    args = [
        "train", "grpo_arithmetic", f"model.path={model}", f"run_dir={run_dir}", "scheduler.type=ray",
        "actor.backend=torch", "rollout.backend=embedded", f"trainer.max_steps={ELASTIC_STEPS}",
        "trainer.batch_size=2", "trainer.eval_size=0", "rollout.gconfig.n_samples=4",
        "rollout.gconfig.max_new_tokens=8", "rollout.max_staleness=1", "weight_update.mode=disk",
        "algorithm.dynamic_filter=false", "reward.type=char_share", "logging.sinks=[jsonl]",
        "rollout.elastic.min=1", "rollout.elastic.max=2", "rollout.elastic.cooldown_steps=0",
        # The tiny model generates a batch in a fraction of a second: once the
        # first batch is in, staleness 1 lets the next one overlap training and
        # the trainer waits ~0.1% of a step; only step 1 waits long (~80% of
        # it, measured). So one step of waiting is enough (patience 1), and the
        # bar is low (10%, not the default 30%) so a faster machine still grows.
        "rollout.elastic.patience=1", "rollout.elastic.grow_wait_fraction=0.1",
        # Growing is what this test is about. Two servers of the tiny model
        # outrun the trainer, and with patience 1 one step that dropped stale
        # rollouts shrank the fleet back before the last step (seen in CI:
        # servers 2, 2, 1 after the pause); shrinking is tested on its own.
        "rollout.elastic.shrink_stale_dropped=1000000",
    ]  # fmt: skip
    args += [f"scheduler.ray.{k}={v}" for k, v in _ray_section(ray_cluster).items()]
    env = dict(os.environ, OMP_NUM_THREADS="1", **{PAUSE_ENV: str(ELASTIC_PAUSE)})
    log_path = tmp_path / "train.log"
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "areal_kernel.cli", *args], stdout=logf,
                                stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)  # fmt: skip
    paused = os.path.join(run_dir, PAUSED_MARKER.format(step=ELASTIC_PAUSE))
    try:
        wait_until(
            lambda: proc.poll() is None and os.path.exists(paused) or proc.poll() is not None,
            timeout_s=300, interval_s=0.2, what=f"the run to pause after step {ELASTIC_PAUSE}",
        )  # fmt: skip
        assert proc.poll() is None, log_path.read_text(errors="replace")[-4000:]
        # While it pauses the fleet ticks: the server the policy started joins.
        grown: dict[str, Any] = {}

        def two_active() -> bool:
            assert proc.poll() is None, log_path.read_text(errors="replace")[-4000:]
            st = _fleet_status(run_dir)
            grown.update(st)
            return [s["state"] for s in st["servers"]] == ["active", "active"]

        wait_until(two_active, timeout_s=180, interval_s=0.5, what="the grown fleet's second server to be active")
        assert grown["stats"]["grows"] == 1 and grown["stats"]["joins"] == 1, grown
        new_pid = grown["servers"][1]["pid"]
        # The new server runs on a Ray node: its agent (the placement's, index
        # 1, from Ray's state API) on one of the cluster's nodes started it.
        agents = _agents(ray_cluster)
        (name,) = [n for n in agents if n.endswith("-rollout-1")]
        assert agents[name].node_id in _node_ids(ray_cluster), agents[name]
        assert [p.pid for p in _children(agents[name].pid, SERVER)] == [new_pid], (name, new_pid)
        from ray.util.state import list_placement_groups

        pgs = list_placement_groups(address=ray_cluster.address, timeout=30, raise_on_missing_output=False)
        assert [p for p in pgs if p.state == "CREATED" and p.name == name], [(p.name, p.state) for p in pgs]
        os.unlink(paused)
        assert proc.wait(timeout=300) == 0, log_path.read_text(errors="replace")[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    steps = _steps(run_dir)
    print("\nwait for rollouts / step:", [round(r["perf/wait_rollout_s"] / r["perf/step_s"], 3) for r in steps])
    assert [r["step"] for r in steps] == list(range(1, ELASTIC_STEPS + 1)), steps
    assert all(r["batch/sequences"] == 2 * 4 for r in steps), [r["batch/sequences"] for r in steps]
    final = steps[-1]
    assert final["rollout/grows"] >= 1 and final["rollout/joins"] >= 1, final
    assert final["rollout/shrinks"] == 0 and final["rollout/servers_lost"] == 0, final
    assert [r["rollout/servers"] for r in steps[ELASTIC_PAUSE:]] == [2.0] * (ELASTIC_STEPS - ELASTIC_PAUSE), steps
    served = {rec["step"]: {x["server"] for x in rec["samples"]} for rec in read_samples(run_dir)}
    assert len(set().union(*served.values())) == 2, served  # both servers generated trained samples
    _assert_nothing_left(ray_cluster, run_mark)


# -- a lost node --------------------------------------------------------------------------------

_WATCHER = """
import os, time
parent = int(os.environ["AREAL_PARENT_PID"])
print("watching", parent, flush=True)
while os.getppid() == parent:
    time.sleep(0.2)
"""


def test_a_lost_agent_polls_as_node_lost_and_its_process_follows(ray_cluster, tmp_path):
    """The agent of a placement dies (as when its node is lost): the process
    handle reports ``NODE_LOST`` (what the server supervisor reads), the
    process it started exits once orphaned, and ``stop()`` still clears the
    cluster."""
    import ray

    from areal_kernel.api.scheduler import NODE_LOST
    from areal_kernel.testing.procs import is_alive

    cfg = validate_config(
        {"actor": {"backend": "torch:d2"}, "rollout": {"backend": "embedded:d2"},
         "scheduler": {"type": "ray", "ray": _ray_section(ray_cluster)}},
        registry=get_registry(),
    )  # fmt: skip
    sched = get_registry().get("scheduler", "ray").load()(cfg)
    try:
        placement = sched.placements("rollout")[1]
        h = sched.spawn(placement, [sys.executable, "-c", _WATCHER], dict(os.environ), str(tmp_path / "w.log"))
        sched.track("rollout", h)
        wait_until(lambda: "watching" in h.log_tail(5), timeout_s=30, interval_s=0.1, what="the process to start")
        assert h.poll() is None and is_alive(h.pid)
        agent = next(
            ray.get_actor(a["name"], namespace=a["namespace"])
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].endswith("-rollout-1")
        )
        ray.kill(agent, no_restart=True)
        wait_until(lambda: h.poll() == NODE_LOST, timeout_s=60, interval_s=0.2, what="the handle to report NODE_LOST")
        assert [s.returncode for s in sched.health() if s.pid == h.pid] == [NODE_LOST]
        wait_until(lambda: not is_alive(h.pid), timeout_s=30, interval_s=0.1, what="the orphaned process to exit")
    finally:
        sched.stop()
    actors, pgs = _state(ray_cluster)
    assert not [a for a in actors if (a.name or "").startswith("areal-")] and not pgs
