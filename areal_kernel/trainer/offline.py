"""``areal train`` for the offline algorithms: SFT, DPO/IPO and reward models.

No inference server and no rollout: records are encoded once, batches are
drawn in a seeded order epoch after epoch (``RecordStream``), and each step is
one ``TrainEngine.train_batch`` call under the loss contract. Run directory,
``config.yaml``, metric sinks, plugin hooks, HF checkpoints (``step<N>`` and
``final``) and ``result.json`` are shared with the RL trainer
(``trainer/common.py``).

Subclasses (``trainer/sft.py``, ``preference.py``, ``reward_model.py``)
define ``encode``, ``train_step`` and ``evaluate``; each is registered as a
trainer (``areal_kernel.builtin``), and so can a plugin's subclass be.
"""

from __future__ import annotations

import math
import time
from typing import Any, TypeVar

from pydantic import BaseModel

from areal_kernel.api.engine import TrainEngine
from areal_kernel.api.io import FinetuneSpec
from areal_kernel.api.trainer import Trainer, TrainerContext
from areal_kernel.errors import ConfigError, DataError
from areal_kernel.logging import get_logger
from areal_kernel.plugins import get_plugin_manager
from areal_kernel.trainer.common import SETUP_FIRST, RecordStream, make_sinks, save_hf_checkpoint, write_run_config
from areal_kernel.trainer.components import build_train_engine, load_data, load_tokenizer, resolve_model_dir

log = get_logger(__name__)

M = TypeVar("M", bound=BaseModel)


