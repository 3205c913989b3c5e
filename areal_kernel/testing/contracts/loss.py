"""``LossContract``: the suite for losses (kind ``loss``,
``areal_kernel.api.loss``), on tensors captured from the kernel's torch
engine."""

from __future__ import annotations

import random
from typing import Any

import pytest

from areal_kernel.testing.contracts._shared import (
    _EXTRA_KEYWORD,
    _check_unknown_setting_is_refused,
    _finite,
    _spec,
    _torch_engine,
)


def _loss_batch() -> Any:
    """Two groups of two samples sharing a prompt, of different lengths."""
    from areal_kernel.api.io import Trajectory, TrajectoryBatch

    rows = [
        ([1, 9, 4, 4], [17, 23, 5]),
        ([1, 9, 4, 4], [31, 8, 8, 12, 40]),
        ([1, 3, 3], [19, 2]),
        ([1, 3, 3], [77, 6, 6, 6]),
    ]
    trajs = []
    for i, (prompt, gen) in enumerate(rows):
        n, m = len(prompt), len(gen)
        trajs.append(
            Trajectory(
                prompt + gen,
                [0] * n + [1] * m,
                [0.0] * (n + m),
                [-1] * n + [0] * m,
                reward=float(i % 2),
                group_id=f"g{i // 2}",
            )
        )
    return TrajectoryBatch(trajs)


