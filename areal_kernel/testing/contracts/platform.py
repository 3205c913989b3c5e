"""``PlatformContract``: the suite for platforms (kind ``platform``,
``areal_kernel.api.platform``)."""

from __future__ import annotations

from typing import Any


class PlatformContract:
    """Fixture: ``platform`` (a ``Platform`` instance usable in this process)."""

    def test_identity(self, platform: Any) -> None:
        from areal_kernel.platforms import Platform

        assert isinstance(platform, Platform)
        assert platform.name and platform.name != "base"
        assert platform.device_type
        assert platform.dist_backend in {"gloo", "nccl", "hccl", "mpi", "xccl", "cncl"} or platform.dist_backend

    def test_visible_devices_env(self, platform: Any) -> None:
        env = platform.visible_devices_env_for([0, 1])
        assert isinstance(env, dict)
        if platform.visible_devices_env:
            assert env == {platform.visible_devices_env: "0,1"}
        else:
            assert env == {}

    def test_describe_is_complete(self, platform: Any) -> None:
        d = platform.describe()
        for key in ("name", "device_type", "dist_backend", "visible_devices_env", "ray_resource_name", "device_count"):
            assert key in d
        assert d["device_count"] >= 1

    def test_device_and_helpers(self, platform: Any) -> None:
        import torch

        dev = platform.device()
        t = torch.ones(3, device=dev)
        platform.synchronize()
        assert float(t.sum()) == 3.0
        assert platform.memory_allocated() >= 0
        platform.empty_cache()
        platform.manual_seed(0)
        a = torch.rand(4)
        platform.manual_seed(0)
        assert torch.equal(a, torch.rand(4))
