"""DPO and IPO on preference pairs, against a frozen reference model.

Each step: score both answers of every pair with the policy (no gradients)
and the reference (cached: it never changes), evaluate the pair loss and its
gradient with respect to each sequence score, then one ``train_batch`` whose
linear surrogate loss carries exactly that gradient (see
``areal_kernel.algo.dpo_losses``).
"""

from __future__ import annotations

from typing import Any

from areal_kernel.api.engine import TrainEngine
from areal_kernel.api.io import TrajectoryBatch
from areal_kernel.config.offline import DPOConfig
from areal_kernel.errors import ConfigError
from areal_kernel.logging import get_logger
from areal_kernel.plugins import get_plugin_manager
from areal_kernel.trainer.common import SETUP_FIRST
from areal_kernel.trainer.components import build_train_engine
from areal_kernel.trainer.offline import OfflineTrainer
from areal_kernel.trainer.offline_data import (
    PAIR_FIELDS,
    ChatEncoder,
    PairExample,
    arithmetic_pairs,
    check_pair_fields,
    encode_pair,
)

log = get_logger(__name__)


def pair_batch(items: list[PairExample]) -> TrajectoryBatch:
    """``[chosen_0, rejected_0, chosen_1, ...]``."""
    return TrajectoryBatch([e.trajectory() for p in items for e in (p.chosen, p.rejected)])


