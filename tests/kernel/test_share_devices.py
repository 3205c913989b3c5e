"""``rollout.share_devices``: inference servers on the train ranks' devices
(one GPU for both), planned by the local scheduler against a platform of
exclusive devices (a platform class defined here, computing on the host:
no GPU on these machines), refused by schedulers that cannot place it, and
weight updates through disk (a collective refuses two members on one device)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from areal_kernel.api.scheduler import SchedulerContext
from areal_kernel.config import resolve
from areal_kernel.config.models import ExperimentConfig
from areal_kernel.errors import ArealError
from areal_kernel.platforms.base import Platform
from areal_kernel.plugins import get_registry
from areal_kernel.scheduling.local import LocalScheduler


def _platform(n: int) -> Platform:
    class Devices(Platform):  # an accelerator platform with ``n`` devices, to plan against
        name = "devices"
        device_type = "cpu"
        dist_backend = "gloo"
        visible_devices_env = "DEVICES_VISIBLE_DEVICES"

        @property
        def exclusive_devices(self) -> bool:
            return True

        def device_count(self) -> int:
            return n

    return Devices()


def _config(**rollout: Any) -> ExperimentConfig:
    raw = {"actor": {"backend": "torch:d1"}, "rollout": {"backend": "embedded", **rollout}}
    return resolve(ExperimentConfig.model_validate(raw), get_registry())


def _local(cfg: ExperimentConfig) -> LocalScheduler:
    return get_registry().build("scheduler", "local", SchedulerContext(name="local", config=cfg))


def test_one_device_holds_the_ranks_and_the_servers(monkeypatch):
    monkeypatch.setattr("areal_kernel.platforms.current_platform", lambda: _platform(1))
    # Without sharing, one device is too few (the control).
    with pytest.raises(ArealError, match="needs 2 cpu devices"):
        _local(_config()).device_plan()
    sched = _local(_config(share_devices=True))
    assert sched.device_plan() == {"actor": [[0]], "rollout": [[0]]}
    assert [p.devices for p in sched.plan().roles["rollout"]] == [(0,)]
    # A server added mid-run (the elastic fleet) shares too.
    assert sched.extra_placement("rollout", 1).devices == (0,)


def test_servers_take_the_ranks_devices_in_turn(monkeypatch):
    monkeypatch.setattr("areal_kernel.platforms.current_platform", lambda: _platform(4))
    assert _local(_config(backend="embedded:d3", share_devices=True)).device_plan() == {
        "actor": [[0]],
        "rollout": [[0], [0], [0]],
    }
    # Apart, the same run takes devices 1-3 for its servers.
    assert _local(_config(backend="embedded:d3")).device_plan()["rollout"] == [[1], [2], [3]]


def test_a_server_wider_than_the_ranks_devices_is_one_line(monkeypatch):
    monkeypatch.setattr("areal_kernel.platforms.current_platform", lambda: _platform(4))
    cfg = _config(backend="embedded:d1t2", share_devices=True)
    with pytest.raises(ArealError, match=r"rollout.share_devices: .*2 device\(s\) among them \(at most 1\)"):
        _local(cfg).device_plan()


def test_a_scheduler_that_cannot_share_refuses_the_run():
    class Apart(LocalScheduler):  # a scheduler without the capability
        name = "apart"
        shares_devices = False

    with pytest.raises(ArealError, match="rollout.share_devices: the scheduler 'apart' cannot place"):
        Apart(_config(share_devices=True))
    Apart(_config())  # the control: without sharing it builds


def test_areal_plan_counts_the_ranks_devices_alone(monkeypatch):
    from areal_kernel.scheduling.plan import make_plan

    monkeypatch.setattr("areal_kernel.platforms.current_platform", lambda: _platform(1))
    apart, shared = make_plan(_config()), make_plan(_config(share_devices=True))
    assert (apart["devices_needed"], apart["fits"]) == (2, False)
    assert (shared["devices_needed"], shared["fits"]) == (1, True)
    assert any("share_devices" in n for n in shared["notes"])


@pytest.mark.parametrize("share", [False, True])
def test_weight_updates_go_through_disk_when_shared(tmp_path, share):
    from areal_kernel.trainer.toolkit import build_weight_transport

    cfg = resolve(
        ExperimentConfig.model_validate(
            {"rollout": {"share_devices": share}, "weight_update": {"mode": "broadcast"}, "run_dir": str(tmp_path)}
        ),
        get_registry(),
    )
    ctx = SimpleNamespace(config=cfg, run_dir=str(tmp_path))
    rollout = SimpleNamespace(scheduler=SimpleNamespace(platform=_platform(1)), engine=SimpleNamespace())
    transport = build_weight_transport(ctx, SimpleNamespace(), rollout)  # type: ignore[arg-type]
    assert type(transport).__name__ == ("DiskTransport" if share else "BroadcastTransport")
