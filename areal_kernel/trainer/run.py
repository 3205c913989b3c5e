"""``areal train``: the single-controller loop.

dataset -> executor(workflow -> inference servers -> reward) -> batch ->
train engine -> weight transport -> inference servers, with generation
running ahead of training by at most ``rollout.max_staleness`` versions.
"""
from __future__ import annotations

import os
import random
import time
from typing import Any

import yaml

from areal_kernel.api.io import FinetuneSpec, TrajectoryBatch
from areal_kernel.config.models import ExperimentConfig
from areal_kernel.errors import ArealError
from areal_kernel.logging import get_logger, setup_logging
from areal_kernel.plugins import get_plugin_manager, get_registry
from areal_kernel.rollout.executor import RolloutExecutor, staleness_histogram, zero_variance
from areal_kernel.trainer.components import (
    Rollout,
    load_data,
    load_tokenizer,
    resolve_model_dir,
    workflow_required_fields,
)
from areal_kernel.trainer.evaluate import evaluate

log = get_logger(__name__)


class RecordStream:
    """Training records in a seeded order, epoch after epoch (``None`` at the end)."""

    def __init__(self, records: list[dict], epochs: int, seed: int, shuffle: bool) -> None:
        self.records = records
        self.epochs = epochs
        self.seed = seed
        self.shuffle = shuffle
        self.position = 0  # records handed out so far (for recovery and stats)
        self._it = self._iterate()

    def _iterate(self):
        for epoch in range(self.epochs):
            order = list(range(len(self.records)))
            if self.shuffle:
                random.Random(self.seed * 1000003 + epoch).shuffle(order)
            for i in order:
                yield self.records[i]

    def __call__(self) -> dict | None:
        rec = next(self._it, None)
        if rec is not None:
            self.position += 1
        return rec


def make_sinks(cfg: ExperimentConfig, run_dir: str, total_steps: int) -> list[Any]:
    """The metric sinks named in ``logging.sinks`` (shared by every trainer)."""
    sinks = []
    for name in cfg.logging.sinks:
        cls = get_registry().get("metric_sink", name).load()
        sinks.append(cls(run_dir, total_steps=total_steps) if name == "console" else cls(run_dir))
    return sinks


def write_run_config(cfg: ExperimentConfig, run_dir: str) -> None:
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.yaml"), "w", encoding="utf-8") as f:
        yaml.safe_dump(cfg.dump(), f, sort_keys=False)


def save_hf_checkpoint(engine: Any, run_dir: str, tag: str, keep_last: int, step: int) -> str:
    """``engine.save_hf`` into ``<run_dir>/checkpoints/<tag>``, keeping the
    newest ``keep_last`` ``step<N>`` directories; fires ``areal_on_checkpoint``."""
    import shutil

    root = os.path.join(run_dir, "checkpoints")
    path = os.path.join(root, tag)
    engine.save_hf(path)
    steps = sorted(
        (d for d in os.listdir(root) if d.startswith("step") and d[4:].isdigit()), key=lambda d: int(d[4:])
    )
    for old in steps[:-keep_last] if len(steps) > keep_last else []:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    get_plugin_manager().hook.areal_on_checkpoint(step=step, path=path)
    return path


def _grpo_config(cfg: ExperimentConfig) -> Any:
    """The RL step's options from ``algorithm`` (GRPO with the defaults)."""
    from areal_kernel.algo.rl import RLConfig

    a = cfg.algorithm
    return RLConfig(
        advantage=a.advantage,
        loss=a.loss,
        group_size=cfg.rollout.gconfig.n_samples,
        adv_norm=a.adv_norm,
        std_normalize=a.std_normalize,
        gamma=a.gamma,
        lam=a.lam,
        reward_scale=a.reward_scale,
        reward_bias=a.reward_bias,
        reward_clip=a.reward_clip,
        overlong_buffer_len=a.overlong_buffer_len,
        overlong_penalty_factor=a.overlong_penalty_factor,
        max_new_tokens=cfg.rollout.gconfig.max_new_tokens,
        advantage_kwargs=a.advantage_kwargs,
        eps_clip=a.eps_clip,
        eps_clip_high=a.eps_clip_high,
        dual_clip=a.dual_clip,
        ratio_level=a.ratio_level,
        behav_imp_weight_cap=a.behav_imp_weight_cap,
        behav_imp_weight_mode=a.behav_imp_weight_mode,
        kl_coef=a.kl_coef,
        kl_estimator=a.kl_estimator,
        kl_in=a.kl_in,
        entropy_coef=a.entropy_coef,
        loss_agg=a.loss_agg,
        loss_kwargs=a.loss_kwargs,
        recompute_proximal=a.recompute_proximal,
        prox_interpolate=a.prox_interpolate,
        ppo_n_minibatches=a.ppo_n_minibatches,
        value_eps_clip=a.value_eps_clip,
        temperature=cfg.rollout.gconfig.temperature,
    )


