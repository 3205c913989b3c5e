"""What every trainer shares: the record stream, the run directory's
``config.yaml``, metric sinks, HF checkpoints, and ``run_training`` (the
``areal train`` driver, which looks ``algorithm.type`` up in the trainer
registry and runs the trainer under the contract of
``areal_kernel.api.trainer``).

Imported by the RL loop (``trainer/run.py``) and the offline trainers
(``trainer/offline.py``); it imports neither, so each trainer module imports
alone (tests/kernel/test_trainer_imports.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import signal
import threading
from typing import Any, Callable, Iterator

import yaml

from areal_kernel.api.engine import TrainEngine
from areal_kernel.api.metric_sink import MetricSinkContext, MetricSinkProtocol
from areal_kernel.api.trainer import Trainer, TrainerContext
from areal_kernel.config.models import ExperimentConfig
from areal_kernel.logging import setup_logging
from areal_kernel.plugins import get_plugin_manager, get_registry

# Registered trainers with this capability use inference servers (areal check,
# areal plan); defined with the planning that places them, kept importable here.
from areal_kernel.scheduling.plan import ROLLOUT_CAPABILITY, uses_rollout  # noqa: F401

# The message when a trainer method runs before setup() built the parts it uses
# (the attributes are None until then so that close() can tell what to stop).
SETUP_FIRST = "the trainer is not set up: call setup() before train()"


class RecordStream:
    """Training records in a seeded order, epoch after epoch (``None`` at the end).

    With ``tag=True`` each record handed out is a copy carrying
    ``_sample_uid`` (``e<epoch>-<index>``: the same record in the same epoch
    of any run with this seed) and ``_sample_seed`` (what workflows seed
    sampling from, see ``GenerationConfig.seed``)."""

    def __init__(self, records: list[dict], epochs: int, seed: int, shuffle: bool, tag: bool = False) -> None:
        self.records = records
        self.epochs = epochs
        self.seed = seed
        self.shuffle = shuffle
        self.tag = tag
        self.position = 0  # records handed out so far (for recovery and stats)
        self._it = self._iterate()

    def _iterate(self):
        for epoch in range(self.epochs):
            order = list(range(len(self.records)))
            if self.shuffle:
                random.Random(self.seed * 1000003 + epoch).shuffle(order)
            for i in order:
                yield epoch, i, self.records[i]

    def __call__(self) -> dict | None:
        item = next(self._it, None)
        if item is None:
            return None
        self.position += 1
        epoch, i, rec = item
        if self.tag and isinstance(rec, dict):
            digest = hashlib.sha256(f"{self.seed}:{epoch}:{i}".encode()).digest()
            rec = {**rec, "_sample_uid": f"e{epoch}-{i}", "_sample_seed": int.from_bytes(digest[:8], "little") >> 1}
        return rec

    def skip_to(self, position: int) -> None:
        """Continue after the first ``position`` records (a resumed run)."""
        if self.position:
            raise RuntimeError("RecordStream.skip_to() must be called before any record is taken")
        for _ in range(position):
            if next(self._it, None) is None:
                break
            self.position += 1


def make_sinks(cfg: ExperimentConfig, run_dir: str, total_steps: int) -> list[MetricSinkProtocol]:
    """The metric sinks named in ``logging.sinks`` (shared by every trainer),
    each built by ``Registry.build("metric_sink", name, MetricSinkContext(...))``
    with its validated ``logging.<name>`` settings (``areal_kernel.api.metric_sink``)."""
    reg = get_registry()
    return [
        reg.build(
            "metric_sink",
            name,
            MetricSinkContext(
                name=name,
                run_dir=run_dir,
                total_steps=total_steps,
                settings=cfg.logging.sink_settings(name),
                config=cfg,
            ),
        )
        for name in cfg.logging.sinks
    ]


def write_run_config(cfg: ExperimentConfig, run_dir: str) -> None:
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.yaml"), "w", encoding="utf-8") as f:
        yaml.safe_dump(cfg.dump(), f, sort_keys=False)


def save_hf_checkpoint(engine: TrainEngine, run_dir: str, tag: str, keep_last: int, step: int) -> str:
    """``engine.save_hf`` into ``<run_dir>/checkpoints/<tag>``, keeping the
    newest ``keep_last`` ``step<N>`` directories; fires ``areal_on_checkpoint``."""
    import shutil

    root = os.path.join(run_dir, "checkpoints")
    path = os.path.join(root, tag)
    engine.save_hf(path)
    steps = sorted((d for d in os.listdir(root) if d.startswith("step") and d[4:].isdigit()), key=lambda d: int(d[4:]))
    for old in steps[:-keep_last] if len(steps) > keep_last else []:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    get_plugin_manager().hook.areal_on_checkpoint(step=step, path=path)
    return path


class GracefulInterrupt:
    """SIGINT (Ctrl-C) and SIGTERM in the controller of ``areal train``.

    Outside ``armed()`` a signal raises ``KeyboardInterrupt`` at once (set-up
    and the final phase: there is nothing to save, so the run just stops).
    While armed (a trainer's step loop), the first signal only sets
    ``requested``: the trainer stops at its next step boundary and writes a
    recovery checkpoint (a step cut in half could not be resumed exactly).
    A second signal, or ``expire()`` from a watchdog when that checkpoint
    takes too long, raises ``KeyboardInterrupt`` wherever the main thread is;
    checkpoints are written atomically, so that leaves the last complete one
    as it was.
    """

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.signal_name = ""
        self.expired = False
        self._armed = False

    def install(self) -> None:
        """Handle SIGINT and SIGTERM (main thread only). Also when SIGINT
        was inherited ignored, as a non-interactive shell does for a background
        job: ``kill -INT`` must still stop the run (as for ``areal inf``)."""
        self.requested.clear()
        self.signal_name, self.expired = "", False
        if threading.current_thread() is not threading.main_thread():
            return
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        self._armed = True
        try:
            yield
        finally:
            self._armed = False

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self._armed and not self.requested.is_set():
            self.signal_name = name
            self.requested.set()
            # os.write, not print: the main thread may be inside a print of its own.
            again = "Ctrl-C" if signum == signal.SIGINT else name
            os.write(
                2,
                f"\nareal: {name} received: the run stops after the current step and writes a recovery checkpoint "
                f"({again} again to exit at once)\n".encode(),
            )
            return
        raise KeyboardInterrupt(f"signal {name}")

    def expire(self) -> None:
        """From another thread: end a checkpoint that is taking too long, as a second signal would."""
        self.expired = True
        ident = threading.main_thread().ident
        if ident is not None:
            signal.pthread_kill(ident, signal.SIGTERM)


# The controller's one handler (installed by run_trainer, armed by a trainer's step loop).
INTERRUPT = GracefulInterrupt()


def run_trainer(factory: Callable[[TrainerContext], Trainer], context: TrainerContext) -> int:
    """Set up logging and SIGINT/SIGTERM handling (``INTERRUPT``), build ``factory(context)``, run
    its ``setup`` and ``train``, write ``result.json``, and always ``close``
    it with the final status (the contract in ``areal_kernel.api.trainer``).
    Returns the exit code (0)."""
    from areal_kernel.plugins.blame import plugin_failures_reported

    cfg = context.config
    setup_logging(level=cfg.logging.level, json_logs=cfg.logging.json_logs)
    INTERRUPT.install()
    # A plain exception from plugin code (a trainer, a dataset, a sink, a hook,
    # ...) ends as one line naming the plugin; its traceback goes to <run_dir>/error.log.
    with plugin_failures_reported(context.run_dir):
        trainer = factory(context)
        status = "failed"
        try:
            trainer.setup()
            result = trainer.train()
            status = "completed"
            os.makedirs(context.run_dir, exist_ok=True)
            with open(os.path.join(context.run_dir, "result.json"), "w", encoding="utf-8") as f:
                json.dump(result, f, indent=2)
            return 0
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        finally:
            trainer.close(status)


def run_training(cfg: ExperimentConfig) -> int:
    """``areal train``: the trainer registered as ``algorithm.type``, run to the end."""
    reg = get_registry()
    reg.get("trainer", cfg.algorithm.type)  # an unknown name fails here, before logging is set up
    return run_trainer(lambda ctx: reg.build("trainer", ctx.name, ctx), TrainerContext.for_config(cfg))
