"""Rejection-sampling fine-tuning (RFT) on the trainer toolkit.

Each step: take ``trainer.batch_size`` prompts, sample
``rollout.gconfig.n_samples`` answers to each on the inference servers
(through the selected workflow, which scores them with the selected
reward), keep the samples whose reward reaches ``algorithm.rft.min_reward``,
and train the policy on the kept ones with next-token NLL on their
generated tokens; then the servers get the new weights, so the next step
samples from the improved policy.

Written against the public API only (docs/api.md): the parts come from
``areal_kernel.trainer.toolkit``, the loss follows the loss contract of
``areal_kernel.api.loss``.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from areal_kernel.api.io import TrajectoryBatch
from areal_kernel.api.trainer import Trainer, TrainerContext
from areal_kernel.plugins import get_plugin_manager
from areal_kernel.trainer.common import RecordStream, save_hf_checkpoint, write_run_config
from areal_kernel.trainer.toolkit import (
    MetricSinks,
    build_weight_transport,
    evaluate_held_out,
    finetune_spec,
    load_datasets,
    open_metric_sinks,
    resolve_model,
    start_rollout,
    start_train_engine,
)

SAMPLES_FILE = "rft_samples.jsonl"  # one line per sample: its reward, whether it was kept, its text


class RFTSettings(BaseModel):
    """``algorithm.rft: {...}``."""

    model_config = ConfigDict(extra="forbid")  # a misspelt key is an error naming it

    min_reward: float | None = Field(
        None,
        allow_inf_nan=False,
        description="a sample is trained on when its reward reaches this (default: the reward's success_threshold)",
    )
    log_samples: bool = Field(True, description=f"write every sample with its reward to <run_dir>/{SAMPLES_FILE}")


def nll_loss(logprobs: Any, entropy: Any, data: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Token-mean NLL of the loss tokens (the generated ones), as this
    micro-batch's share of the batch loss (the loss contract: normalised by
    ``batch_loss_tokens``, so the step does not depend on the micro-batch split)."""
    mask = data["loss_mask"].to(logprobs.dtype)
    nll = -(logprobs * mask)
    loss = nll.sum() / data["batch_loss_tokens"]
    # Summed over micro-batches by the engine: nll_sum / nll_tokens is the batch's mean.
    return loss, {"nll_sum": nll.detach().sum(), "nll_tokens": mask.sum().detach()}


class RFTTrainer(Trainer):
    def __init__(self, context: TrainerContext) -> None:
        super().__init__(context)  # stores context, cfg, settings, run_dir; no work here
        self.sinks = MetricSinks([])
        self.rollout: Any = None
        self.engine: Any = None
        self.transport: Any = None
        self.samples_file: Any = None
        self.version = 0

    def setup(self) -> None:
        ctx = self.context
        # User input first (each raises an ArealError naming the field), before run_dir is written.
        self.model = resolve_model(ctx)
        self.data = load_datasets(ctx)
        self.ft = finetune_spec(ctx, len(self.data.train))
        write_run_config(self.cfg, self.run_dir)
        self.sinks = open_metric_sinks(ctx, self.ft.total_train_steps)
        get_plugin_manager().hook.areal_on_run_start(config=self.cfg, run_dir=self.run_dir)
        self.rollout = start_rollout(ctx, self.model)
        threshold = self.settings.min_reward
        self.min_reward = self.rollout.reward.success_threshold if threshold is None else threshold
        self.engine = start_train_engine(ctx, self.model, self.ft.total_train_steps, scheduler=self.rollout.scheduler)
        self.transport = build_weight_transport(ctx, self.engine, self.rollout)
        self.transport.setup()  # kept first: if setup fails, close() releases it after the servers
        self.stream = RecordStream(
            self.data.train, self.cfg.trainer.total_train_epochs, self.cfg.seed, self.cfg.dataset.shuffle, tag=True
        )
        if self.settings.log_samples:
            self.samples_file = open(os.path.join(self.run_dir, SAMPLES_FILE), "w", encoding="utf-8")

    def _completion(self, trajectory: Any) -> str:
        generated = [tok for tok, m in zip(trajectory.input_ids, trajectory.loss_mask) if m]
        return self.model.tokenizer.decode(generated, skip_special_tokens=True)

    def train(self) -> dict[str, Any]:
        hook = get_plugin_manager().hook
        total, batch_size = self.ft.total_train_steps, self.cfg.trainer.batch_size
        before = evaluate_held_out(self.context, self.rollout, self.data.held_out)
        self._log_eval(0, before)
        trained = 0
        for step in range(1, total + 1):
            self.rollout.check()  # a server lost for good stops the run here
            records = [r for r in (self.stream() for _ in range(batch_size)) if r is not None]
            groups = self.rollout.run_episodes(records)  # sampled and scored by the workflow
            samples = [t for g in groups if g is not None for t in g.trajectories]
            kept = [t for t in samples if t.reward >= self.min_reward]
            metrics: dict[str, Any] = {
                "rft/sampled": len(samples),
                "rft/kept": len(kept),
                "rft/kept_fraction": len(kept) / max(len(samples), 1),
                "reward/mean": sum(t.reward for t in samples) / max(len(samples), 1),
            }
            if kept:
                stats = self.engine.train_batch(TrajectoryBatch(kept), nll_loss)
                metrics["train/nll"] = stats["nll_sum"] / max(stats["nll_tokens"], 1.0)
                metrics["train/loss"] = stats.get("loss", math.nan)
                self.version += 1
                self.engine.set_version(self.version)
                metrics.update(self.transport.update(self.version))  # the servers sample from the new weights
                trained += len(kept)
            if self.samples_file is not None:
                for t in samples:
                    row = {"step": step, "reward": t.reward, "kept": t.reward >= self.min_reward,
                           "completion": self._completion(t)}  # fmt: skip
                    self.samples_file.write(json.dumps(row) + "\n")
                self.samples_file.flush()
            self.sinks.log(step, metrics)
            hook.areal_on_train_step(step=step, metrics=metrics)
        after = evaluate_held_out(self.context, self.rollout, self.data.held_out)
        self._log_eval(total, after)
        final = save_hf_checkpoint(self.engine, self.run_dir, "final", self.cfg.checkpoint.keep_last, total)
        print(f"rft: {total} steps, {trained} samples trained on (reward >= {self.min_reward:g})", flush=True)
        return {
            "steps": total,
            "trained_samples": trained,
            "min_reward": self.min_reward,
            "held_out_reward": [before["eval/reward"], after["eval/reward"]] if before["eval/n"] else None,
            "checkpoint": final,
        }

    def _log_eval(self, step: int, result: dict[str, Any]) -> None:
        if result["eval/n"]:  # trainer.eval_size=0: no held-out records, nothing to log
            self.sinks.log(step, {"eval/reward": result["eval/reward"], "eval/accuracy": result["eval/accuracy"]})

    def close(self, status: str) -> None:
        # Whatever setup() got to: engine first (its ranks may run under the
        # rollout's scheduler), then the servers, then the transport's files.
        if self.samples_file is not None:
            self.samples_file.close()
        if self.engine is not None:
            self.engine.destroy()
        if self.rollout is not None:
            self.rollout.stop()
        close_transport = getattr(self.transport, "close", None)
        if close_transport is not None:
            close_transport()
        self.sinks.close()
        get_plugin_manager().hook.areal_on_run_end(status=status, run_dir=self.run_dir)