class LossContract:
    """Fixture: ``loss_name`` (your ``algorithm.loss``). Optional:
    ``loss_settings`` (your ``algorithm.<name>`` section, default ``{}``),
    ``loss_settings_alt`` (other settings that must change the loss;
    default ``None``: not checked) and ``loss_knobs`` (shared ``algorithm``
    knobs such as ``{"loss_agg": "seq-mean-token-mean"}``, default ``{}``;
    parametrize it to cover several). ``loss_model_dir`` (default: the
    session's tiny Llama) is what the kernel's torch engine trains."""

    @pytest.fixture
    def loss_settings(self) -> dict[str, Any]:
        return {}

    @pytest.fixture
    def loss_settings_alt(self) -> dict[str, Any] | None:
        return None

    @pytest.fixture
    def loss_knobs(self) -> dict[str, Any]:
        return {}

    @pytest.fixture(scope="class")
    @classmethod
    def loss_model_dir(cls, areal_tiny_model_dir: str) -> str:
        return areal_tiny_model_dir

    @pytest.fixture(scope="class")
    @classmethod
    def loss_engine(cls, loss_model_dir: str) -> Any:
        engine = _torch_engine(loss_model_dir, total_steps=8)
        yield engine
        engine.destroy()

    @pytest.fixture(scope="class")
    @classmethod
    def loss_step(cls, loss_engine: Any) -> dict[str, Any]:
        """One micro-batch's tensors exactly as the engine hands them to a
        loss: off-policy behaviour logprobs, recomputed proximal ones, mixed-sign advantages."""
        from areal_kernel.algo.losses import ppo_actor_loss
        from areal_kernel.algo.rl import bind_loss
        from areal_kernel.api.loss import LossKnobs

        batch = _loss_batch()
        rng = random.Random(1)
        current = loss_engine.compute_logprobs(batch)
        for t, row in zip(batch.trajectories, current):
            t.logprobs = [lp + rng.uniform(-0.3, 0.3) if m else 0.0 for lp, m in zip(row, t.loss_mask)]
        extra = {
            "advantages": [[(1.0 if t.reward > 0 else -1.0) * (0.5 + rng.random()) * m for m in t.loss_mask]
                           for t in batch.trajectories],
            "prox_logprobs": loss_engine.compute_logprobs(batch, only_loss_tokens=True),
        }  # fmt: skip
        seen: list[tuple[Any, Any, dict[str, Any]]] = []
        ppo = bind_loss(ppo_actor_loss, LossKnobs())

        def capture(logprobs: Any, entropy: Any, data: dict[str, Any]) -> Any:
            seen.append((logprobs.detach().clone(), entropy.detach().clone(), {k: v.clone() for k, v in data.items()}))
            return ppo(logprobs, entropy, data)

        loss_engine.train_batch(batch, capture, extra)
        assert len(seen) == 1, "expected the whole batch in one micro-batch"
        lp, ent, data = seen[0]
        return {"batch": batch, "extra": extra, "logprobs": lp, "entropy": ent, "data": data}

    # -- helpers --------------------------------------------------------------
    @staticmethod
    def _loss_fn(name: str, settings: dict | None, knobs: dict, extra_options: dict | None = None) -> Any:
        """The ``loss_fn`` the trainer hands ``train_batch``: registry target,
        shared knobs (``LossKnobs``) and validated settings as keywords;
        ``extra_options``: further keywords, which the loss must ignore."""
        import functools

        from areal_kernel.algo.rl import RLConfig, bind_loss
        from areal_kernel.api.loss import LossKnobs

        cfg = RLConfig(loss=name, loss_settings=settings or None, **knobs)
        target = _spec("loss", name).load()
        if extra_options:
            target = functools.partial(target, **extra_options)
        return bind_loss(target, LossKnobs.of(cfg), cfg.loss_settings, name=name)

    @staticmethod
    def _run(loss_fn: Any, logprobs: Any, entropy: Any, data: dict[str, Any]) -> tuple[float, Any, dict[str, float]]:
        import torch

        lp = logprobs.clone().requires_grad_(True)
        loss, stats = loss_fn(lp, entropy, data)
        assert torch.is_tensor(loss) and loss.dim() == 0, f"the loss must be a 0-d tensor, got {loss!r}"
        assert loss.requires_grad, "the loss carries no gradient to the logprobs"
        loss.backward()
        assert isinstance(stats, dict), f"stats must be a dict, got {type(stats).__name__}"
        out = {}
        for k, v in stats.items():
            out[k] = float(v.detach()) if torch.is_tensor(v) else float(v)
        return float(loss.detach()), lp.grad.detach().clone(), out

    @staticmethod
    def _select(data: dict[str, Any], idx: Any, n: int) -> dict[str, Any]:
        # Per-token tensors are cut; the 0-d batch totals stay (what a micro-batch gets).
        return {k: (v[idx] if v.dim() == 1 and v.shape[0] == n else v) for k, v in data.items()}

    # -- tests ----------------------------------------------------------------
    def test_trains_in_the_kernel_engine(
        self, loss_name: str, loss_settings: dict, loss_knobs: dict, loss_engine: Any, loss_step: dict
    ) -> None:
        batch = loss_step["batch"]
        # Proximal logprobs recomputed with the current weights, as the trainer does before a step.
        extra = dict(loss_step["extra"], prox_logprobs=loss_engine.compute_logprobs(batch, only_loss_tokens=True))
        stats = loss_engine.train_batch(batch, self._loss_fn(loss_name, loss_settings, loss_knobs), extra)
        assert stats["skipped"] == 0.0 and _finite(stats["loss"]), stats
        assert _finite(stats["grad_norm"]) and stats["grad_norm"] > 0, stats

    def test_micro_batch_shares_sum_to_the_batch_loss(
        self, loss_name: str, loss_settings: dict, loss_knobs: dict, loss_step: dict
    ) -> None:
        """The engine back-propagates each micro-batch's share and sums stats
        (max/min for ``_max``/``_min`` keys): any split must give the whole batch's loss and gradient."""
        import torch

        from areal_kernel.engine.microbatch import merge_stats

        fn = self._loss_fn(loss_name, loss_settings, loss_knobs)
        lp, ent, data = loss_step["logprobs"], loss_step["entropy"], loss_step["data"]
        n = lp.shape[0]
        whole, grad, stats = self._run(fn, lp, ent, data)
        seq_ids = data["seq_ids"]
        for split in ([[0, 1], [2, 3]], [[0], [1, 2], [3]], [[3], [0, 1, 2]]):
            total = 0.0
            merged: dict[str, float] = {}
            g = torch.zeros_like(grad)
            for part in split:
                idx = torch.nonzero(torch.isin(seq_ids, torch.tensor(part))).flatten()
                share, g_part, s_part = self._run(fn, lp[idx], ent[idx], self._select(data, idx, n))
                total += share
                g[idx] = g_part
                merge_stats(merged, s_part)  # the engine's own rule for folding micro-batch stats
            assert total == pytest.approx(whole, rel=1e-5, abs=1e-6), (split, total, whole)
            assert torch.allclose(g, grad, rtol=1e-5, atol=1e-7), split
            for k, v in stats.items():
                assert merged[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (split, k)

    def test_tokens_off_the_loss_mask_change_nothing(
        self, loss_name: str, loss_settings: dict, loss_knobs: dict, loss_step: dict
    ) -> None:
        """Three more prompt tokens per sequence, with arbitrary logprobs: same
        loss, same gradient on the loss tokens, none on the new ones."""
        import torch

        fn = self._loss_fn(loss_name, loss_settings, loss_knobs)
        lp, ent, data = loss_step["logprobs"], loss_step["entropy"], loss_step["data"]
        n = lp.shape[0]
        whole, grad, _ = self._run(fn, lp, ent, data)
        starts = torch.nonzero(data["position_ids"] == 0).flatten().tolist()
        src: list[int] = []
        added: list[bool] = []
        for i in range(n):
            src.append(i)
            added.append(False)
            if i in starts:  # copies of the sequence's first (prompt) token
                src += [i] * 3
                added += [True] * 3
        src_t, added_t = torch.tensor(src), torch.tensor(added)
        assert not bool((data["loss_mask"][src_t][added_t] > 0).any())
        g = torch.Generator().manual_seed(3)
        padded_lp = torch.where(added_t, -5 * torch.rand(len(src), generator=g), lp[src_t])
        padded_ent = torch.where(added_t, 3 * torch.rand(len(src), generator=g), ent[src_t])
        loss, g_pad, _ = self._run(fn, padded_lp, padded_ent, self._select(data, src_t, n))
        assert loss == pytest.approx(whole, rel=1e-5, abs=1e-6)
        assert torch.allclose(g_pad[~added_t], grad, rtol=1e-5, atol=1e-7)
        assert bool((g_pad[added_t] == 0).all()), "a token off the loss mask got a gradient"

    def test_gradient_follows_the_advantage(
        self, loss_name: str, loss_settings: dict, loss_knobs: dict, loss_step: dict
    ) -> None:
        """On-policy (behaviour = proximal = current logprobs), descending the
        loss raises the logprob of tokens with a positive advantage and lowers the others'."""
        fn = self._loss_fn(loss_name, loss_settings, loss_knobs)
        lp, ent, data = loss_step["logprobs"], loss_step["entropy"], dict(loss_step["data"])
        mask = data["loss_mask"] > 0
        data["old_logprobs"] = lp * mask
        if "prox_logprobs" in data:
            data["prox_logprobs"] = lp * mask
        _, grad, _ = self._run(fn, lp, ent, data)
        adv = data["advantages"]
        push = grad * adv
        assert bool((push[mask & (adv != 0)] <= 1e-9).all()), "a loss token is pushed against its advantage"
        assert float(push[mask].sum()) < 0, "the gradient does not follow the advantages"

    def test_extreme_inputs_stay_finite(
        self, loss_name: str, loss_settings: dict, loss_knobs: dict, loss_step: dict
    ) -> None:
        import torch

        fn = self._loss_fn(loss_name, loss_settings, loss_knobs)
        lp, ent, data = loss_step["logprobs"], loss_step["entropy"], dict(loss_step["data"])
        mask = data["loss_mask"] > 0
        sign = torch.where(torch.arange(lp.shape[0]) % 2 == 0, 1.0, -1.0)
        # Very stale samples (log-ratios of +-20) with large advantages.
        data["old_logprobs"] = torch.where(mask, lp + 20 * sign, torch.zeros_like(lp))
        if "prox_logprobs" in data:
            data["prox_logprobs"] = torch.where(mask, lp - 20 * sign, torch.zeros_like(lp))
        data["advantages"] = data["advantages"] * 1000
        loss, grad, stats = self._run(fn, lp, ent, data)
        assert _finite(loss) and bool(torch.isfinite(grad).all()), loss
        assert all(_finite(v) for v in stats.values()), stats

    def test_takes_every_keyword_the_kernel_passes(
        self, loss_name: str, loss_settings: dict, loss_knobs: dict, loss_step: dict
    ) -> None:
        fn = self._loss_fn(loss_name, loss_settings, loss_knobs, {_EXTRA_KEYWORD: True})
        loss, _, _ = self._run(fn, loss_step["logprobs"], loss_step["entropy"], loss_step["data"])
        assert _finite(loss)

    def test_its_settings_take_effect(
        self, loss_name: str, loss_settings: dict, loss_settings_alt: dict | None, loss_knobs: dict, loss_step: dict
    ) -> None:
        args = (loss_step["logprobs"], loss_step["entropy"], loss_step["data"])
        base = self._run(self._loss_fn(loss_name, loss_settings, loss_knobs), *args)[0]
        if loss_settings_alt is None:
            assert self._run(self._loss_fn(loss_name, loss_settings, loss_knobs), *args)[0] == base
            return
        alt = self._run(self._loss_fn(loss_name, loss_settings_alt, loss_knobs), *args)[0]
        assert alt != pytest.approx(base), f"algorithm.{loss_name}: {loss_settings_alt} changed nothing"

    def test_unknown_setting_is_refused(self, loss_name: str) -> None:
        _check_unknown_setting_is_refused("loss", loss_name, f"algorithm.{loss_name}")
