"""Several policies in one run (``policies:``; docs/multi-policy.md).

One train engine holds a LoRA adapter per policy on one frozen base
(``actor.torch`` with ``adapters``; ``engine.policy(name)`` is a policy's
``TrainEngine`` view: its own optimizer, lr schedule, version and weight
updates). One set of inference servers serves every adapter beside the base;
each policy has its own dataset, workflow, reward and reward workers
(``Rollout.attach``), its own rollout executor under its own staleness bound,
and its own weight transport, which sends its adapter only.

The loop: at each global step the policy furthest behind its share (fewest
steps done per unit of ``weight``; ties in the order written) takes one RL
step on its own batch, then its adapter is sent to the servers and checked
there (``monitor.weights``); with ``trainer.policy_order: ready`` a policy
whose batch is not ready yet is passed over for the next one, in the same
order, whose batch is. The other policies' executors keep sampling
meanwhile, and an adapter's update interrupts only its own rows on servers
that can (``ServerProtocol.adapter_update_scoped``). A policy whose steps are done stops; the run ends when all are.
Metrics of a step go under ``policy/<name>/...`` (the single-policy names,
prefixed), with ``policy/<name>/step``.

Several roles in one episode: a policy with ``episodes_from: <driver>``
runs no episodes of its own. The driver's workflow samples with both
adapters and names each trajectory's (``Trajectory.metadata[ADAPTER_KEY]``;
unnamed ones are the driver's); each driver batch is split by that name
(``route_groups``), the driver trains on its own trajectories and each fed
policy, right after, on the ones naming it.

Recovery checkpoints (``checkpoint.save_every``, and on the first
interrupt) hold the engine (every adapter, its optimizer and schedule step,
the dropout RNG) and, per policy, its version, step count, stream position
and executor state; ``recover: auto`` resumes every policy from them.

A policy with ``algorithm.kl_coef > 0`` is held near its reference: the
shared base scored with every adapter off (``score_base``), which is where
its adapter started (LoRA starts as a no-op), so no reference model is
loaded. A policy whose estimator needs values (``gae``) has a critic of its
own (``make_critic``: a value model with every parameter its own, trained by
the actor's settings, at its ``algorithm.critic_lr``), saved in recovery
checkpoints under ``critics/<name>``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, NoReturn

from areal_kernel.api.advantage_estimator import AdvantageEstimatorContext
from areal_kernel.api.io import ADAPTER_KEY, TrajectoryBatch, TrajectoryGroup
from areal_kernel.api.loss import LossContext
from areal_kernel.api.trainer import Trainer, TrainerContext
from areal_kernel.config.models import ExperimentConfig
from areal_kernel.config.loader import check_policies
from areal_kernel.config.policies import adapter_settings
from areal_kernel.errors import ArealError, ConfigError
from areal_kernel.logging import get_logger
from areal_kernel.monitor.mismatch import MismatchMonitor
from areal_kernel.monitor.weights import WeightsMonitor
from areal_kernel.plugins import get_plugin_manager, get_registry
from areal_kernel.rollout.executor import RolloutExecutor, staleness_histogram
from areal_kernel.trainer.common import INTERRUPT, SETUP_FIRST, RecordStream, save_hf_checkpoint, write_run_config
from areal_kernel.trainer.run import make_critic, needs_critic
from areal_kernel.trainer.recovery import (
    SAMPLES_FILE,
    STATE_FILE,
    STATE_FORMAT,
    Checkpoint,
    SamplesLog,
    hold_after_step,
    hold_step_from_env,
    plan_start,
    provenance,
    recovery_manager,
    set_aside_logs,
    truncate_jsonl,
)
from areal_kernel.trainer.toolkit import (
    MetricSinks,
    Rollout,
    build_weight_transport,
    evaluate_together,
    held_out_job,
    finetune_spec,
    load_datasets,
    open_metric_sinks,
    resolve_model,
    start_rollout,
    start_train_engine,
)

log = get_logger(__name__)

# A recovery checkpoint's critics: <checkpoint>/critics/<policy name>/.
CRITICS_DIR = "critics"


class GRPOTrainer(Trainer):
    """``algorithm.type: grpo``: the multi-policy trainer when the config
    declares ``policies``, else the single-policy ``RLTrainer``; every call
    goes to the one chosen (``impl``), attributes too."""

    def __init__(self, context: TrainerContext) -> None:
        super().__init__(context)
        from areal_kernel.trainer.run import RLTrainer

        self.impl: Trainer = MultiPolicyTrainer(context) if context.config.policies else RLTrainer(context)

    def setup(self) -> None:
        self.impl.setup()

    def train(self) -> dict[str, Any]:
        return self.impl.train()

    def close(self, status: str) -> None:
        self.impl.close(status)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names this wrapper lacks (the chosen trainer's parts).
        if name == "impl":
            raise AttributeError(name)
        return getattr(self.impl, name)


@dataclasses.dataclass
class Policy:
    """One policy's parts and counters (built by ``MultiPolicyTrainer.setup``)."""

    name: str
    cfg: ExperimentConfig
    ctx: TrainerContext
    weight: float
    train_records: list[Any]
    eval_records: list[Any]
    total_steps: int
    rl_cfg: Any = None
    estimator: Any = None
    loss: Any = None
    engine: Any = None  # the train engine's view of this policy
    rollout: Rollout | None = None
    transport: Any = None
    executor: RolloutExecutor | None = None
    stream: RecordStream | None = None
    mismatch: MismatchMonitor | None = None
    weights_monitor: WeightsMonitor | None = None
    version: int = 0
    steps: int = 0
    trained_samples: int = 0
    before: dict[str, Any] | None = None
    needs_critic: bool = False  # its estimator needs values (gae): ``critic`` is built in setup
    critic: Any = None  # its value model
    # A policy fed by another's episodes (``episodes_from``): that policy's
    # name; it has no executor or stream, and ``inbox`` holds its groups
    # routed from the driver's last batch until its own step takes them.
    episodes_from: str | None = None
    inbox: list[TrajectoryGroup] = dataclasses.field(default_factory=list)
    fed: list["Policy"] = dataclasses.field(default_factory=list)  # the policies this one's episodes feed

    def share(self) -> float:
        """Steps done per unit of weight: the scheduler serves the smallest."""
        return self.steps / self.weight