def _keep_group(rl_cfg: Any) -> Any:
    """Dynamic-sampling filter: drop a group whose *shaped* rewards are all
    equal (overlong shaping can separate equal raw rewards)."""
    from areal_kernel.algo.rl import shaped_rewards

    def keep(group: Any) -> bool:
        if rl_cfg.overlong_buffer_len is None:
            return not zero_variance(group)
        r = shaped_rewards(TrajectoryBatch(list(group.trajectories)), rl_cfg)
        return not (len(r) > 1 and max(r) - min(r) < 1e-9)

    return keep


def _batch_metrics(batch: TrajectoryBatch, version: int) -> dict[str, float]:
    rewards = [t.reward for t in batch.trajectories]
    gen = [t.n_generated for t in batch.trajectories]
    stale = [t.staleness(version) for t in batch.trajectories]
    return {
        "reward/mean": sum(rewards) / len(rewards),
        "reward/max": max(rewards),
        "rollout/gen_len_mean": sum(gen) / len(gen),
        "rollout/staleness_mean": sum(stale) / len(stale),
        "rollout/staleness_max": max(stale),
        "batch/sequences": len(batch),
        "batch/tokens": batch.n_tokens,
    }


class Trainer:
    def __init__(self, cfg: ExperimentConfig) -> None:
        self.cfg = cfg
        self.run_dir = cfg.resolved_run_dir()
        self.hook = get_plugin_manager().hook
        self.rollout: Rollout | None = None
        self.train_engine: Any = None
        self.ref_engine: Any = None  # frozen initial policy, only when algorithm.kl_coef > 0
        self.critic: Any = None  # value model, only for estimators that need values (gae)
        self.transport: Any = None
        self.executor: RolloutExecutor | None = None
        self.sinks: list[Any] = []
        self.version = 0

    # -- set-up ---------------------------------------------------------------
    def setup(self) -> None:
        cfg, reg = self.cfg, get_registry()
        write_run_config(cfg, self.run_dir)
        self.model_dir = resolve_model_dir(cfg)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.train_records, self.eval_records = load_data(cfg, workflow_required_fields(cfg))
        self.ft = FinetuneSpec(
            total_train_epochs=cfg.trainer.total_train_epochs,
            dataset_size=len(self.train_records),
            train_batch_size=cfg.trainer.batch_size,
            max_steps=cfg.trainer.max_steps,
        )
        self.sinks = make_sinks(cfg, self.run_dir, self.ft.total_train_steps)
        self.hook.areal_on_run_start(config=cfg, run_dir=self.run_dir)
        log.info("starting inference servers", backend=str(cfg.rollout.allocation), model=self.model_dir)
        self.rollout = Rollout(cfg, self.run_dir, self.model_dir, self.tokenizer).start()
        log.info("inference servers ready", addresses=self.rollout.addresses)
        engine_spec = reg.get("train_engine", cfg.actor.allocation.backend)
        engine_cfg = cfg.actor.plugin_config
        if engine_cfg is not None and hasattr(engine_cfg, "temperature"):
            # Logprob ratios must compare the distribution the sampler used.
            engine_cfg = engine_cfg.model_copy(update={"temperature": cfg.rollout.gconfig.temperature})
        self.rl_cfg = _grpo_config(cfg)
        self.estimator = reg.get("advantage_estimator", cfg.algorithm.advantage, platform="").load()
        self.loss = reg.get("loss", cfg.algorithm.loss, platform="").load()
        # Each batch takes ppo_n_minibatches optimizer steps: the lr schedule counts them all.
        opt_steps = self.ft.total_train_steps * cfg.algorithm.ppo_n_minibatches
        self.train_engine = engine_spec.load()(engine_cfg)
        self.train_engine.initialize(self.model_dir, opt_steps)
        if getattr(self.estimator, "needs_values", False):
            self.critic = self._make_critic(engine_cfg, opt_steps)
        if cfg.algorithm.kl_coef > 0:
            # A frozen copy of the initial policy, only ever used for scoring.
            self.ref_engine = engine_spec.load()(engine_cfg)
            self.ref_engine.initialize(self.model_dir, self.ft.total_train_steps)
        transport_name = self.hook.areal_select_weight_transport(
            train_backend=cfg.actor.allocation.backend,
            inference_backend=cfg.rollout.allocation.backend,
            platform=self.rollout.scheduler.platform.name,
            mode=cfg.weight_update.mode,
        )
        self.transport = reg.get("weight_transport", transport_name).load()(
            self.train_engine, self.rollout.engine, self.run_dir, cfg.weight_update.bucket_mb << 20
        )
        self.transport.setup()
        log.info("weight transport ready", transport=transport_name)
        self.stream = RecordStream(self.train_records, cfg.trainer.total_train_epochs, cfg.seed, cfg.dataset.shuffle)
        a = cfg.algorithm
        self.executor = RolloutExecutor(
            self.rollout.engine,
            self.rollout.workflow,
            self.stream,
            batch_size=cfg.trainer.batch_size,
            max_staleness=cfg.rollout.max_staleness,
            max_concurrent=cfg.rollout.max_concurrent_rollouts,
            keep=_keep_group(self.rl_cfg) if a.dynamic_filter else None,
            retry_budget=a.filter_retry_budget,
        )

    def _make_critic(self, engine_cfg: Any, opt_steps: int) -> Any:
        """A value model (same initial weights as the actor) for critic-based estimators."""
        from areal_kernel.engine.critic import TorchCriticEngine
        from areal_kernel.engine.config import TorchEngineConfig

        if not isinstance(engine_cfg, TorchEngineConfig) and engine_cfg is not None:
            raise ArealError(
                f"algorithm.advantage={self.cfg.algorithm.advantage!r} needs a critic, which is only built on the "
                f"torch train engine settings (actor.backend is {self.cfg.actor.allocation.backend!r})"
            )
        ccfg = TorchEngineConfig.parse(engine_cfg)
        if self.cfg.algorithm.critic_lr is not None:
            ccfg = ccfg.model_copy(update={"lr": self.cfg.algorithm.critic_lr})
        critic = TorchCriticEngine(ccfg)
        critic.initialize(self.model_dir, opt_steps)
        return critic

    # -- pieces -----------------------------------------------------------------
    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def evaluate(self) -> dict[str, Any]:
        assert self.rollout is not None
        return evaluate(
            self.rollout.workflow, self.rollout.engine, self.eval_records, self.cfg.rollout.gconfig.max_new_tokens
        )

    def _check_reward_health(self) -> None:
        wf = self.rollout.workflow
        if wf.reward_calls >= 20 and wf.reward_failures / wf.reward_calls > self.cfg.reward.max_failure_fraction:
            raise ArealError(
                f"{wf.reward_failures} of {wf.reward_calls} reward calls failed (more than "
                f"reward.max_failure_fraction={self.cfg.reward.max_failure_fraction}); see the log for causes"
            )

    # -- the loop ---------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        from areal_kernel.algo.rl import rl_train_step

        cfg = self.cfg
        before = self.evaluate()
        print(f"held-out greedy accuracy before training: {before['eval/accuracy']:.3f} (n={before['eval/n']})", flush=True)
        self.log_metrics(0, {"eval/accuracy": before["eval/accuracy"]})
        total = self.ft.total_train_steps
        self.executor.start()
        t_run = time.monotonic()
        trained_samples = 0
        last_eval = before
        for step in range(1, total + 1):
            t0 = time.monotonic()
            groups = self.executor.get_batch(cfg.trainer.batch_size)
            t_wait = time.monotonic() - t0
            batch = TrajectoryBatch.from_groups(groups)
            metrics = _batch_metrics(batch, self.version)
            hist = staleness_histogram(groups, self.version)
            self.hook.areal_on_rollout_batch(step=step, stats={**metrics, "staleness_hist": hist})
            t1 = time.monotonic()
            ref = self.ref_engine.compute_logprobs(batch, only_loss_tokens=True) if self.ref_engine else None
            train_stats = rl_train_step(
                batch, self.train_engine, self.rl_cfg, ref_logprobs=ref, critic=self.critic,
                estimator=self.estimator, loss=self.loss,
            )  # fmt: skip
            t2 = time.monotonic()
            new_version = self.version + 1
            upd = self.transport.update(new_version)
            self.version = new_version
            self.train_engine.set_version(new_version)  # token versions are compared with it (prox_interpolate)
            self.executor.set_version(new_version)
            self.hook.areal_on_weight_update(version=new_version, transport=self.transport.name, seconds=time.monotonic() - t2)
            trained_samples += len(batch)
            step_s = time.monotonic() - t0
            metrics.update({f"train/{k}": v for k, v in train_stats.items() if isinstance(v, (int, float))})
            metrics.update(upd)
            metrics.update(self.executor.stats.snapshot_and_reset())
            metrics.update({
                "perf/step_s": step_s,
                "perf/wait_rollout_s": t_wait,
                "perf/train_s": t2 - t1,
                "perf/train_tokens_per_s": batch.n_tokens / max(t2 - t1, 1e-9),
                "perf/samples_per_s": trained_samples / (time.monotonic() - t_run),
                "version": new_version,
            })
            if cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0 and step < total:
                last_eval = self.evaluate()
                metrics["eval/accuracy"] = last_eval["eval/accuracy"]
            self.log_metrics(step, metrics)
            self.hook.areal_on_train_step(step=step, metrics=metrics)
            self._check_reward_health()
            if cfg.checkpoint.save_hf_every and step % cfg.checkpoint.save_hf_every == 0 and step < total:
                self.save_hf(f"step{step}")
        self.executor.stop()
        after = self.evaluate()
        self.log_metrics(total, {"eval/accuracy": after["eval/accuracy"]})
        final = self.save_hf("final")
        elapsed = time.monotonic() - t_run
        print(
            f"held-out greedy accuracy: before {before['eval/accuracy']:.3f} -> after {after['eval/accuracy']:.3f} "
            f"(n={after['eval/n']}, {total} steps, {trained_samples} samples, {elapsed:.0f}s training)",
            flush=True,
        )
        print(f"final HF checkpoint: {final}", flush=True)
        return {"before": before["eval/accuracy"], "after": after["eval/accuracy"], "steps": total,
                "train_seconds": elapsed, "samples": trained_samples, "checkpoint": final}

    def save_hf(self, tag: str) -> str:
        return save_hf_checkpoint(self.train_engine, self.run_dir, tag, self.cfg.checkpoint.keep_last, self.version)

    def close(self, status: str) -> None:
        if self.executor is not None:
            self.executor.stop()
        if self.rollout is not None:
            self.rollout.stop()
        for engine in (self.train_engine, self.ref_engine, self.critic):
            if engine is not None:
                engine.destroy()
        for sink in self.sinks:
            sink.close()
        self.hook.areal_on_run_end(status=status, run_dir=self.run_dir)


def _raise_on_sigterm() -> None:
    """Turn SIGTERM into an exception so servers and workers are stopped."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def run_training(cfg: ExperimentConfig) -> int:
    from areal_kernel.config.offline import OFFLINE_ALGORITHMS

    if cfg.algorithm.type in OFFLINE_ALGORITHMS:
        # SFT / DPO / IPO / RM: no inference server, see trainer/offline.py.
        from areal_kernel.trainer.offline import run_offline_training

        return run_offline_training(cfg)
    return run_trainer(Trainer, cfg)


def run_trainer(trainer_cls: Any, cfg: ExperimentConfig) -> int:
    """Set up logging and SIGTERM handling, run ``trainer_cls(cfg)`` (setup,
    train, ``result.json``) and always close it with the final status. Shared
    by the RL loop and the offline trainers."""
    import json

    setup_logging(level=cfg.logging.level, json_logs=cfg.logging.json_logs)
    _raise_on_sigterm()
    trainer = trainer_cls(cfg)
    status = "failed"
    try:
        trainer.setup()
        result = trainer.train()
        status = "completed"
        with open(os.path.join(trainer.run_dir, "result.json"), "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        return 0
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        trainer.close(status)


