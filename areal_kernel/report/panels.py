"""The report's plots as data: which metrics each panel draws.

A monitor that starts logging new metrics shows up in the report by adding a
:class:`Series` to a panel here (or every metric under a ``prefix`` is drawn
already: ``mismatch/`` and ``monitor/``). A panel whose series have no data
in a run says which metrics it needs instead of disappearing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from areal_kernel.report.rundir import RunData

Row = dict[str, Any]


@dataclass(frozen=True)
class Series:
    """One line of a panel: the metric ``key`` of ``metrics.jsonl`` by step,
    or ``derive(row)`` computed from a step's row (then ``key`` names it)."""

    key: str
    label: str
    derive: Callable[[Row], float | None] | None = None
    # Draw markers only (values logged at a few steps, e.g. held-out evaluation).
    points: bool = False
    # A marker of its own (e.g. "x" where two point series often coincide).
    marker: str | None = None

    def values(self, run: RunData) -> tuple[list[int], list[float]]:
        if self.derive is None:
            return run.series(self.key)
        xs: list[int] = []
        ys: list[float] = []
        for step in sorted(run.rows):
            v = self.derive(run.rows[step])
            if v is not None:
                xs.append(step)
                ys.append(v)
        return xs, ys


@dataclass(frozen=True)
class Panel:
    """One plot. ``needs`` says, for a run without any of its data, what
    would fill it; ``prefixes`` add every metric whose name starts with one."""

    id: str
    title: str
    ylabel: str
    series: tuple[Series, ...]
    needs: str
    prefixes: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)
    # A note that depends on the run (its config), e.g. which series carry the signal.
    explain: Callable[[RunData], str | None] | None = None

    def all_series(self, run: RunData) -> list[Series]:
        known = {s.key for s in self.series}
        extra = sorted(k for k in run.keys() if k not in known and any(k.startswith(p) for p in self.prefixes))
        return [*self.series, *(Series(k, k) for k in extra)]


def _num(row: Row, key: str) -> float | None:
    v = row.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def generated_tokens_per_s(row: Row) -> float | None:
    """Tokens the trained batch generated per second of the step (the batch's
    sequences x their mean generated length / step time)."""
    n, length, step_s = _num(row, "batch/sequences"), _num(row, "rollout/gen_len_mean"), _num(row, "perf/step_s")
    if n is None or length is None or not step_s:
        return None
    return n * length / step_s


def mismatch_explained(run: RunData) -> str | None:
    """Which of the loss's statistics measure the gap between the servers'
    logprobs and the trainer's in this run (it depends on how the proximal
    logprobs are made)."""
    recompute = run.config_value("algorithm.recompute_proximal")
    if recompute is False:
        return (
            "algorithm.recompute_proximal is false: the proximal logprobs are the servers', so the behaviour weight "
            "is 1 by construction. The ratio and its KL estimate compare the trainer's logprobs with the servers' "
            "(exactly so at the first optimizer step of a batch; stale tokens add the policy's change)."
        )
    if recompute is True:
        return (
            "algorithm.recompute_proximal is true: the behaviour weight compares the trainer's logprobs (current "
            "weights, before the step) with the servers' on the same tokens; stale tokens add the policy's change."
        )
    return None


