"""Reward model: Bradley-Terry on preference pairs, a scalar head on the LM.

The score of a sequence is the head's output at its last token, so each
sequence's ``loss_mask`` marks that token only. Gradients go through
``train_batch`` with the two-pass scheme of ``areal_kernel.algo.dpo_losses``.
The final checkpoint is an HF sequence-classification directory (one label).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from areal_kernel.api.engine import TrainEngine
from areal_kernel.config.offline import RMConfig
from areal_kernel.errors import ConfigError
from areal_kernel.trainer.offline_data import Encoded, PairExample
from areal_kernel.trainer.preference import PairTrainer, pair_batch

if TYPE_CHECKING:
    from areal_kernel.engine.scalar_head import ScalarHeadEngine


def _last_token_only(e: Encoded) -> Encoded:
    n = len(e.input_ids)
    return Encoded(e.input_ids, [0] * (n - 1) + [1])


class RewardModelTrainer(PairTrainer):
    """``algorithm.type: rm``; settings (``RMConfig``) in ``algorithm.rm``."""

    @property
    def rm(self) -> RMConfig:
        return self.settings_of(RMConfig)

    def format_config(self) -> Any:
        return self.rm

    def adapt(self, pair: PairExample) -> PairExample:
        return PairExample(_last_token_only(pair.chosen), _last_token_only(pair.rejected), pair.record_id)

    def make_engine(self) -> ScalarHeadEngine:
        from areal_kernel.engine.scalar_head import ScalarHeadEngine

        from areal_kernel.plugins import get_registry

        backend = self.cfg.actor.allocation.backend
        # Engines declare "reward_model" when the kernel's scalar-head variant
        # can be built from their settings section.
        if "reward_model" not in get_registry().get("train_engine", backend).capabilities:
            raise ConfigError(
                f"actor.backend: the reward-model trainer (algorithm.type rm) needs a train engine with the "
                f"'reward_model' capability (the kernel's scalar-head variant); {backend!r} does not declare it"
            )
        return ScalarHeadEngine(self.cfg.actor.plugin_config)

    def scores(self, engine: TrainEngine, items: list[PairExample]) -> tuple[list[float], list[float]]:
        from areal_kernel.engine.scalar_head import ScalarHeadEngine

        # make_engine built it: scores are the scalar head's values, which plain train engines lack.
        if not isinstance(engine, ScalarHeadEngine):
            raise TypeError(f"the reward-model trainer scores with a ScalarHeadEngine, got {type(engine).__name__}")
        # A name of its own: a TrainEngine-typed name may use only the contract's
        # members (tests/kernel/test_train_engine_api.py), compute_values is not one.
        head: ScalarHeadEngine = engine
        rows = head.compute_values(pair_batch(items), only_loss_tokens=True)
        s = [row[-1] for row in rows]
        return s[0::2], s[1::2]

    def _loss_of(self) -> Any:
        from areal_kernel.algo.rm_losses import bradley_terry_losses

        coef = self.rm.center_coef
        return lambda c, r: bradley_terry_losses(c, r, center_coef=coef)

    def train_step(self, items: list[PairExample]) -> dict[str, float]:
        import torch

        from areal_kernel.algo.dpo_losses import pair_loss_and_grads
        from areal_kernel.algo.rm_losses import rm_stats

        chosen, rejected = self.scores(self.trained_engine(), items)
        loss, gc, gr = pair_loss_and_grads(self._loss_of(), chosen, rejected)
        stats = self.surrogate_step(items, gc, gr, per_token=False)
        stats.update(rm_stats(torch.tensor(chosen), torch.tensor(rejected)))
        stats["loss"] = loss
        return stats

    def evaluate(self) -> dict[str, float]:
        import torch

        from areal_kernel.algo.rm_losses import rm_stats

        chosen, rejected = self.scores_chunked(self.trained_engine(), self.eval_examples)
        c, r = torch.tensor(chosen, dtype=torch.float64), torch.tensor(rejected, dtype=torch.float64)
        s = rm_stats(c, r)
        return {
            "eval/loss": float(self._loss_of()(c, r).mean()), "eval/accuracy": s["rewards/accuracy"],
            "eval/margin": s["rewards/margin"],
        }  # fmt: skip