def sequence_scores(
    items: list[PairExample], rows: list[list[float]], average: bool
) -> tuple[list[float], list[float]]:
    """Chosen and rejected scores (sum, or mean, of answer-token values)."""
    scores = []
    for k, row in enumerate(rows):
        enc = items[k // 2].chosen if k % 2 == 0 else items[k // 2].rejected
        vals = [x for x, m in zip(row, enc.loss_mask) if m]
        scores.append(sum(vals) / len(vals) if average else sum(vals))
    return scores[0::2], scores[1::2]


def seq_coef_rows(
    batch: TrajectoryBatch, grads_c: list[float], grads_r: list[float], per_token: bool
) -> list[list[float]]:
    """``extra["seq_coef"]`` for ``pair_batch`` order: ``dL/d score`` of each
    sequence on all its tokens, divided by its answer length when the score
    is a mean of token logprobs."""
    rows = []
    for k, t in enumerate(batch.trajectories):
        g = grads_c[k // 2] if k % 2 == 0 else grads_r[k // 2]
        if per_token:
            g = g / max(sum(1 for m in t.loss_mask if m), 1)
        rows.append([g] * len(t.input_ids))
    return rows


class PairTrainer(OfflineTrainer):
    """Shared by DPO/IPO and the reward model: pair data and encoding."""

    headline = ("eval/accuracy", "held-out preference accuracy")

    def format_config(self) -> Any:
        raise NotImplementedError

    def required_fields(self) -> tuple[str, ...]:
        # The arithmetic source builds pairs itself (see offline_data.arithmetic_pairs).
        return () if self.cfg.dataset.type == "arithmetic" else PAIR_FIELDS

    def encode(self, records: list[dict[str, Any]], split: str) -> list[PairExample]:
        if self.cfg.dataset.type == "arithmetic":
            records = arithmetic_pairs(records, self.cfg.seed)
        check_pair_fields(records, self.source)
        enc = ChatEncoder(self.tokenizer, self.format_config(), self.source)
        out = [encode_pair(enc, rec) for rec in records]
        kept = [p for p in out if p is not None]
        if len(kept) < len(out):
            log.warning(
                "pairs with an answer cut away by max_length were dropped",
                split=split, dropped=len(out) - len(kept), max_length=self.format_config().max_length,
            )  # fmt: skip
        return [self.adapt(p) for p in kept]

    def adapt(self, pair: PairExample) -> PairExample:
        return pair

    def scores(self, engine: TrainEngine, items: list[PairExample]) -> tuple[list[float], list[float]]:
        raise NotImplementedError

    def scores_chunked(self, engine: TrainEngine, items: list[PairExample]) -> tuple[list[float], list[float]]:
        bs = max(self.cfg.trainer.batch_size, 1)
        c: list[float] = []
        r: list[float] = []
        for i in range(0, len(items), bs):
            ci, ri = self.scores(engine, items[i : i + bs])
            c += ci
            r += ri
        return c, r

    def surrogate_step(
        self, items: list[PairExample], grads_c: list[float], grads_r: list[float], per_token: bool
    ) -> dict[str, float]:
        """``train_batch`` with the linear surrogate: coefficient ``dL/d score``
        on each answer token (divided by the answer length for mean scores)."""
        from areal_kernel.algo.dpo_losses import make_sequence_linear_loss_fn

        batch = pair_batch(items)
        rows = seq_coef_rows(batch, grads_c, grads_r, per_token)
        return self.trained_engine().train_batch(batch, make_sequence_linear_loss_fn(), extra={"seq_coef": rows})


class PreferenceTrainer(PairTrainer):
    """``algorithm.type: dpo`` or ``ipo``; settings (``DPOConfig``) in
    ``algorithm.dpo`` for both (``ipo`` registers ``settings_section="dpo"``)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.ref_engine: TrainEngine | None = None
        self._ref: dict[int, tuple[float, float]] = {}

    @property
    def dpo(self) -> DPOConfig:
        return self.settings_of(DPOConfig)

    @property
    def loss_type(self) -> str:
        """``dpo`` or ``ipo``: the registered name this trainer was built for."""
        return self.context.name

    def format_config(self) -> Any:
        return self.dpo

    @property
    def average(self) -> bool:
        a = self.dpo.average_log_prob
        return (self.loss_type == "ipo") if a is None else a

    def extra_setup(self) -> None:
        c = self.dpo
        ref_dir = self.model_dir
        if c.ref_model_path:
            ref_dir = get_plugin_manager().hook.areal_resolve_model_path(name_or_path=c.ref_model_path)
            if not ref_dir:
                raise ConfigError(f"algorithm.dpo.ref_model_path: cannot resolve {c.ref_model_path!r} to a local model")
        # A frozen copy, only ever used for scoring.
        self.ref_engine = build_train_engine(self.cfg, self.run_dir, role="ref")
        self.ref_engine.initialize(ref_dir, 1)

    def engines(self) -> list[TrainEngine]:
        return [e for e in (self.engine, self.ref_engine) if e is not None]

    def scores(self, engine: TrainEngine, items: list[PairExample]) -> tuple[list[float], list[float]]:
        rows = engine.compute_logprobs(pair_batch(items), only_loss_tokens=True)
        return sequence_scores(items, rows, self.average)

    def ref_scores(self, items: list[PairExample]) -> tuple[list[float], list[float]]:
        todo = [p for p in items if id(p) not in self._ref]
        if todo:
            if self.ref_engine is None:
                raise RuntimeError(f"{type(self).__name__}: {SETUP_FIRST}")
            c, r = self.scores_chunked(self.ref_engine, todo)
            for p, ci, ri in zip(todo, c, r):
                self._ref[id(p)] = (ci, ri)
        return [self._ref[id(p)][0] for p in items], [self._ref[id(p)][1] for p in items]

    def _loss_of(self, ref_c: list[float], ref_r: list[float]) -> Any:
        import torch

        from areal_kernel.algo.dpo_losses import dpo_pair_losses

        c = self.dpo
        rc = torch.tensor(ref_c, dtype=torch.float64)
        rr = torch.tensor(ref_r, dtype=torch.float64)

        def loss_of(chosen: Any, rejected: Any) -> Any:
            return dpo_pair_losses(
                chosen,
                rejected,
                rc,
                rr,
                beta=c.beta,
                loss_type=self.loss_type,
                label_smoothing=c.label_smoothing,
            )[0]

        return loss_of, rc, rr

    def _pair_stats(
        self, chosen: list[float], rejected: list[float], ref_c: list[float], ref_r: list[float]
    ) -> dict[str, float]:
        import torch

        from areal_kernel.algo.dpo_losses import dpo_pair_losses, pair_stats

        c = self.dpo
        t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
        losses, cr, rr = dpo_pair_losses(
            t(chosen), t(rejected), t(ref_c), t(ref_r), beta=c.beta, loss_type=self.loss_type,
            label_smoothing=c.label_smoothing,
        )  # fmt: skip
        return pair_stats(losses, cr, rr)

    def train_step(self, items: list[PairExample]) -> dict[str, float]:
        from areal_kernel.algo.dpo_losses import pair_loss_and_grads

        ref_c, ref_r = self.ref_scores(items)
        chosen, rejected = self.scores(self.trained_engine(), items)
        loss_of, _, _ = self._loss_of(ref_c, ref_r)
        loss, gc, gr = pair_loss_and_grads(loss_of, chosen, rejected)
        stats = self.surrogate_step(items, gc, gr, per_token=self.average)
        # The engine's "loss" is the surrogate's value; report the pair loss
        # (measured on the weights the gradient was taken at).
        stats.update(self._pair_stats(chosen, rejected, ref_c, ref_r))
        stats["loss"] = loss
        return stats

    def evaluate(self) -> dict[str, float]:
        ref_c, ref_r = self.ref_scores(self.eval_examples)
        chosen, rejected = self.scores_chunked(self.trained_engine(), self.eval_examples)
        s = self._pair_stats(chosen, rejected, ref_c, ref_r)
        return {
            "eval/loss": s["loss"], "eval/accuracy": s["rewards/accuracy"], "eval/margin": s["rewards/margin"],
            "eval/reward_chosen": s["rewards/chosen"], "eval/reward_rejected": s["rewards/rejected"],
        }  # fmt: skip