PANELS: tuple[Panel, ...] = (
    Panel(
        "reward",
        "Reward and held-out accuracy",
        "reward / accuracy",
        (
            Series("rollout/reward_mean", "sampling reward (every answer sampled since the last step)"),
            Series("reward/mean", "trained batch reward"),
            Series("eval/accuracy", "held-out greedy accuracy", points=True),
            Series("eval/reward", "held-out mean reward", points=True, marker="x"),
        ),
        needs="rollout/reward_mean, reward/mean or eval/accuracy",
    ),
    Panel(
        "staleness",
        "Staleness of the trained samples",
        "weight versions behind",
        (
            Series("rollout/staleness_mean", "mean staleness"),
            Series("rollout/staleness_max", "max staleness"),
        ),
        needs="rollout/staleness_mean or rollout/staleness_max",
    ),
    Panel(
        "staleness_hist",
        "Trained sequences by staleness",
        "sequences",
        (),
        needs="rollout/staleness_hist/<k> (the number of trained sequences k versions old)",
        prefixes=("rollout/staleness_hist/",),
    ),
    Panel(
        "mismatch",
        "Train/inference mismatch",
        "importance weight / fraction",
        (
            Series("train/behav_imp_weight", "behaviour weight exp(proximal - server logprob), mean"),
            Series("train/behav_imp_weight_max", "behaviour weight, max"),
            Series("train/behav_masked_frac", "tokens dropped by behav_imp_weight_cap"),
            Series("train/behav_clamped_frac", "tokens clamped to behav_imp_weight_cap"),
            Series("train/importance_weight", "ratio exp(trainer - proximal logprob), mean"),
            Series("train/approx_kl", "k3 KL estimate of that ratio"),
        ),
        needs="train/behav_imp_weight or train/importance_weight (the PPO loss's statistics) or mismatch/* metrics",
        prefixes=("mismatch/",),
        explain=mismatch_explained,
        notes=(
            "The logprob gap between servers and trainer on the same tokens is drawn from mismatch/* metrics when a "
            "run logs them; without them this panel shows the importance-weight statistics of the loss.",
        ),
    ),
    Panel(
        "throughput",
        "Throughput",
        "tokens/s",
        (
            Series("perf/train_tokens_per_s", "trained tokens/s (batch tokens / training time)"),
            Series("perf/gen_tokens_per_s", "generated tokens/s (trained batch)", derive=generated_tokens_per_s),
        ),
        needs="perf/train_tokens_per_s, or batch/sequences, rollout/gen_len_mean and perf/step_s",
    ),
    Panel(
        "step_time",
        "Step time: waiting for rollouts vs training",
        "seconds",
        (
            Series("perf/step_s", "step"),
            Series("perf/wait_rollout_s", "waiting for rollouts"),
            Series("perf/train_s", "training"),
        ),
        needs="perf/step_s, perf/wait_rollout_s and perf/train_s",
    ),
    Panel(
        "weights",
        "Weight updates",
        "seconds",
        (
            Series("weights/pause_s", "generation paused"),
            Series("weights/save_s", "written (disk)"),
            Series("weights/load_s", "loaded by the servers (disk)"),
            Series("weights/broadcast_s", "broadcast"),
        ),
        needs="weights/pause_s (or weights/save_s, weights/load_s, weights/broadcast_s)",
    ),
    Panel(
        "servers",
        "Inference servers and rollouts",
        "count",
        (
            Series("rollout/server_restarts", "server restarts (total)"),
            Series("rollout/failovers", "failovers (total)"),
            Series("rollout/interruptions", "generations interrupted and resumed (total)"),
            Series("rollout/failed", "failed rollouts (total)"),
            Series("rollout/stale_dropped", "dropped as too stale (total)"),
        ),
        needs="rollout/server_restarts or rollout/failovers",
    ),
    Panel(
        "monitors",
        "Monitor events",
        "count / value",
        (),
        needs="monitor/* metrics (logged by the run's correctness monitors; this run logged none)",
        prefixes=("monitor/",),
    ),
)

# What the config summary lists, in order (dotted paths into config.yaml).
CONFIG_SUMMARY: tuple[str, ...] = (
    "experiment_name",
    "seed",
    "model.path",
    "model.dtype",
    "algorithm.type",
    "algorithm.advantage",
    "algorithm.loss",
    "actor.backend",
    "actor.torch.lr",
    "rollout.backend",
    "rollout.max_staleness",
    "rollout.gconfig.n_samples",
    "rollout.gconfig.max_new_tokens",
    "rollout.gconfig.temperature",
    "weight_update.mode",
    "dataset.type",
    "reward.type",
    "trainer.max_steps",
    "trainer.batch_size",
    "trainer.eval_size",
)

# The metric that ranks steps for "best and worst steps", then its fallback.
RANK_KEYS: tuple[str, ...] = ("rollout/reward_mean", "reward/mean")
