"""``SchedulerContract``: the suite for schedulers (kind ``scheduler``,
``areal_kernel.api.scheduler``), with real rank processes and a real
embedded server."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import textwrap
from typing import Any

import pytest

from areal_kernel.testing.contracts._shared import _build, _closing, _config


_RANK = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    out = sys.argv[1]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "OMP_NUM_THREADS", "AREAL_CONTRACT_MARK")
    report = {"env": {k: os.environ.get(k) for k in keys}, "pid": os.getpid(), "sid": os.getsid(0), "child": child.pid}
    print("rank", os.environ.get("RANK"), "started", flush=True)
    tmp = os.path.join(out, "rank-%s.json.tmp" % os.environ["RANK"])
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.rename(tmp, tmp[:-4])
    time.sleep(600)
    """
)


def _accepts(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return True
    except OSError:
        return False


class SchedulerContract:
    """Fixture: ``scheduler_name`` (your ``scheduler.type``; the class
    subclasses ``areal_kernel.api.scheduler.Scheduler``). Optional:
    ``scheduler_config`` (the rest of the config; default two actor ranks,
    ``actor.backend: torch:d2``, and one fp32 ``embedded`` server) and
    ``scheduler_model_dir`` (default the session's tiny Llama). Set the
    class attribute ``starts_train_ranks = False`` if yours cannot start
    train-engine ranks (the suite then checks its ``start_train_ranks``
    raises ``ArealError`` and starts nothing)."""

    starts_train_ranks: bool = True

    @pytest.fixture
    def scheduler_config(self) -> dict[str, Any]:
        return {"actor": {"backend": "torch:d2"}, "rollout": {"backend": "embedded", "embedded": {"dtype": "float32"}}}

    @pytest.fixture
    def scheduler_model_dir(self, areal_tiny_model_dir: str) -> str:
        return areal_tiny_model_dir

    @pytest.fixture
    def scheduler_cfg(self, scheduler_name: str, scheduler_config: dict) -> Any:
        # The scheduler's own section (scheduler.<name>) may come with the config.
        return _config(
            {**scheduler_config, "scheduler": {**scheduler_config.get("scheduler", {}), "type": scheduler_name}}
        )

    @pytest.fixture
    def scheduler(self, scheduler_name: str, scheduler_cfg: Any) -> Any:
        """Built as ``Rollout.start`` builds it (``Registry.build``)."""
        from areal_kernel.api.scheduler import SchedulerContext

        sched = _build("scheduler", scheduler_name, SchedulerContext(name=scheduler_name, config=scheduler_cfg))
        yield sched
        sched.stop()

    def test_reports_its_platform(self, scheduler: Any) -> None:
        from areal_kernel.platforms import Platform

        # The trainer asks it which platform picks the weight transport.
        assert isinstance(scheduler.platform, Platform)

    def test_is_built_on_the_kernel_contract(self, scheduler: Any) -> None:
        from areal_kernel.api.scheduler import Scheduler

        assert isinstance(scheduler, Scheduler), "subclass areal_kernel.api.scheduler.Scheduler"

    def test_plan_places_every_process_before_anything_starts(self, scheduler: Any, scheduler_cfg: Any) -> None:
        from areal_kernel.api.scheduler import Placement, SchedulePlan

        plan = scheduler.plan()
        assert isinstance(plan, SchedulePlan) and plan.platform == scheduler.platform.name
        want = {"actor": scheduler_cfg.actor.allocation.world_size, "rollout": scheduler_cfg.rollout.allocation.d}
        for role, n in want.items():
            ps = plan.roles[role]
            assert [p.index for p in ps] == list(range(n)), (role, ps)
            for p in ps:
                assert isinstance(p, Placement) and p.role == role and p.node and p.host, p
                if scheduler.platform.exclusive_devices:
                    assert p.devices, f"{p}: no devices on a platform with exclusive devices"
        assert plan.nodes() and json.dumps(plan.to_dict())
        assert scheduler.health() == [], "plan() must not start anything"

    def test_train_ranks_run_in_their_own_sessions_and_stop(
        self, scheduler: Any, scheduler_cfg: Any, tmp_path: Any
    ) -> None:
        from areal_kernel.testing.procs import is_alive
        from areal_kernel.testing.waits import wait_until

        if not self.starts_train_ranks:
            from areal_kernel.errors import ArealError

            # One clear error, not a half-started world.
            with pytest.raises(ArealError):
                scheduler.start_train_ranks([sys.executable, "-c", "pass"], str(tmp_path / "logs"), {})
            assert scheduler.health() == []
            return
        world = scheduler_cfg.actor.allocation.world_size
        out, logs = tmp_path / "out", tmp_path / "logs"
        out.mkdir()
        procs = scheduler.start_train_ranks(
            [sys.executable, "-c", _RANK, str(out)], str(logs), {"AREAL_CONTRACT_MARK": "m"}
        )
        assert len(procs) == world
        wait_until(lambda: len(list(out.glob("rank-*.json"))) == world, timeout_s=60, what="every rank to report")
        reports = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]
        master = {(x["env"]["MASTER_ADDR"], x["env"]["MASTER_PORT"]) for x in reports}
        assert len(master) == 1 and None not in next(iter(master)), master
        # The rendezvous is on rank 0's node.
        assert next(iter(master))[0] == scheduler.placements("actor")[0].host, master
        running = [s for s in scheduler.health() if s.placement.role == "actor"]
        assert sorted(s.placement.index for s in running) == list(range(world)) and all(s.alive for s in running)
        assert len(scheduler.logs()["actor"]) == world, scheduler.logs()
        nodes = [p.node for p in scheduler.placements("actor")]
        for r, x in enumerate(reports):
            # LOCAL_RANK / LOCAL_WORLD_SIZE count the ranks on the same node.
            local = (str(nodes[:r].count(nodes[r])), str(nodes.count(nodes[r])))
            assert (x["env"]["LOCAL_RANK"], x["env"]["LOCAL_WORLD_SIZE"]) == local, (x, nodes)
            assert x["env"]["RANK"] == str(r) and x["env"]["WORLD_SIZE"] == str(world), x
            assert x["env"]["OMP_NUM_THREADS"] == "1" and x["env"]["AREAL_CONTRACT_MARK"] == "m", x
            assert x["sid"] == x["pid"], "each rank must lead its own session (stop kills the whole group)"
            assert x["pid"] in {p.pid for p in procs}
        wait_until(lambda: all("started" in (logs / f"rank-{r}.log").read_text() for r in range(world)),
                   timeout_s=30, what="the ranks' output in <log_dir>/rank-<r>.log")  # fmt: skip
        scheduler.stop()
        assert scheduler.health() == [], "stop() must forget what it ended"
        pids = [x["pid"] for x in reports] + [x["child"] for x in reports]
        wait_until(lambda: not any(is_alive(p) for p in pids), timeout_s=30, what="the ranks and their children to end")

    def test_starts_inference_servers_and_stops_them(
        self, scheduler: Any, scheduler_cfg: Any, scheduler_model_dir: str, tmp_path: Any
    ) -> None:
        from areal_kernel.api.io import GenerationConfig, ModelRequest
        from areal_kernel.testing.waits import wait_until

        cfg = scheduler_cfg
        from areal_kernel.api.inference_engine import InferenceBackendContext

        backend = _build("inference_engine", cfg.rollout.allocation.backend, InferenceBackendContext.for_config(cfg))
        addresses = scheduler.start_inference(backend, scheduler_model_dir, str(tmp_path / "run"))
        assert len(addresses) == cfg.rollout.allocation.d, addresses
        placed = scheduler.placements("rollout")
        servers = [s for s in scheduler.health() if s.placement.role == "rollout"]
        assert [s.placement for s in servers] == placed[: len(addresses)] and all(s.alive for s in servers), servers
        # An elastic fleet grows while the run goes on: one more server on a
        # placement the scheduler gives out now (Scheduler.extra_placement),
        # or one clear error and nothing started when it cannot.
        from areal_kernel.api.scheduler import Scheduler
        from areal_kernel.errors import ArealError

        launcher = getattr(backend, "launcher", None)
        assert launcher is not None, f"{type(backend).__name__} has no launcher (the servers' SubprocessLauncher)"
        if type(scheduler).extra_placement is Scheduler.extra_placement:
            with pytest.raises(ArealError, match="cannot start rollout processes while a run goes on"):
                launcher.add_server()
            assert len([s for s in scheduler.health() if s.placement.role == "rollout"]) == len(addresses)
        else:
            extra = launcher.add_server()
            addresses = [*addresses, extra.address]
            servers = [s for s in scheduler.health() if s.placement.role == "rollout"]
            assert len(servers) == len(addresses) and all(s.alive for s in servers), servers
            grown = servers[-1].placement
            assert grown.index == len(addresses) - 1 and grown.node and grown.host, grown
            if scheduler.platform.exclusive_devices:
                used = {d for s in servers[:-1] for d in s.placement.devices}
                assert grown.devices and not used & set(grown.devices), (grown, used)
        client = backend.make_client(addresses)
        try:
            for address in addresses:  # every server answers, the grown one too
                req = ModelRequest([5, 6], GenerationConfig(max_new_tokens=2), metadata={"server": address})
                resp = asyncio.run(_closing(client, client.agenerate(req)))
                assert resp.output_len >= 1 and resp.server == address, (resp.server, address)
        finally:
            client.destroy()
        scheduler.stop()
        wait_until(lambda: not any(_accepts(a) for a in addresses), timeout_s=30, what="the servers to stop")

    def test_stop_twice(self, scheduler: Any) -> None:
        scheduler.stop()
        scheduler.stop()