@dataclasses.dataclass
class _Step:
    """One policy's step between ``_prepare`` and ``_finish``."""

    policy: Policy
    groups: list[TrajectoryGroup]
    batch: TrajectoryBatch
    plan: Any  # areal_kernel.algo.rl.RLStepPlan
    metrics: dict[str, Any]
    hist: dict[Any, int]
    t0: float
    t_wait: float
    stats: dict[str, Any] | None = None


class MultiPolicyTrainer(Trainer):
    """``algorithm.type: grpo`` with ``policies:`` (see the module docstring)."""

    def __init__(self, context: TrainerContext) -> None:
        super().__init__(context)
        self.hook = get_plugin_manager().hook
        self.policies: list[Policy] = []
        self.train_engine: Any = None
        self.rollout: Rollout | None = None  # the servers' owner (the first policy's rollout)
        self.sinks = MetricSinks([])
        self.samples_log: SamplesLog | None = None
        self.step = 0
        self.recovery = recovery_manager(self.run_dir, self.cfg.checkpoint.keep_last)
        self.resume_from: Checkpoint | None = None

    # -- set-up ---------------------------------------------------------------
    def setup(self) -> None:
        cfg, reg = self.cfg, get_registry()
        # Everything that can fail on the user's input comes first: every
        # policy's config and data, then the engine with every adapter (a
        # target module the model lacks), before any server starts.
        configs = check_policies(cfg, reg)
        model = resolve_model(self.context)
        for name, pcfg in configs.items():
            try:
                valued = needs_critic(pcfg)
            except ConfigError as e:
                raise ConfigError(f"policies.{name}.{e}") from None
            pctx = dataclasses.replace(self.context, config=pcfg)
            try:
                data = load_datasets(pctx)
            except ArealError as e:
                raise type(e)(f"policies.{name}: {e}") from None
            ft = finetune_spec(pctx, len(data.train))
            self.policies.append(
                Policy(
                    name=name, cfg=pcfg, ctx=pctx, weight=cfg.policies[name].weight,
                    train_records=list(data.train), eval_records=list(data.held_out),
                    total_steps=ft.total_train_steps, episodes_from=cfg.policies[name].episodes_from,
                    needs_critic=valued,
                )
            )  # fmt: skip
        by_name = {p.name: p for p in self.policies}
        for p in self.policies:
            if p.episodes_from is not None:
                driver = by_name[p.episodes_from]
                driver.fed.append(p)
                p.total_steps = driver.total_steps  # at most one step per step of its driver
        settings = adapter_settings(cfg)
        if hasattr(settings, "temperature"):
            # Logprob ratios must compare the distribution the sampler used.
            settings = settings.model_copy(update={"temperature": cfg.rollout.gconfig.temperature})
        opt_steps = max(p.total_steps * p.cfg.algorithm.ppo_n_minibatches for p in self.policies)
        try:
            self.train_engine = start_train_engine(self.context, model, opt_steps, settings=settings)
        except ConfigError as e:
            # The engine names an adapter by its place in its own list; the user wrote policies.<name>.lora.
            text = str(e)
            where = f"{cfg.actor.where}.{cfg.actor.selected_name}.adapters"
            for i, p in enumerate(self.policies):
                text = text.replace(f"{where}[{i}] (name {p.name!r})", f"policies.{p.name}.lora")
            raise ConfigError(text) from None
        if not hasattr(self.train_engine, "policy"):
            raise ConfigError(
                f"policies: actor.backend {cfg.actor.allocation.backend!r} does not hand out per-policy views "
                "(engine.policy(name)); use actor.backend: torch"
            )
        for p in self.policies:
            if p.needs_critic:
                # Its own schedule's length: its steps times its minibatches.
                steps = p.total_steps * p.cfg.algorithm.ppo_n_minibatches
                p.critic = make_critic(p.cfg, cfg.actor.plugin_config, model.path, steps)
        with_kl = [p.name for p in self.policies if p.cfg.algorithm.kl_coef > 0]
        if with_kl and not hasattr(self.train_engine, "score_base"):
            raise ConfigError(
                f"policies.{with_kl[0]}.algorithm.kl_coef: actor.backend {cfg.actor.allocation.backend!r} cannot "
                "score with its adapters off (score_base), the reference of a multi-policy run; set kl_coef: 0"
            )
        plan = plan_start(cfg, self.run_dir)
        names = f"{len(self.policies)} policies ({', '.join(p.name for p in self.policies)})"
        if plan.checkpoint is not None:
            self.resume_from = plan.checkpoint
            k = plan.checkpoint.step
            for name in ("metrics.jsonl", SAMPLES_FILE):
                truncate_jsonl(os.path.join(self.run_dir, name), k)  # steps after the checkpoint are redone
            print(f"{plan.reason}; {names}; metrics.jsonl and samples.jsonl continue from step {k}", flush=True)
        else:
            moved = set_aside_logs(self.run_dir, ("metrics.jsonl", SAMPLES_FILE, "result.json"))
            note = f"; metrics of the earlier run kept in {', '.join(n + '.prev' for n in moved)}" if moved else ""
            print(f"starting at step 0: {plan.reason}; {names}{note}", flush=True)
        write_run_config(cfg, self.run_dir)
        total = sum(p.total_steps for p in self.policies)
        self.sinks = open_metric_sinks(self.context, total)
        self.hook.areal_on_run_start(config=cfg, run_dir=self.run_dir)
        first = self.policies[0]
        log.info("starting inference servers", backend=str(cfg.rollout.allocation), model=model.path)
        self.rollout = start_rollout(dataclasses.replace(self.context, config=first.cfg), model, adapter=first.name)
        # The servers hold every adapter; requests name theirs (no default).
        self.rollout.engine.default_adapter = None
        from areal_kernel.algo.rl import RLConfig
        from areal_kernel.trainer.run import _keep_group

        for p in self.policies:
            p.rollout = self.rollout if p is first else self.rollout.attach(p.cfg, p.name)
            p.rl_cfg = RLConfig.from_config(p.cfg)
            a = p.cfg.algorithm
            p.estimator = reg.build(
                "advantage_estimator", a.advantage, AdvantageEstimatorContext(a.advantage, a.advantage_settings),
                platform="",
            )  # fmt: skip
            p.loss = reg.build("loss", a.loss, LossContext(a.loss, a.loss_settings), platform="")
            mm, wm = p.cfg.monitor.mismatch, p.cfg.monitor.weights
            p.mismatch = MismatchMonitor(bound=mm.bound, patience=mm.patience, action=mm.action)
            p.weights_monitor = WeightsMonitor(
                action=wm.action, tensors_per_update=wm.tensors_per_update,
                elements_per_tensor=wm.elements_per_tensor, seed=p.cfg.seed, warn=lambda m: print(m, flush=True),
            )  # fmt: skip
            p.engine = self.train_engine.policy(p.name)
            p.transport = build_weight_transport(p.ctx, p.engine, p.rollout)
            p.transport.setup()
            if plan.checkpoint is None:
                # Version 0 of the adapter (peft starts it as a no-op): the servers learn its name.
                p.transport.update(0)
                p.weights_monitor.check(0, p.engine, p.rollout.engine)
                p.weights_monitor.raise_if_alarmed()
            if p.episodes_from is not None:
                log.info("policy ready", policy=p.name, steps=p.total_steps, episodes_from=p.episodes_from)
                continue  # its trajectories come from its driver's episodes
            p.stream = RecordStream(
                p.train_records, p.cfg.trainer.total_train_epochs, p.cfg.seed, p.cfg.dataset.shuffle, tag=True
            )
            p.executor = RolloutExecutor(
                p.rollout.engine, p.rollout.workflow, p.stream,
                batch_size=p.cfg.trainer.batch_size, max_staleness=p.cfg.rollout.max_staleness,
                max_concurrent=p.cfg.rollout.max_concurrent_rollouts,
                keep=_keep_group(p.rl_cfg) if a.dynamic_filter else None, retry_budget=a.filter_retry_budget,
            )  # fmt: skip
            log.info("policy ready", policy=p.name, steps=p.total_steps, weight=p.weight)
        if plan.checkpoint is not None:
            assert plan.state is not None
            self._restore(plan.checkpoint, plan.state)
        self.samples_log = SamplesLog(self.run_dir)

    # -- recovery ---------------------------------------------------------------
    def _restore(self, ckpt: Checkpoint, state: dict[str, Any]) -> None:
        """Load a recovery checkpoint into the freshly built parts, then give
        the servers (started from the base) every policy's adapter."""
        saved = state.get("policies") or {}
        missing = [p.name for p in self.policies if p.name not in saved]
        if missing:
            # Before anything loads: the checkpoint's policies are not these.
            raise ArealError(
                f"recovery checkpoint {ckpt.path} holds no state of policies {missing}; resume it with the policies "
                "it was written with, or start over in another run_dir"
            )
        self.train_engine.load_state(os.path.join(ckpt.path, "engine"))
        for p in self.policies:
            if p.critic is not None:
                p.critic.load_state(os.path.join(ckpt.path, CRITICS_DIR, p.name))
        self.step = int(state["step"])
        for p in self.policies:
            ps = saved[p.name]
            assert p.weights_monitor is not None and p.rollout is not None, SETUP_FIRST
            p.version, p.steps = int(ps["version"]), int(ps["steps"])
            p.trained_samples, p.before = int(ps["trained_samples"]), ps["before_eval"]
            if p.episodes_from is None:
                assert p.stream is not None and p.executor is not None, SETUP_FIRST
                p.stream.skip_to(int(ps["stream_position"]))
                p.executor.load_state_dict(ps["executor"])
                p.executor.set_version(p.version)
            p.engine.set_version(p.version)
            p.transport.update(p.version)
            p.weights_monitor.check(p.version, p.engine, p.rollout.engine)
            p.weights_monitor.raise_if_alarmed()

    def save_recovery(self) -> str:
        """A recovery checkpoint of the state after global step ``self.step``:
        every policy's executor is drained first (its finished groups are
        saved, none is running), then the engine and the state are written."""
        for p in self.policies:
            if p.executor is not None:  # a policy fed by another's episodes has none
                p.executor.drain()
        t0 = time.monotonic()
        state: dict[str, Any] = {
            "format": STATE_FORMAT,
            "step": self.step,
            "policies": {
                p.name: {
                    "version": p.version,
                    "steps": p.steps,
                    "trained_samples": p.trained_samples,
                    "stream_position": p.stream.position if p.stream is not None else 0,
                    "executor": p.executor.state_dict() if p.executor is not None else {},
                    "before_eval": p.before,
                }
                for p in self.policies
            },
            "config": self.cfg.dump(),
        }

        def write(path: str) -> None:
            self.train_engine.save_state(os.path.join(path, "engine"))
            for p in self.policies:
                if p.critic is not None:
                    p.critic.save_state(os.path.join(path, CRITICS_DIR, p.name))
            with open(os.path.join(path, STATE_FILE), "w", encoding="utf-8") as f:
                json.dump(state, f)

        try:
            ckpt = self.recovery.save(self.step, write)
        finally:
            for p in self.policies:
                if p.executor is not None:
                    p.executor.resume()
        self.hook.areal_on_checkpoint(step=self.step, path=ckpt.path)
        log.info("recovery checkpoint written", path=ckpt.path, seconds=round(time.monotonic() - t0, 2))
        return ckpt.path

    def _stop_for_interrupt(self) -> NoReturn:
        """The first SIGINT/SIGTERM, at a step boundary: a recovery checkpoint
        of the state after ``self.step`` (unless ``checkpoint.on_interrupt``
        is off, nothing was trained, or that step's is written), then stop."""
        latest = self.recovery.latest()
        if self.step and self.cfg.checkpoint.on_interrupt and (latest is None or latest.step != self.step):
            path = self.save_recovery()
            print(f"interrupted at step {self.step}: saved {path}; run the same command to resume", flush=True)
        else:
            print(f"interrupted at step {self.step}; the same command resumes from the newest checkpoint", flush=True)
        raise KeyboardInterrupt(INTERRUPT.signal_name)

    # -- the loop ---------------------------------------------------------------
    def _evaluate(self, policies: list[Policy]) -> list[dict[str, Any]]:
        """The policies' held-out sets, asked at once: the servers batch every
        policy's greedy answers together (each with its own adapter)."""
        jobs = []
        for p in policies:
            assert p.rollout is not None, SETUP_FIRST
            jobs.append(held_out_job(p.ctx, p.rollout, p.eval_records))
        return evaluate_together(jobs)

    def train(self) -> dict[str, Any]:
        assert self.rollout is not None and self.samples_log is not None, SETUP_FIRST
        unscored = [p for p in self.policies if p.before is None]  # a resumed run has it from its checkpoint
        for p, before in zip(unscored, self._evaluate(unscored)):
            p.before = before
            if p.eval_records:
                self.sinks.log(0, {f"policy/{p.name}/{k}": before[k] for k in ("eval/accuracy", "eval/reward")})
        for p in self.policies:
            if p.eval_records and p.before is not None:
                print(
                    f"{p.name}: held-out greedy accuracy before training: {p.before['eval/accuracy']:.3f}", flush=True
                )
        for p in self.policies:
            if p.executor is not None:
                p.executor.start()
        t_run = time.monotonic()
        hold_at = hold_step_from_env()  # a testing aid; None unless asked for
        with INTERRUPT.armed():
            while True:
                if INTERRUPT.requested.is_set():
                    self._stop_for_interrupt()
                # Policies fed by another's episodes step right after their driver.
                todo = [p for p in self.policies if p.steps < p.total_steps and p.episodes_from is None]
                if not todo:
                    break
                t_choose = time.monotonic()
                first = self.step + 1
                if self.cfg.trainer.policy_order == "together":
                    self._joint_step(self._together_group(todo), 0.0)
                else:
                    p, passed_over = self._next_policy(todo)
                    self._policy_step(p, t_run, passed_over, time.monotonic() - t_choose)
                    for q in p.fed:
                        self._policy_step(q, t_run)
                if hold_at is not None and first <= hold_at <= self.step:
                    hold_after_step(self.run_dir, hold_at)
                every = self.cfg.checkpoint.save_every
                crossed = every and (self.step // every) > ((first - 1) // every)
                if crossed and any(q.steps < q.total_steps for q in self.policies if q.episodes_from is None):
                    self.save_recovery()
        for p in self.policies:
            if p.executor is not None:
                p.executor.stop()
        result: dict[str, Any] = {
            "steps": self.step,
            "train_seconds": time.monotonic() - t_run,
            "resumed_from_step": self.resume_from.step if self.resume_from is not None else None,
            "policies": {},
        }
        for p, after in zip(self.policies, self._evaluate(self.policies)):
            if p.eval_records:
                self.sinks.log(self.step, {f"policy/{p.name}/{k}": after[k] for k in ("eval/accuracy", "eval/reward")})
            final = save_hf_checkpoint(
                p.engine, self.run_dir, f"final-{p.name}", self.cfg.checkpoint.keep_last, p.version
            )
            assert p.before is not None
            print(
                f"{p.name}: held-out greedy accuracy before {p.before['eval/accuracy']:.3f} -> after "
                f"{after['eval/accuracy']:.3f} (n={after['eval/n']}; {p.steps} steps, {p.trained_samples} samples); "
                f"final adapter: {final}",
                flush=True,
            )
            result["policies"][p.name] = {
                "before": p.before["eval/accuracy"], "after": after["eval/accuracy"],
                "reward_before": p.before.get("eval/reward"), "reward_after": after.get("eval/reward"),
                "steps": p.steps, "samples": p.trained_samples, "checkpoint": final,
            }  # fmt: skip
        return result

    def _next_policy(self, todo: list[Policy]) -> tuple[Policy, int]:
        """The policy that takes the next step, and how many policies
        further behind their share it passed over (``trainer.policy_order``).

        ``weight``: the one with the fewest steps per unit of weight (the
        first written on a tie), whose batch is then waited for. ``ready``:
        in the same order of preference, the first whose batch is ready
        (``RolloutExecutor.ready``); while none is, wait for the first to be."""
        # sorted() is stable: equal shares stay in the order written.
        by_share = sorted(todo, key=lambda q: q.share())
        if self.cfg.trainer.policy_order == "weight":
            return by_share[0], 0
        while True:
            for i, q in enumerate(by_share):
                assert q.executor is not None, SETUP_FIRST  # fed policies are not in todo
                if q.executor.ready(q.cfg.trainer.batch_size):
                    return q, i
            if INTERRUPT.requested.is_set():
                return by_share[0], 0  # its get_batch returns at once, and the loop stops
            time.sleep(0.02)

    def _policy_step(self, p: Policy, t_run: float, passed_over: int = 0, waited: float = 0.0) -> None:
        """One RL step of ``p``; ``waited``: seconds spent choosing it
        (waiting for any policy's batch to be ready), counted as waiting
        for rollouts."""
        from areal_kernel.algo.rl import run_rl_plan

        step = self._prepare(p)
        if step is None:
            return
        t1 = time.monotonic()
        step.stats = run_rl_plan(step.plan, p.engine)
        self._finish(step, t1, time.monotonic(), passed_over, waited)

    def _together_group(self, todo: list[Policy]) -> list[Policy]:
        """``trainer.policy_order: together``: the policy furthest behind its
        share, and with it every policy that would not get ahead of it by
        taking a step now (share below the first's after this step). Equal
        weights: every policy at every step; weights 2 and 1: the first at
        every step, the second at every other one."""
        by_share = sorted(todo, key=lambda q: q.share())
        first = by_share[0]
        target = (first.steps + 1) / first.weight
        return [first] + [q for q in by_share[1:] if q.share() < target]

    def _joint_step(self, group: list[Policy], waited: float) -> None:
        """One RL step of every policy in ``group`` (and of the policies
        their episodes feed), their actors' minibatches trained together:
        minibatch k of every policy in one ``train_policies`` call, which
        shares the base's forwards between them. Then each policy is
        finished as after its own step (version, weight update, metrics), in
        ``group``'s order, each its own global step."""
        from areal_kernel.algo.rl import finish_rl_step
        from areal_kernel.engine.together import PolicyJob

        steps: list[_Step] = []
        queue = list(group)
        while queue:
            p = queue.pop(0)
            step = self._prepare(p, taken=[s.policy for s in steps])
            if step is not None:
                steps.append(step)
                queue.extend(p.fed)  # their inboxes hold what this batch routed to them
        t1 = time.monotonic()
        per_mb: dict[str, list[dict[str, Any]]] = {s.policy.name: [] for s in steps}
        for k in range(max((len(s.plan.minibatches) for s in steps), default=0)):
            jobs = {s.policy.name: PolicyJob(*s.plan.minibatches[k]) for s in steps if k < len(s.plan.minibatches)}
            for name, stats in self.train_engine.train_policies(jobs).items():
                per_mb[name].append(dict(stats))
        t2 = time.monotonic()
        for s in steps:
            s.stats = finish_rl_step(s.plan, per_mb[s.policy.name])
            self._finish(s, t1, t2, 0, waited)

    def _prepare(self, p: Policy, taken: list[Policy] | None = None) -> "_Step | None":
        """The part of ``p``'s step before its optimizer steps: its batch (its
        executor's, or what its driver routed to it), the reference scores
        and ``plan_rl_step``. None: a fed policy whose driver's batch held
        nothing of it (its step is skipped). ``taken``: policies of the same
        joint step whose batches are taken already; an interrupt while this
        one waits gives theirs back first, so the recovery checkpoint holds
        them untrained."""
        from areal_kernel.algo.rl import plan_rl_step
        from areal_kernel.trainer.run import _batch_metrics

        assert self.rollout is not None and self.samples_log is not None, SETUP_FIRST
        assert p.rollout is not None and p.mismatch is not None, SETUP_FIRST
        assert p.weights_monitor is not None, SETUP_FIRST
        self.rollout.check()  # a server that could not be restarted stops the run here
        t0 = time.monotonic()
        if p.episodes_from is not None:
            groups, p.inbox = p.inbox, []
            if not groups:
                # Its driver's episodes this step held nothing of it (e.g. no question to answer).
                log.warning("no trajectories of this policy in its driver's batch; step skipped", policy=p.name)
                return None
        else:
            assert p.executor is not None, SETUP_FIRST
            groups = p.executor.get_batch(p.cfg.trainer.batch_size, stop=INTERRUPT.requested)
            if not groups:  # interrupted while waiting: the state after self.step is intact
                for q in taken or []:
                    if q.executor is not None:
                        q.executor.give_back()
                    q.inbox = []  # routed from a batch given back: routed again when it is taken again
                self._stop_for_interrupt()
            if p.fed:
                groups, routed = route_groups(groups, p.name, [q.name for q in p.fed])
                for q in p.fed:
                    q.inbox.extend(routed[q.name])
                if not groups:
                    raise ArealError(
                        f"policies.{p.name}: its workflow's batch held no trajectory of its own adapter (every one "
                        f"named another policy's in metadata[{ADAPTER_KEY!r}]); nothing to train it on"
                    )
        t_wait = time.monotonic() - t0
        batch = TrajectoryBatch.from_groups(groups)
        # The reference policy (kl_coef): the base with every adapter off,
        # which is where each adapter started.
        ref = self.train_engine.score_base(batch, only_loss_tokens=True) if p.rl_cfg.kl_coef > 0 else None
        plan = plan_rl_step(
            batch, p.engine, p.rl_cfg, estimator=p.estimator, loss=p.loss, ref_logprobs=ref, critic=p.critic,
            mismatch_threshold=p.cfg.monitor.mismatch.token_threshold,
        )  # fmt: skip
        return _Step(p, groups, batch, plan, _batch_metrics(batch, p.version), staleness_histogram(groups, p.version),
                     t0, t_wait)  # fmt: skip

    def _finish(self, s: "_Step", t1: float, t2: float, passed_over: int, waited: float) -> None:
        """The part of a policy's step after its optimizer steps (``t1``-``t2``:
        when they ran): its version and weight update, the delivery check,
        the samples and metrics of the global step it is."""
        assert self.rollout is not None and self.samples_log is not None and s.stats is not None, SETUP_FIRST
        p, groups, batch, stats, metrics = s.policy, s.groups, s.batch, s.stats, s.metrics
        assert p.rollout is not None and p.mismatch is not None and p.weights_monitor is not None, SETUP_FIRST
        p.version += 1
        upd = p.transport.update(p.version)
        p.engine.set_version(p.version)
        if p.executor is not None:
            p.executor.set_version(p.version)
        delivery = p.weights_monitor.check(p.version, p.engine, p.rollout.engine)
        self.step += 1
        p.steps += 1
        p.trained_samples += len(batch)
        samples = provenance(groups)
        for entry in samples:
            entry.setdefault("adapter", p.name)  # every request of this policy's workflow named its adapter
        self.samples_log.log(self.step, p.version, [g.sample_uid for g in groups], samples)
        metrics.update({f"train/{k}": v for k, v in stats.items() if isinstance(v, (int, float))})
        mismatch = stats.get("mismatch") or {}
        metrics.update({f"mismatch/{k}": v for k, v in mismatch.items()})
        metrics.update({f"monitor/{k}": v for k, v in p.mismatch.observe(self.step, mismatch).items()})
        metrics.update({f"monitor/{k}": v for k, v in delivery.items()})
        metrics.update({f"rollout/staleness_hist/{k}": float(n) for k, n in s.hist.items()})
        metrics.update(upd)
        if p.executor is not None:
            metrics.update(p.executor.stats.snapshot_and_reset())
        metrics.update(
            {
                "perf/step_s": time.monotonic() - s.t0 + waited,
                "perf/wait_rollout_s": s.t_wait + waited,
                # With policy_order together: the joint optimizer steps of every policy in the group.
                "perf/train_s": t2 - t1,
                "perf/train_tokens_per_s": batch.n_tokens / max(t2 - t1, 1e-9),
                "version": p.version,
                "step": p.steps,
                # Policies further behind their share whose batch was not ready (policy_order: ready).
                "sched/passed_over": float(passed_over),
            }
        )
        out = {f"policy/{p.name}/{k}": v for k, v in metrics.items()}
        out.update(self.rollout.server_stats())
        self.sinks.log(self.step, out)
        self.hook.areal_on_train_step(step=self.step, metrics=out)
        p.weights_monitor.raise_if_alarmed()
        p.mismatch.raise_if_alarmed()

    def close(self, status: str) -> None:
        for p in self.policies:
            if p.executor is not None:
                p.executor.stop()
        if self.train_engine is not None:
            self.train_engine.destroy()
        for p in self.policies:
            if p.critic is not None:
                p.critic.destroy()
        # The attached policies' workflows and reward pools, then the servers.
        for p in self.policies:
            if p.rollout is not None and p.rollout is not self.rollout:
                p.rollout.stop()
        if self.rollout is not None:
            self.rollout.stop()
        for p in self.policies:
            close_transport = getattr(p.transport, "close", None)
            if close_transport is not None:
                try:
                    close_transport()
                except Exception as e:  # the sinks below must still close
                    log.warning("weight transport close failed", policy=p.name, error=repr(e))
        self.sinks.close()
        if self.samples_log is not None:
            self.samples_log.close()
        self.hook.areal_on_run_end(status=status, run_dir=self.run_dir)


def route_groups(
    groups: list[TrajectoryGroup], driver: str, fed: list[str]
) -> tuple[list[TrajectoryGroup], dict[str, list[TrajectoryGroup]]]:
    """Split a driver's batch by the adapter each trajectory names
    (``metadata[ADAPTER_KEY]``; unnamed: the driver's): ``(the driver's
    groups, {fed policy: its groups})``. Each group is split into one group
    per adapter, keeping its ``group_id`` and ``sample_uid`` (advantages
    are taken per trajectory ``group_id``, so a workflow gives each role's
    samples of one episode their own); groups left empty are dropped. A
    trajectory naming an adapter that is neither the driver's nor fed by it
    is an ``ArealError``: it would be trained by no policy."""
    own: list[TrajectoryGroup] = []
    routed: dict[str, list[TrajectoryGroup]] = {name: [] for name in fed}
    for g in groups:
        parts: dict[str, list[Any]] = {}
        for t in g.trajectories:
            name = t.metadata.get(ADAPTER_KEY) or driver
            if name != driver and name not in routed:
                raise ArealError(
                    f"policies.{driver}: its workflow returned a trajectory of adapter {name!r} (sample "
                    f"{t.sample_id!r}), which is not a policy fed by its episodes (episodes_from: {driver}); "
                    f"fed: {fed or 'none'}"
                )
            parts.setdefault(name, []).append(t)
        for name, trajs in parts.items():
            part = TrajectoryGroup(trajs, group_id=g.group_id, sample_uid=g.sample_uid)
            (own if name == driver else routed[name]).append(part)
    return own, routed


__all__ = ["GRPOTrainer", "MultiPolicyTrainer", "Policy", "route_groups"]
