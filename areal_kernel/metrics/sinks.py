"""Metric sinks. The trainer builds every sink listed in ``logging.sinks``
through ``MetricSink.from_context``, i.e. ``Sink(run_dir, total_steps=N, **settings)`` and fans metrics out with
``log(step, metrics)``, then ``close()`` (contract: docs/plugin-authoring.md,
Metric sinks). ``wandb`` lives in ``areal_kernel.metrics.wandb_sink``."""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, TextIO

from areal_kernel.api.metric_sink import MetricSink


def _clean(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        try:
            out[k] = float(v)
        except (TypeError, ValueError):
            continue
    return out


class JsonlSink(MetricSink):
    """Appends one JSON object per step to ``<run_dir>/metrics.jsonl`` (flushed each line,
    so a killed run keeps every completed step)."""

    def __init__(self, run_dir: str, *, total_steps: int | None = None, filename: str = "metrics.jsonl") -> None:
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, filename)
        self._f = open(self.path, "a", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **{k: (None if math.isnan(v) or math.isinf(v) else v) for k, v in _clean(metrics).items()}}
        self._f.write(json.dumps(row, sort_keys=True) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class TensorBoardSink(MetricSink):
    def __init__(self, run_dir: str, *, total_steps: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard"))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for k, v in _clean(metrics).items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class ConsoleSink(MetricSink):
    """A one-line progress report per step: step/total, rewards, staleness,
    tokens/s. The first time a label appears, a line says what it means."""

    KEYS = (
        ("sampled_reward", "rollout/reward_mean"),
        ("trained_reward", "reward/mean"),
        ("acc", "eval/accuracy"),
        ("stale", "rollout/staleness_mean"),
        ("tok/s", "perf/train_tokens_per_s"),
        ("loss", "train/loss"),
        ("step_s", "perf/step_s"),
    )
    # The two rewards differ when groups are dropped (all answers scored alike):
    # the first is the model's sampling reward, the second what the step trained on.
    LEGEND = {
        "sampled_reward": "mean reward of every answer sampled since the last step, dropped groups included "
        "(metric rollout/reward_mean; '-': none finished in between)",
        "trained_reward": "mean reward of the batch this step trained on, after groups whose answers all scored "
        "alike were dropped (reward/mean)",
        "acc": "held-out greedy accuracy (eval/accuracy)",
        "stale": "mean staleness of the trained batch in weight versions (rollout/staleness_mean)",
    }

    def __init__(
        self, run_dir: str | None = None, *, total_steps: int | None = None, stream: TextIO | None = None
    ) -> None:
        self.total = total_steps
        self.stream = stream or sys.stdout
        self._explained: set[str] = set()

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        m = _clean(metrics)
        total = f"/{self.total}" if self.total else ""
        bar = ""
        if self.total:
            done = int(20 * min(step, self.total) / self.total)
            bar = "[" + "#" * done + "." * (20 - done) + "] "
        shown = [(label, m[key]) for label, key in self.KEYS if key in m]
        new = [label for label, _ in shown if label in self.LEGEND and label not in self._explained]
        if new:
            self._explained.update(new)
            for label in new:
                print(f"  {label}: {self.LEGEND[label]}", file=self.stream, flush=True)
        parts = [f"{label} {'-' if v != v else f'{v:.3f}'}" for label, v in shown]
        print(f"{bar}step {step}{total}  " + "  ".join(parts), file=self.stream, flush=True)

    def close(self) -> None:
        pass
