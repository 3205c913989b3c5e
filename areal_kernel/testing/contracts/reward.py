"""``RewardContract``: the suite for rewards (kind ``reward``,
``areal_kernel.api.reward``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest


class RewardContract:
    """Fixtures: ``reward_target`` (``"pkg.mod:fn"``, registered with
    ``areal_register_rewards``) and ``reward_cases`` (a list of
    ``(completion, answer, expected_score)`` covering a right and a wrong
    answer); optionally ``reward_settings``, your ``reward.<name>`` section as
    a user writes it (default ``{}``). The suite validates it through your
    registered ``config_model`` and builds the reward as the kernel does
    (``Registry.build("reward", ...)``: every field, defaults included, as
    JSON data; the pool loads your ``worker_preload``), so the config
    model's defaults are the ones your reward receives."""

    @pytest.fixture
    def reward_settings(self) -> dict[str, Any]:
        return {}

    def _reward(self, reward_target: str, reward_settings: dict[str, Any]) -> Any:
        """The reward as the kernel builds it (``Registry.build("reward", ...)``
        with ``reward_settings`` validated like a ``reward.<name>`` section):
        ``fn`` and the keywords it receives, ``settings``."""
        from areal_kernel.api.reward import RewardContext
        from areal_kernel.config.sections import validate_settings
        from areal_kernel.plugins import get_registry

        reg = get_registry()
        specs = [s for s in reg.specs("reward") if s.target == reward_target]
        assert specs, (
            f"no reward is registered with target {reward_target!r}: the kernel only calls rewards registered "
            "with areal_register_rewards (is the plugin installed in the test process?)"
        )
        name = specs[0].name
        settings = validate_settings(f"reward.{name}", "reward", name, reward_settings, spec=specs[0])
        return reg.build("reward", name, RewardContext(name, settings))

    def test_scores_cases(
        self, reward_target: str, reward_cases: list[tuple[str, str, float]], reward_settings: dict[str, Any]
    ) -> None:
        reward = self._reward(reward_target, reward_settings)
        fn, kwargs = reward.fn, reward.settings
        assert len({exp for _, _, exp in reward_cases}) >= 2, "give at least one right and one wrong case"
        for completion, answer, expected in reward_cases:
            score = fn(completion, answer, **kwargs)
            assert isinstance(score, float), f"reward returned {type(score).__name__}, expected float"
            assert score == pytest.approx(expected), (completion, answer)

    def test_empty_completion_does_not_raise(
        self, reward_target: str, reward_cases: list[tuple[str, str, float]], reward_settings: dict[str, Any]
    ) -> None:
        reward = self._reward(reward_target, reward_settings)
        assert isinstance(reward.fn("", reward_cases[0][1], **reward.settings), float)

    def test_runs_in_the_kernel_reward_pool(
        self, reward_target: str, reward_cases: list[tuple[str, str, float]], reward_settings: dict[str, Any]
    ) -> None:
        from areal_kernel.reward.pool import RewardPool

        # Bound the way the trainer binds reward.<name> (make_reward_pool): the settings cross into the worker as JSON.
        reward = self._reward(reward_target, reward_settings)
        pool = RewardPool(
            n_workers=1, timeout_s=60, preload=reward.worker_preload, settings={reward.target: dict(reward.settings)}
        )
        try:
            completion, answer, expected = reward_cases[0]
            result = asyncio.run(pool.ascore(reward_target, completion, answer))
            assert result.ok, result.error
            assert result.score == pytest.approx(expected)
        finally:
            pool.close()
