"""The trainer contract: what ``areal train`` runs for ``algorithm.type``.

A trainer is registered by name with the ``areal_register_trainers`` hook
(the kernel's own ``grpo``, ``sft``, ``dpo``, ``ipo`` and ``rm`` are
registered the same way, in ``areal_kernel.builtin``). ``areal train``:

1. validates the config (``algorithm.type`` must be a registered trainer;
   its ``algorithm.<name>: {...}`` section is validated against the
   trainer's ``config_model``);
2. calls the registered factory once, in the controller process:
   ``trainer = factory(context)`` with a ``TrainerContext``
   (``Registry.build("trainer", name, context)``, which checks that the
   result has ``setup``, ``train`` and ``close``);
3. calls ``trainer.setup()``, then ``result = trainer.train()``, writes
   ``result`` to ``<run_dir>/result.json`` and exits with code 0;
4. always calls ``trainer.close(status)`` last, with ``status``
   ``"completed"``, ``"failed"`` or ``"interrupted"`` (SIGTERM and Ctrl-C
   arrive as ``KeyboardInterrupt``; inside ``INTERRUPT.armed()`` of
   ``areal_kernel.trainer.common`` the first one only sets
   ``INTERRUPT.requested``, for the trainer to stop at a step boundary).

An ``ArealError`` raised by the trainer is the user's mistake: one line
``areal: error: ...`` and exit code 2. Any other exception is reported as a
bug of the plugin that registered the trainer (its traceback goes to
``<run_dir>/error.log``). Nothing here imports torch.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from areal_kernel.api.kinds import KindContract

if TYPE_CHECKING:
    from areal_kernel.config.models import ExperimentConfig
    from areal_kernel.plugins.registry import FactorySpec


@dataclass(frozen=True)
class TrainerContext:
    """What a trainer factory receives.

    - ``name``: the selected ``algorithm.type`` (one factory may serve
      several names, e.g. the kernel's ``dpo`` and ``ipo``).
    - ``config``: the whole validated ``ExperimentConfig``.
    - ``settings``: the trainer's validated ``algorithm.<name>`` section (an
      instance of its ``config_model``, defaults filled in), or ``None`` when
      it registered none.
    - ``run_dir``: the run directory (``config.resolved_run_dir()``); it may
      not exist yet.
    """

    name: str
    config: "ExperimentConfig"
    settings: Any
    run_dir: str

    @classmethod
    def for_config(cls, config: "ExperimentConfig") -> "TrainerContext":
        """The context ``areal train`` builds for ``config``."""
        return cls(
            name=config.algorithm.type,
            config=config,
            settings=config.algorithm.trainer_settings,
            run_dir=config.resolved_run_dir(),
        )


class Trainer(abc.ABC):
    """Base class of every trainer (the kernel's and plugins').

    Subclasses implement ``setup``, ``train`` and ``close``; the constructor
    must only store what it is given (no files, no processes): the kernel
    builds the trainer before it sets up error reporting into ``run_dir``.
    """

    def __init__(self, context: TrainerContext) -> None:
        self.context = context
        self.cfg = context.config
        self.settings = context.settings
        self.run_dir = context.run_dir

    @abc.abstractmethod
    def setup(self) -> None:
        """Check inputs, then build what the run needs (engines, data,
        servers, metric sinks). Check everything that can fail on user input
        before writing into ``run_dir``, so an earlier run's files stay."""

    @abc.abstractmethod
    def train(self) -> dict[str, Any]:
        """Run to the end; return the run's summary (JSON-serialisable),
        which the kernel writes to ``<run_dir>/result.json``."""

    @abc.abstractmethod
    def close(self, status: str) -> None:
        """Release everything ``setup`` built, whatever happened before
        (``setup`` may have failed half-way). ``status``: ``completed``,
        ``failed`` or ``interrupted``. Called exactly once."""


def _construct(target: Any, ctx: TrainerContext, spec: "FactorySpec") -> Trainer:
    return target(ctx)


KIND = KindContract(
    kind="trainer",
    context=TrainerContext,
    contract=Trainer,
    construct=_construct,
    contract_name="areal_kernel.api.trainer.Trainer",
    members=("setup", "train", "close"),
)