class OfflineTrainer(Trainer):
    """Shared loop; ``headline`` names the eval metric printed before/after."""

    headline = ("eval/loss", "held-out loss")

    def __init__(self, context: TrainerContext) -> None:
        super().__init__(context)
        self.hook = get_plugin_manager().hook
        self.engine: TrainEngine | None = None
        self.sinks: list[Any] = []
        self.step = 0

    # -- to override ------------------------------------------------------------
    def required_fields(self) -> tuple[str, ...]:
        return ()

    def encode(self, records: list[dict[str, Any]], split: str) -> list[Any]:
        raise NotImplementedError

    def train_step(self, items: list[Any]) -> dict[str, float]:
        raise NotImplementedError

    def evaluate(self) -> dict[str, float]:
        raise NotImplementedError

    def make_engine(self) -> TrainEngine:
        return build_train_engine(self.cfg, self.run_dir)

    def extra_setup(self) -> None:
        """After the engine is ready (e.g. the DPO reference model)."""

    def settings_of(self, model: type[M]) -> M:
        """The trainer's validated ``algorithm.<section>`` settings (the
        context's ``settings``, an instance of its registered ``config_model``)."""
        if not isinstance(self.settings, model):
            raise TypeError(
                f"{type(self).__name__} ('{self.context.name}') expects {model.__name__} settings, got "
                f"{type(self.settings).__name__}: register it with config_model={model.__module__}:{model.__name__} "
                "and build it from a resolved config (TrainerContext.for_config)"
            )
        return self.settings

    def trained_engine(self) -> TrainEngine:
        """The engine being trained (``self.engine``); built by ``setup()``."""
        if self.engine is None:
            raise RuntimeError(f"{type(self).__name__}: {SETUP_FIRST}")
        return self.engine

    # -- set-up -------------------------------------------------------------------
    @property
    def source(self) -> str:
        d = self.cfg.dataset
        return f"dataset {d.path!r}" if d.path else f"dataset '{d.type}'"

    def setup(self) -> None:
        cfg = self.cfg
        write_run_config(cfg, self.run_dir)
        self.model_dir = resolve_model_dir(cfg)
        self.tokenizer = load_tokenizer(self.model_dir)
        train_records, eval_records = load_data(cfg, self.required_fields(), f"algorithm '{cfg.algorithm.type}'")
        self.train_examples = self.encode(train_records, "train")
        self.eval_examples = self.encode(eval_records, "eval") if eval_records else []
        if not self.train_examples:
            raise DataError(f"{self.source}: no training example is left after encoding (see the warnings above)")
        self.ft = FinetuneSpec(
            total_train_epochs=cfg.trainer.total_train_epochs,
            dataset_size=len(self.train_examples),
            train_batch_size=cfg.trainer.batch_size,
            max_steps=cfg.trainer.max_steps,
        )
        if cfg.trainer.batch_size > len(self.train_examples):
            raise ConfigError(
                f"trainer.batch_size={cfg.trainer.batch_size} exceeds the {len(self.train_examples)} training "
                f"examples of {self.source}; use a smaller batch"
            )
        self.sinks = make_sinks(cfg, self.run_dir, self.ft.total_train_steps)
        self.hook.areal_on_run_start(config=cfg, run_dir=self.run_dir)
        self.engine = self.make_engine()
        self.engine.initialize(self.model_dir, self.ft.total_train_steps)
        self.extra_setup()
        self.stream = RecordStream(self.train_examples, cfg.trainer.total_train_epochs, cfg.seed, cfg.dataset.shuffle)
        log.info(
            "offline training ready", algorithm=cfg.algorithm.type, train=len(self.train_examples),
            eval=len(self.eval_examples), steps=self.ft.total_train_steps,
        )  # fmt: skip

    # -- the loop -------------------------------------------------------------------
    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def _eval_logged(self, step: int) -> dict[str, float]:
        if not self.eval_examples:
            return {}
        out = self.evaluate()
        self.log_metrics(step, out)
        return out

    def train(self) -> dict[str, Any]:
        cfg = self.cfg
        key, label = self.headline
        before = self._eval_logged(0)
        if key in before:
            print(f"{label} before training: {before[key]:.4f} (n={len(self.eval_examples)})", flush=True)
        total = self.ft.total_train_steps
        t_run = time.monotonic()
        samples = 0
        for step in range(1, total + 1):
            items = [self.stream() for _ in range(cfg.trainer.batch_size)]
            items = [x for x in items if x is not None]
            if not items:  # pragma: no cover - total steps never exceed the data
                break
            t0 = time.monotonic()
            stats = self.train_step(items)
            dt = time.monotonic() - t0
            samples += len(items)
            self.step = step
            metrics: dict[str, Any] = {f"train/{k}": v for k, v in stats.items() if isinstance(v, (int, float))}
            metrics.update(
                {
                    "perf/step_s": dt,
                    "perf/train_tokens_per_s": stats.get("n_tokens", 0.0) / max(dt, 1e-9),
                    "epoch": self.stream.position / len(self.train_examples),
                }
            )
            if not math.isfinite(float(stats.get("loss", 0.0))):
                log.warning("non-finite loss: step skipped", step=step)
            if cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0 and step < total and self.eval_examples:
                metrics.update(self.evaluate())
            self.log_metrics(step, metrics)
            self.hook.areal_on_train_step(step=step, metrics=metrics)
            if cfg.checkpoint.save_hf_every and step % cfg.checkpoint.save_hf_every == 0 and step < total:
                self.save_hf(f"step{step}")
        after = self._eval_logged(self.step)
        final = self.save_hf("final")
        elapsed = time.monotonic() - t_run
        if key in after:
            print(
                f"{label}: before {before[key]:.4f} -> after {after[key]:.4f} "
                f"(n={len(self.eval_examples)}, {self.step} steps, {samples} examples, {elapsed:.0f}s training)",
                flush=True,
            )
        print(f"final HF checkpoint: {final}", flush=True)
        return {
            "algorithm": cfg.algorithm.type, "steps": self.step, "examples": samples, "train_seconds": elapsed,
            "before": before, "after": after, "checkpoint": final,
        }  # fmt: skip

    def save_hf(self, tag: str) -> str:
        return save_hf_checkpoint(self.trained_engine(), self.run_dir, tag, self.cfg.checkpoint.keep_last, self.step)

    def close(self, status: str) -> None:
        for engine in self.engines():
            engine.destroy()
        for sink in self.sinks:
            sink.close()
        self.hook.areal_on_run_end(status=status, run_dir=self.run_dir)

    def engines(self) -> list[TrainEngine]:
        return [e for e in (self.engine,) if e is not None]
