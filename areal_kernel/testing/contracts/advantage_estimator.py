"""``AdvantageEstimatorContract``: the suite for advantage estimators (kind
``advantage_estimator``, ``areal_kernel.api.advantage_estimator``)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from areal_kernel.testing.contracts._shared import _EXTRA_KEYWORD, _check_unknown_setting_is_refused, _finite, _spec


# group -> rewards; "b" is constant (nothing to learn), "c" is strictly ordered.
_GROUPS: dict[str, list[float]] = {"a": [1.0, 0.0, 0.0, 1.0], "b": [0.5, 0.5, 0.5, 0.5], "c": [0.0, 1.0, 0.25, 0.75]}


def _trajectories(groups: dict[str, list[float]], *, equal_lengths: bool = False) -> Any:
    from areal_kernel.api.io import Trajectory, TrajectoryBatch

    trajs = []
    for g, rewards in groups.items():
        for i, r in enumerate(rewards):
            prompt, gen = 3, 4 if equal_lengths else 2 + (i * 3 + len(g)) % 5
            ids = [7] * prompt + [11 + i] * gen
            trajs.append(
                Trajectory(
                    ids,
                    [0] * prompt + [1] * gen,
                    [0.0] * prompt + [-0.5] * gen,
                    [-1] * prompt + [0] * gen,
                    reward=r,
                    group_id=g,
                )
            )
    return TrajectoryBatch(trajs)


class AdvantageEstimatorContract:
    """Fixture: ``estimator_name`` (your ``algorithm.advantage``). Optional:
    ``estimator_settings`` (your ``algorithm.<name>`` section, default
    ``{}``) and ``estimator_settings_alt`` (other settings that must change
    the advantages; default ``None``: not checked). Set the class attribute
    ``group_relative = False`` if a group's advantages depend on other groups
    or on the level of its rewards (batch normalisation, a critic): the suite
    checks the declaration both ways."""

    group_relative: bool = True

    @pytest.fixture
    def estimator_settings(self) -> dict[str, Any]:
        return {}

    @pytest.fixture
    def estimator_settings_alt(self) -> dict[str, Any] | None:
        return None

    @staticmethod
    def _values(batch: Any, zero: bool = False) -> list[list[float]]:
        rng = random.Random(0)
        return [[0.0 if zero else rng.uniform(-1, 1) for _ in t.input_ids] for t in batch.trajectories]

    def _advantages(
        self, name: str, settings: dict | None, batch: Any, *, zero_values: bool = False,
        values: list[list[float]] | None = None, **knobs: Any,
    ) -> tuple[list[list[float]], Any]:  # fmt: skip
        """``compute_advantages`` as the trainer calls it: registry, knobs,
        validated settings; critic ``values`` for an estimator that needs them."""
        from areal_kernel.algo.rl import RLConfig, compute_advantages

        cfg = RLConfig(advantage=name, advantage_settings=settings or None, **knobs)
        if values is None and "needs_values" in _spec("advantage_estimator", name).capabilities:
            values = self._values(batch, zero_values)
        ref = None
        if cfg.kl_in == "reward" and cfg.kl_coef > 0:
            ref = [[lp - 0.1 * m for lp, m in zip(t.logprobs, t.loss_mask)] for t in batch.trajectories]
        return compute_advantages(batch, cfg, values=values, ref_logprobs=ref)

    def test_one_finite_advantage_per_loss_token(self, estimator_name: str, estimator_settings: dict) -> None:
        batch = _trajectories(_GROUPS)
        rows, returns = self._advantages(estimator_name, estimator_settings, batch)
        assert [len(r) for r in rows] == [len(t.input_ids) for t in batch.trajectories]
        if "needs_values" in _spec("advantage_estimator", estimator_name).capabilities:
            # The critic is trained on these: one finite target per token.
            assert returns is not None, "an estimator with needs_values must return AdvantageResult(returns=...)"
            assert [len(r) for r in returns] == [len(t.input_ids) for t in batch.trajectories]
            assert all(_finite(x) for row in returns for x in row)
        assert any(x != 0.0 for row in rows for x in row), "every advantage is 0 for rewards that differ"

    def test_equal_rewards_give_finite_advantages(self, estimator_name: str, estimator_settings: dict) -> None:
        for groups in ({"a": [1.0] * 4, "b": [0.0] * 4, "c": [0.5] * 4}, {"a": [1.0] * 4, "b": [1.0] * 4}):
            rows, _ = self._advantages(estimator_name, estimator_settings, _trajectories(groups))
            if self.group_relative:
                # A group whose samples all scored the same teaches nothing.
                assert all(x == pytest.approx(0.0, abs=1e-6) for row in rows for x in row), rows

    def test_a_better_sample_never_gets_a_lower_advantage(self, estimator_name: str, estimator_settings: dict) -> None:
        batch = _trajectories(_GROUPS, equal_lengths=True)
        rows, _ = self._advantages(estimator_name, estimator_settings, batch, zero_values=True)
        trajs = batch.trajectories
        for g in _GROUPS:
            idx = [i for i, t in enumerate(trajs) if t.group_id == g]
            mean = {i: sum(rows[i]) / trajs[i].n_generated for i in idx}
            ranked = sorted(idx, key=lambda i: trajs[i].reward)
            for lo, hi in zip(ranked, ranked[1:]):
                if trajs[hi].reward > trajs[lo].reward:
                    assert mean[hi] >= mean[lo] - 1e-6, (g, trajs[lo].reward, trajs[hi].reward, mean)
            best, worst = ranked[-1], ranked[0]
            if trajs[best].reward > trajs[worst].reward:
                assert mean[best] > mean[worst], (g, mean)

    def test_group_relativity_is_as_declared(self, estimator_name: str, estimator_settings: dict) -> None:
        base, _ = self._advantages(estimator_name, estimator_settings, _trajectories(_GROUPS))
        shifted, _ = self._advantages(
            estimator_name, estimator_settings, _trajectories({**_GROUPS, "c": [r + 3.0 for r in _GROUPS["c"]]})
        )
        other, _ = self._advantages(
            estimator_name, estimator_settings, _trajectories({**_GROUPS, "c": [1.0, 0.0, 0.0, 0.0]})
        )
        n_ab = len(_GROUPS["a"]) + len(_GROUPS["b"])

        def same(x: list[list[float]], y: list[list[float]]) -> bool:
            return all(a == pytest.approx(b, abs=1e-6) for rx, ry in zip(x, y) for a, b in zip(rx, ry))

        holds = same(base, shifted) and same(base[:n_ab], other[:n_ab])
        assert holds == self.group_relative, (
            "advantages do not depend only on the rewards relative to their own group; set group_relative = False"
            if self.group_relative
            else "advantages depend only on rewards relative to their own group; set group_relative = True"
        )

    def test_order_and_group_names_do_not_matter(self, estimator_name: str, estimator_settings: dict) -> None:
        import dataclasses

        from areal_kernel.api.io import TrajectoryBatch

        batch = _trajectories(_GROUPS)
        values = self._values(batch)
        base, _ = self._advantages(estimator_name, estimator_settings, batch, values=values)
        order = list(range(len(batch)))[::-1]
        moved_batch = TrajectoryBatch(
            [
                dataclasses.replace(batch.trajectories[i], group_id="renamed-" + batch.trajectories[i].group_id)
                for i in order
            ]
        )
        moved, _ = self._advantages(estimator_name, estimator_settings, moved_batch, values=[values[i] for i in order])
        for k, i in enumerate(order):
            assert moved[k] == pytest.approx(base[i], abs=1e-6), (k, i)

    def test_takes_every_keyword_the_kernel_passes(self, estimator_name: str, estimator_settings: dict) -> None:
        from areal_kernel.algo.estimators import to_token_rows
        from areal_kernel.algo.rl import knob_arguments
        from areal_kernel.api.advantage_estimator import AdvantageKnobs
        from areal_kernel.config.sections import settings_kwargs, validate_settings

        batch = _trajectories(_GROUPS)
        # KL folded into the rewards (algorithm.kl_in: reward) arrives as token_rewards.
        rows, _ = self._advantages(estimator_name, estimator_settings, batch, kl_in="reward", kl_coef=0.1)
        assert all(_finite(x) for row in rows for x in row)
        spec = _spec("advantage_estimator", estimator_name)
        fn = spec.load()
        settings = settings_kwargs(
            validate_settings(
                f"algorithm.{estimator_name}", spec.kind, spec.name, estimator_settings or None, spec=spec
            )
        )
        trajs = batch.trajectories
        rewards = [t.reward for t in trajs]
        gids = [t.group_id for t in trajs]
        masks = [list(t.loss_mask) for t in trajs]
        values = self._values(batch) if "needs_values" in spec.capabilities else None
        before = json.dumps([rewards, gids, masks, values])
        for norm in (None, "group", "batch", "none"):  # algorithm.adv_norm, None = the estimator's default
            knobs = knob_arguments(fn, AdvantageKnobs(adv_norm=norm), "advantage_estimator", estimator_name)
            out = fn(rewards, gids, loss_masks=masks, token_rewards=None, values=values, **knobs,
                     **settings, **{_EXTRA_KEYWORD: True})  # fmt: skip
            to_token_rows(out, masks, estimator_name)  # the kernel's shape and finiteness check
        assert json.dumps([rewards, gids, masks, values]) == before, "the estimator changed its inputs"

    def test_its_settings_take_effect(
        self, estimator_name: str, estimator_settings: dict, estimator_settings_alt: dict | None
    ) -> None:
        batch = _trajectories(_GROUPS)
        base, _ = self._advantages(estimator_name, estimator_settings, batch)
        if estimator_settings_alt is None:
            # Without alternative settings: the same settings give the same advantages.
            assert self._advantages(estimator_name, estimator_settings, batch)[0] == base
            return
        alt, _ = self._advantages(estimator_name, estimator_settings_alt, batch)
        assert alt != base, f"algorithm.{estimator_name}: {estimator_settings_alt} changed nothing"

    def test_unknown_setting_is_refused(self, estimator_name: str) -> None:
        _check_unknown_setting_is_refused("advantage_estimator", estimator_name, f"algorithm.{estimator_name}")
