"""The asynchronous RL trainer (``algorithm.type: grpo``): the single-controller loop.

dataset -> executor(workflow -> inference servers -> reward) -> batch ->
train engine -> weight transport -> inference servers, with generation
running ahead of training by at most ``rollout.max_staleness`` versions.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, NoReturn

from areal_kernel.api.advantage_estimator import AdvantageEstimator, AdvantageEstimatorContext
from areal_kernel.api.engine import TrainEngine
from areal_kernel.api.loss import LossContext, PolicyLoss
from areal_kernel.api.weight_transport import WeightTransportProtocol
from areal_kernel.api.io import TrajectoryBatch
from areal_kernel.api.trainer import Trainer, TrainerContext
from areal_kernel.config.models import ExperimentConfig
from areal_kernel.errors import ArealError, ConfigError
from areal_kernel.logging import get_logger
from areal_kernel.monitor.mismatch import MismatchMonitor
from areal_kernel.monitor.weights import WeightsMonitor
from areal_kernel.plugins import get_plugin_manager, get_registry
from areal_kernel.rollout.executor import RolloutExecutor, staleness_histogram, zero_variance
from areal_kernel.trainer.common import (
    INTERRUPT,
    SETUP_FIRST,
    RecordStream,
    save_hf_checkpoint,
    write_run_config,
)
from areal_kernel.trainer.components import log_model_precision
from areal_kernel.trainer.toolkit import (
    MetricSinks,
    Rollout,
    build_weight_transport,
    evaluate_held_out,
    finetune_spec,
    load_datasets,
    open_metric_sinks,
    resolve_model,
    start_rollout,
    start_train_engine,
)
from areal_kernel.trainer.recovery import (
    SAMPLES_FILE,
    STATE_FILE,
    STATE_FORMAT,
    Checkpoint,
    SamplesLog,
    hold_after_step,
    hold_step_from_env,
    pause_after_step,
    pause_steps_from_env,
    plan_start,
    provenance,
    recovery_manager,
    set_aside_logs,
    truncate_jsonl,
)

log = get_logger(__name__)


def needs_critic(cfg: ExperimentConfig) -> bool:
    """Whether the run trains a critic: the advantage estimator declares
    ``needs_values``. Then the actor's train engine must declare ``critic``
    (the kernel builds the value model from that engine's settings), else one
    error names the capability."""
    reg = get_registry()
    est = reg.get("advantage_estimator", cfg.algorithm.advantage, platform="")
    if "needs_values" not in est.capabilities:
        return False
    backend = cfg.actor.allocation.backend
    engine = reg.get("train_engine", backend)
    if "critic" not in engine.capabilities:
        with_critic = sorted(s.name for s in reg.specs("train_engine") if "critic" in s.capabilities)
        raise ConfigError(
            f"algorithm.advantage={cfg.algorithm.advantage!r} needs a critic (the estimator declares "
            f"'needs_values'), but actor.backend {backend!r} does not declare the 'critic' capability; "
            f"train engines that do: {with_critic or 'none installed'}"
        )
    return True


def make_critic(cfg: ExperimentConfig, engine_cfg: Any, model_dir: str, opt_steps: int) -> Any:
    """A value model (the actor's initial weights, with a scalar head) for a
    critic-based estimator, trained by the actor engine's settings
    ``engine_cfg`` (its lr ``algorithm.critic_lr`` when set) over
    ``opt_steps`` optimizer steps. Its parameters are all its own (an
    adapter on the actor counts for nothing here). Call ``needs_critic``
    first: it checks the actor engine declares ``critic``, whose settings
    section is one ``TorchEngineConfig`` accepts."""
    from areal_kernel.engine.config import TorchEngineConfig
    from areal_kernel.engine.critic import TorchCriticEngine

    ccfg = TorchEngineConfig.parse(engine_cfg)
    if cfg.algorithm.critic_lr is not None:
        ccfg = ccfg.model_copy(update={"lr": cfg.algorithm.critic_lr})
    critic = TorchCriticEngine(ccfg)
    critic.initialize(model_dir, opt_steps)
    return critic


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


class RLTrainer(Trainer):
    """``algorithm.type: grpo``: rollout on inference servers and training at
    the same time (every RL algorithm of docs/algorithms.md is a choice of
    ``algorithm.advantage`` / ``algorithm.loss`` and knobs under it)."""

    def __init__(self, context: TrainerContext) -> None:
        super().__init__(context)
        cfg = self.cfg
        self.hook = get_plugin_manager().hook
        self.rollout: Rollout | None = None
        self.train_engine: TrainEngine | None = None
        self.ref_engine: TrainEngine | None = None  # frozen initial policy, only when algorithm.kl_coef > 0
        self.critic: Any = None  # value model, only for estimators that need values (gae)
        self.transport: WeightTransportProtocol | None = None
        self.executor: RolloutExecutor | None = None
        self.sinks = MetricSinks([])
        self.samples_log: SamplesLog | None = None
        self.version = 0
        self.step = 0  # last completed step
        self.trained_samples = 0
        self.before_eval: dict[str, Any] | None = None
        self.resume_from: Checkpoint | None = None  # the checkpoint being resumed, if any
        self.recovery = recovery_manager(self.run_dir, cfg.checkpoint.keep_last)
        self.skipped_streak = 0
        self.reward_seen = (0, 0)  # (calls, failures) already reported
        self.fleet: Any = None  # the rollout's Fleet once the transport exists
        self.fleet_control: Any = None  # the run's `areal fleet` route

    # -- set-up ---------------------------------------------------------------
    def setup(self) -> None:
        cfg, reg = self.cfg, get_registry()
        # Everything that can fail on user input comes before anything is
        # written into run_dir (an earlier run's files stay as they were).
        # The parts come from the trainer toolkit (areal_kernel.trainer.toolkit),
        # which plugin trainers use too.
        ctx = self.context
        if getattr(cfg.actor.plugin_config, "adapters", None):
            # Several policies are declared under policies: (their data, reward
            # and knobs); the engine's adapters list is built from them.
            raise ConfigError(
                f"{cfg.actor.where}.{cfg.actor.selected_name}.adapters: declare several policies under policies: "
                f"{{<name>: {{lora: {{...}}, dataset: ..., reward: ...}}}} (docs/multi-policy.md); for one adapter "
                f"use {cfg.actor.where}.{cfg.actor.selected_name}.lora"
            )
        self.needs_critic = needs_critic(cfg)
        self.model = resolve_model(ctx)
        self.model_dir, self.tokenizer = self.model.path, self.model.tokenizer
        data = load_datasets(ctx)
        self.train_records, self.eval_records = data.train, data.held_out
        plan = plan_start(cfg, self.run_dir)
        # Whether it resumes (and from where) or starts over (and why), and
        # what happened to the earlier run's logs: said on every start.
        if plan.checkpoint is not None:
            self.resume_from = plan.checkpoint
            # Steps after the checkpoint are redone: their log lines go.
            k = self.resume_from.step
            dropped = {
                name: truncate_jsonl(os.path.join(self.run_dir, name), k) for name in ("metrics.jsonl", SAMPLES_FILE)
            }
            log.info("resuming from a recovery checkpoint", path=self.resume_from.path, step=k)
            note = (
                f"; lines of the {dropped[SAMPLES_FILE]} later step(s), which are redone now, "
                "dropped from metrics.jsonl and samples.jsonl"
                if any(dropped.values())
                else "; metrics.jsonl continues"
            )
            print(plan.reason + note, flush=True)
        else:
            # A new run: an earlier run's logs would mix with ours.
            moved = set_aside_logs(self.run_dir, ("metrics.jsonl", SAMPLES_FILE, "result.json"))
            note = f"; metrics of the earlier run kept in {', '.join(n + '.prev' for n in moved)}" if moved else ""
            print(f"starting at step 0: {plan.reason}{note}", flush=True)
        write_run_config(cfg, self.run_dir)
        log_model_precision(cfg, self.model_dir)
        self.ft = finetune_spec(ctx, len(self.train_records))
        self.sinks = open_metric_sinks(ctx, self.ft.total_train_steps)
        self.hook.areal_on_run_start(config=cfg, run_dir=self.run_dir)
        log.info("starting inference servers", backend=str(cfg.rollout.allocation), model=self.model_dir)
        self.rollout = start_rollout(ctx, self.model, recovery_hint=self._latest_checkpoint_path)
        log.info("inference servers ready", addresses=self.rollout.addresses)
        engine_cfg = cfg.actor.plugin_config
        if engine_cfg is not None and hasattr(engine_cfg, "temperature"):
            # Logprob ratios must compare the distribution the sampler used.
            engine_cfg = engine_cfg.model_copy(update={"temperature": cfg.rollout.gconfig.temperature})
        from areal_kernel.algo.rl import RLConfig

        self.rl_cfg = RLConfig.from_config(cfg)
        mm = cfg.monitor.mismatch
        self.mismatch = MismatchMonitor(bound=mm.bound, patience=mm.patience, action=mm.action)
        wm = cfg.monitor.weights
        self.weights_monitor = WeightsMonitor(
            action=wm.action,
            tensors_per_update=wm.tensors_per_update,
            elements_per_tensor=wm.elements_per_tensor,
            seed=cfg.seed,
            warn=lambda msg: print(msg, flush=True),
        )
        a = cfg.algorithm
        self.estimator: AdvantageEstimator = reg.build(
            "advantage_estimator",
            a.advantage,
            AdvantageEstimatorContext(a.advantage, a.advantage_settings),
            platform="",
        )
        self.loss: PolicyLoss = reg.build("loss", a.loss, LossContext(a.loss, a.loss_settings), platform="")
        # Each batch takes ppo_n_minibatches optimizer steps: the lr schedule counts them all.
        opt_steps = self.ft.total_train_steps * cfg.algorithm.ppo_n_minibatches
        sched = self.rollout.scheduler
        self.train_engine = start_train_engine(ctx, self.model, opt_steps, settings=engine_cfg, scheduler=sched)
        if self.needs_critic:
            self.critic = make_critic(self.cfg, engine_cfg, self.model_dir, opt_steps)
        if cfg.algorithm.kl_coef > 0:
            # A frozen copy of the initial policy, only ever used for scoring.
            self.ref_engine = start_train_engine(
                ctx, self.model, self.ft.total_train_steps, settings=engine_cfg, scheduler=sched, role="ref"
            )
        self.transport = transport = build_weight_transport(ctx, self.train_engine, self.rollout)
        transport.setup()
        log.info("weight transport ready", transport=transport.name)
        adapter = self.train_engine.adapter_spec()
        if adapter is not None:
            # Requests name the adapter this run trains; the servers serve it
            # beside the base weights from the first update on.
            self.rollout.engine.default_adapter = adapter.name
            if plan.checkpoint is None:
                # Version 0 of the adapter (peft starts it as a no-op): the servers must know its name.
                self.transport.update(self.version)
                self._check_weights(self.version, now=True)
            log.info("training a LoRA adapter", adapter=adapter.name, rank=adapter.config.get("r"))
        self.stream = RecordStream(
            self.train_records, cfg.trainer.total_train_epochs, cfg.seed, cfg.dataset.shuffle, tag=True
        )
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
        if plan.checkpoint is not None:
            assert plan.state is not None
            self._restore(plan.checkpoint, plan.state)
        self.samples_log = SamplesLog(self.run_dir)
        self._open_fleet()

    def _open_fleet(self) -> None:
        """Servers may join and leave from now on (``areal fleet``,
        ``rollout.elastic``): the fleet gets the transport that brings a
        newcomer to the current weights and the check run after it."""
        assert self.rollout is not None and self.transport is not None, SETUP_FIRST
        self.fleet = self.rollout.fleet
        if self.fleet is None:
            return
        self.fleet.attach(self.transport, lambda: self.version, lambda v: self._check_weights(v, now=True))
        from areal_kernel.inference.fleet_control import FleetControl

        self.fleet_control = FleetControl(self.fleet, self.run_dir)
        log.info("fleet control ready", url=self.fleet_control.url, token_file=self.fleet_control.path)

    # -- recovery ---------------------------------------------------------------
    def _restore(self, ckpt: Checkpoint, state: dict[str, Any]) -> None:
        """Load a recovery checkpoint into the freshly built parts."""
        assert self.train_engine is not None and self.rollout is not None and self.executor is not None, SETUP_FIRST
        assert self.transport is not None, SETUP_FIRST
        self.train_engine.load_state(os.path.join(ckpt.path, "engine"))
        if self.critic is not None:
            self.critic.load_state(os.path.join(ckpt.path, "critic"))
        self.step = int(state["step"])
        self.version = int(state["version"])
        self.trained_samples = int(state["trained_samples"])
        self.before_eval = state["before_eval"]
        self.skipped_streak = int(state.get("skipped_streak", 0))
        wf = self.rollout.workflow
        wf.reward_calls, wf.reward_failures = state.get("reward_counts", [0, 0])
        self.reward_seen = (wf.reward_calls, wf.reward_failures)
        self.stream.skip_to(int(state["stream_position"]))
        self.executor.load_state_dict(state["executor"])
        self.executor.set_version(self.version)
        self.train_engine.set_version(self.version)
        # The servers started from the base model: give them the checkpoint's weights.
        self.transport.update(self.version)
        self._check_weights(self.version, now=True)

    def save_recovery(self) -> str:
        """A recovery checkpoint of the state after ``self.step`` (see trainer/recovery.py)."""
        assert self.train_engine is not None and self.rollout is not None and self.executor is not None, SETUP_FIRST
        engine: TrainEngine = self.train_engine
        executor = self.executor
        t0 = time.monotonic()
        executor.drain()
        wf = self.rollout.workflow
        state = {
            "format": STATE_FORMAT,
            "step": self.step,
            "version": self.version,
            "trained_samples": self.trained_samples,
            "stream_position": self.stream.position,
            "executor": executor.state_dict(),
            "before_eval": self.before_eval,
            "skipped_streak": self.skipped_streak,
            "reward_counts": [wf.reward_calls, wf.reward_failures],
            "config": self.cfg.dump(),
        }

        def write(path: str) -> None:
            engine.save_state(os.path.join(path, "engine"))
            if self.critic is not None:
                self.critic.save_state(os.path.join(path, "critic"))
            with open(os.path.join(path, STATE_FILE), "w", encoding="utf-8") as f:
                json.dump(state, f)

        try:
            ckpt = self.recovery.save(self.step, write)
        finally:
            executor.resume()
        self.hook.areal_on_checkpoint(step=self.step, path=ckpt.path)
        log.info("recovery checkpoint written", path=ckpt.path, seconds=round(time.monotonic() - t0, 2))
        return ckpt.path

    # -- pieces -----------------------------------------------------------------
    def _check_weights(self, version: int, now: bool = False) -> dict[str, float]:
        """The weight-delivery check of update ``version`` (``monitor.weights``);
        its metrics under ``monitor/``. ``now``: an update outside a step
        (resume, an adapter's version 0) raises at once on ``error``; a step's
        raises after the step's metrics are logged."""
        assert self.train_engine is not None and self.rollout is not None, SETUP_FIRST
        out = self.weights_monitor.check(version, self.train_engine, self.rollout.engine)
        if now:
            self.weights_monitor.raise_if_alarmed()
        return {f"monitor/{k}": v for k, v in out.items()}

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        self.sinks.log(step, metrics)

    def evaluate(self) -> dict[str, Any]:
        assert self.rollout is not None, SETUP_FIRST
        return evaluate_held_out(self.context, self.rollout, self.eval_records)

    @staticmethod
    def _eval_metrics(result: dict[str, Any]) -> dict[str, float]:
        # Older recovery checkpoints hold no eval/reward.
        return {k: result[k] for k in ("eval/accuracy", "eval/reward") if k in result}

    def _check_reward_health(self) -> None:
        assert self.rollout is not None, SETUP_FIRST
        wf = self.rollout.workflow
        if wf.reward_calls >= 20 and wf.reward_failures / wf.reward_calls > self.cfg.reward.max_failure_fraction:
            raise ArealError(
                f"{wf.reward_failures} of {wf.reward_calls} reward calls failed (more than "
                f"reward.max_failure_fraction={self.cfg.reward.max_failure_fraction}); last failure: "
                f"{getattr(wf, 'last_reward_error', None)}"
            )

    # -- the loop ---------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        assert self.train_engine is not None and self.rollout is not None, SETUP_FIRST
        assert self.executor is not None and self.samples_log is not None, SETUP_FIRST
        assert self.transport is not None, SETUP_FIRST
        eval_on = bool(self.eval_records)
        if self.before_eval is None:
            self.before_eval = self.evaluate()
            if eval_on:
                self.log_metrics(0, self._eval_metrics(self.before_eval))
        before = self.before_eval
        if eval_on:
            print(
                f"held-out greedy accuracy before training: {before['eval/accuracy']:.3f} (n={before['eval/n']})",
                flush=True,
            )
        else:
            print("held-out evaluation is off (trainer.eval_size=0 or no held-out records)", flush=True)
        total = self.ft.total_train_steps
        self.executor.start()
        t_run = time.monotonic()
        with INTERRUPT.armed():
            self._train_steps(total, eval_on, t_run)
            if INTERRUPT.requested.is_set():  # during the last step: the user still asked to stop
                self._stop_for_interrupt()
        self.executor.stop()
        after = self.evaluate()
        if eval_on:
            self.log_metrics(total, self._eval_metrics(after))
        final = self.save_hf("final")
        elapsed = time.monotonic() - t_run
        run = f"{total} steps, {self.trained_samples} samples, {elapsed:.0f}s training"
        if eval_on:
            print(
                f"held-out greedy accuracy: before {before['eval/accuracy']:.3f} -> after {after['eval/accuracy']:.3f} "
                f"(n={after['eval/n']}; mean reward {before.get('eval/reward', float('nan')):.3f} -> "
                f"{after['eval/reward']:.3f}; {run})",
                flush=True,
            )
        else:
            print(f"training done, held-out evaluation was off ({run})", flush=True)
        print(f"final HF checkpoint: {final}", flush=True)
        return {
            "before": before["eval/accuracy"],
            "after": after["eval/accuracy"],
            "reward_before": before.get("eval/reward"),
            "reward_after": after.get("eval/reward"),
            "steps": total,
            "train_seconds": elapsed,
            "samples": self.trained_samples,
            "checkpoint": final,
            "resumed_from_step": self.resume_from.step if self.resume_from is not None else None,
        }

    def _train_steps(self, total: int, eval_on: bool, t_run: float) -> None:
        """Steps ``self.step + 1 .. total``; an interrupt stops at a step boundary."""
        from areal_kernel.algo.rl import rl_train_step

        assert self.train_engine is not None and self.rollout is not None, SETUP_FIRST
        hold_at = hold_step_from_env()  # a testing aid; None unless asked for
        pause_at = pause_steps_from_env()  # a testing aid; empty unless asked for
        assert self.executor is not None and self.samples_log is not None, SETUP_FIRST
        assert self.transport is not None, SETUP_FIRST
        cfg = self.cfg
        samples_here = 0
        for step in range(self.step + 1, total + 1):
            if INTERRUPT.requested.is_set():
                self._stop_for_interrupt()
            self.rollout.check()  # a server that could not be restarted stops the run here
            t0 = time.monotonic()
            tick = self.fleet.tick if self.fleet is not None else None
            if tick is not None:
                tick()  # joins, newcomers' weights, finished drains: between weight updates
            groups = self.executor.get_batch(cfg.trainer.batch_size, stop=INTERRUPT.requested, on_wait=tick)
            if not groups:  # interrupted while waiting for rollouts: the state after self.step is intact
                self._stop_for_interrupt()
            t_wait = time.monotonic() - t0
            batch = TrajectoryBatch.from_groups(groups)
            metrics = _batch_metrics(batch, self.version)
            hist = staleness_histogram(groups, self.version)
            self.hook.areal_on_rollout_batch(step=step, stats={**metrics, "staleness_hist": hist})
            t1 = time.monotonic()
            ref = self.ref_engine.compute_logprobs(batch, only_loss_tokens=True) if self.ref_engine else None
            train_stats = rl_train_step(
                batch, self.train_engine, self.rl_cfg, ref_logprobs=ref, critic=self.critic,
                estimator=self.estimator, loss=self.loss, mismatch_threshold=cfg.monitor.mismatch.token_threshold,
            )  # fmt: skip
            t2 = time.monotonic()
            new_version = self.version + 1
            upd = self.transport.update(new_version)
            self.version = new_version
            self.train_engine.set_version(new_version)  # token versions are compared with it (prox_interpolate)
            self.executor.set_version(new_version)
            self.hook.areal_on_weight_update(
                version=new_version, transport=self.transport.name, seconds=time.monotonic() - t2
            )
            delivery = self._check_weights(new_version)
            self.step = step
            self.trained_samples += len(batch)
            samples_here += len(batch)
            self.samples_log.log(step, new_version, [g.sample_uid for g in groups], provenance(groups))
            step_s = time.monotonic() - t0
            metrics.update({f"train/{k}": v for k, v in train_stats.items() if isinstance(v, (int, float))})
            mismatch = train_stats.get("mismatch") or {}
            metrics.update({f"mismatch/{k}": v for k, v in mismatch.items()})
            metrics.update({f"monitor/{k}": v for k, v in self.mismatch.observe(step, mismatch).items()})
            # The whole distribution, not only its mean and max (the report plots it).
            metrics.update({f"rollout/staleness_hist/{k}": float(n) for k, n in hist.items()})
            metrics.update(upd)
            metrics.update(delivery)
            metrics.update(self.executor.stats.snapshot_and_reset())
            metrics.update(self.rollout.server_stats())
            metrics.update(self._reward_metrics())
            metrics.update(
                {
                    "perf/step_s": step_s,
                    "perf/wait_rollout_s": t_wait,
                    "perf/train_s": t2 - t1,
                    "perf/train_tokens_per_s": batch.n_tokens / max(t2 - t1, 1e-9),
                    "perf/samples_per_s": samples_here / (time.monotonic() - t_run),
                    "version": new_version,
                }
            )
            if eval_on and cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0 and step < total:
                metrics.update(self._eval_metrics(self.evaluate()))
            self.log_metrics(step, metrics)
            self.hook.areal_on_train_step(step=step, metrics=metrics)
            if self.fleet is not None:
                self.fleet.observe_step(step, t_wait, step_s, int(metrics.get("rollout/stale_dropped", 0)))
            if step == hold_at:
                hold_after_step(self.run_dir, step)
            if step in pause_at:
                pause_after_step(self.run_dir, step, tick)
            self._check_reward_health()
            self.weights_monitor.raise_if_alarmed()
            self.mismatch.raise_if_alarmed()
            self._check_skipped(train_stats)
            if cfg.checkpoint.save_hf_every and step % cfg.checkpoint.save_hf_every == 0 and step < total:
                self.save_hf(f"step{step}")
            # Not during a NaN streak: the newest checkpoints must stay ones taken
            # after a step that trained (keep_last would otherwise prune them).
            if (
                cfg.checkpoint.save_every
                and step % cfg.checkpoint.save_every == 0
                and step < total
                and not self.skipped_streak
            ):
                self.save_recovery()

    def _stop_for_interrupt(self) -> NoReturn:
        """The first SIGINT/SIGTERM, at a step boundary: write a recovery
        checkpoint of the state after ``self.step`` (the same one a periodic
        checkpoint at that step holds: running rollouts finish first, the
        finished ones are saved), say how to resume, and stop the run."""
        k, cfg = self.step, self.cfg.checkpoint
        latest = self.recovery.latest()
        where = f"resume from step {latest.step}" if latest is not None else "start over"
        if latest is not None and latest.step == k:
            print(
                f"interrupted at step {k}: its recovery checkpoint is written; run the same command to {where}",
                flush=True,
            )
            raise KeyboardInterrupt(INTERRUPT.signal_name)
        if k == 0:
            print("interrupted before step 1 finished: nothing to save; the same command starts over", flush=True)
            raise KeyboardInterrupt(INTERRUPT.signal_name)
        if not cfg.on_interrupt:
            print(
                f"interrupted at step {k}: no recovery checkpoint written (checkpoint.on_interrupt=false); "
                f"the same command will {where}",
                flush=True,
            )
            raise KeyboardInterrupt(INTERRUPT.signal_name)
        limit = cfg.interrupt_timeout_s
        print(
            f"interrupted at step {k}: writing a recovery checkpoint (at most {limit:g} s: running rollouts finish, "
            "then the model and optimizer are written)...",
            flush=True,
        )
        watchdog = threading.Timer(limit, INTERRUPT.expire)
        watchdog.daemon = True
        try:
            # Started inside the try: with a short limit the watchdog's
            # interrupt could otherwise land before the handler is in place.
            watchdog.start()
            path = self.save_recovery()
        except KeyboardInterrupt:
            why = f"not finished within {limit:g} s" if INTERRUPT.expired else "a second interrupt"
            print(
                f"recovery checkpoint of step {k} abandoned ({why}); its partial files are discarded, earlier checkpoints "
                f"are intact; "
                f"the same command will {where}",
                flush=True,
            )
            raise
        finally:
            watchdog.cancel()
        print(f"saved {path}; run the same command to resume from step {k}", flush=True)
        raise KeyboardInterrupt(INTERRUPT.signal_name)

    def _reward_metrics(self) -> dict[str, float]:
        assert self.rollout is not None, SETUP_FIRST
        wf = self.rollout.workflow
        calls, failures = getattr(wf, "reward_calls", 0), getattr(wf, "reward_failures", 0)
        seen_calls, seen_failures = self.reward_seen
        self.reward_seen = (calls, failures)
        return {
            "reward/calls": calls - seen_calls,
            "reward/failures": failures - seen_failures,
            "reward/failures_total": failures,
        }

    def _latest_checkpoint_path(self) -> str | None:
        latest = self.recovery.latest()
        return latest.path if latest else None

    def _check_skipped(self, train_stats: dict[str, Any]) -> None:
        """A step skipped for NaN/inf is reported; too many in a row stop the run."""
        if not train_stats.get("skipped"):
            self.skipped_streak = 0
            return
        self.skipped_streak += 1
        log.warning("training step skipped: non-finite loss or gradients", step=self.step, streak=self.skipped_streak)
        limit = self.cfg.trainer.max_skipped_steps
        if self.skipped_streak > limit:
            last = self.recovery.latest()
            raise ArealError(
                f"{self.skipped_streak} consecutive training steps had non-finite loss or gradients "
                f"(trainer.max_skipped_steps={limit}); the run stopped. "
                f"Last good checkpoint: {last.path if last else 'none'}"
            )

    def save_hf(self, tag: str) -> str:
        assert self.train_engine is not None, SETUP_FIRST
        return save_hf_checkpoint(self.train_engine, self.run_dir, tag, self.cfg.checkpoint.keep_last, self.version)

    def close(self, status: str) -> None:
        if self.fleet_control is not None:
            self.fleet_control.close()  # no fleet change while the run ends
        if self.executor is not None:
            self.executor.stop()
        # Engines before the rollout: an engine may have started its ranks
        # through the run's scheduler, which rollout.stop() stops (killing
        # whatever is left); destroyed first, the ranks shut down cleanly.
        for engine in (self.train_engine, self.ref_engine, self.critic):
            if engine is not None:
                engine.destroy()
        if self.rollout is not None:
            self.rollout.stop()
        # After the servers: they may read the transport's files until stopped.
        if self.transport is not None:
            close_transport = getattr(self.transport, "close", None)
            try:
                if close_transport is not None:
                    close_transport()
            except Exception as e:  # the sinks below must still close
                log.warning("weight transport close failed", transport=self.transport.name, error=repr(e))
        self.sinks.close()
        if self.samples_log is not None:
            self.samples_log.close()
        self.hook.areal_on_run_end(status=status, run_dir=self.run_dir)
