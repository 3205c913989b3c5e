"""Contract test suites that backend plugins subclass.

Usage in a plugin's tests::

    from areal_kernel.testing.contracts import PlatformContract

    class TestMyPlatform(PlatformContract):
        @pytest.fixture
        def platform(self):
            return MyPlatform()

Each contract asks for one fixture (named in its docstring) and checks what
the kernel relies on. They only use public kernel APIs.
"""
from __future__ import annotations

import asyncio
from typing import Any

import pytest


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


class RewardContract:
    """Fixtures: ``reward_target`` (``"pkg.mod:fn"``) and ``reward_cases``
    (a list of ``(completion, answer, expected_score)`` covering a right and a
    wrong answer)."""

    def test_scores_cases(self, reward_target: str, reward_cases: list[tuple[str, str, float]]) -> None:
        from areal_kernel.plugins.registry import import_target

        fn = import_target(reward_target)
        assert len({exp for _, _, exp in reward_cases}) >= 2, "give at least one right and one wrong case"
        for completion, answer, expected in reward_cases:
            score = fn(completion, answer)
            assert isinstance(score, float), f"reward returned {type(score).__name__}, expected float"
            assert score == pytest.approx(expected), (completion, answer)

    def test_empty_completion_does_not_raise(self, reward_target: str, reward_cases: list[tuple[str, str, float]]) -> None:
        from areal_kernel.plugins.registry import import_target

        fn = import_target(reward_target)
        assert isinstance(fn("", reward_cases[0][1]), float)

    def test_runs_in_the_kernel_reward_pool(self, reward_target: str, reward_cases: list[tuple[str, str, float]]) -> None:
        from areal_kernel.reward.pool import RewardPool

        pool = RewardPool(n_workers=1, timeout_s=60)
        try:
            completion, answer, expected = reward_cases[0]
            result = asyncio.run(pool.ascore(reward_target, completion, answer))
            assert result.ok, result.error
            assert result.score == pytest.approx(expected)
        finally:
            pool.close()
