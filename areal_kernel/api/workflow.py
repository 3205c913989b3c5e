"""Kind ``workflow`` (``workflow.type``; hook ``areal_register_workflows``).

The kernel builds the selected workflow once per run, in the controller,
after the inference servers and the reward pool are up:
``Registry.build("workflow", name, WorkflowContext(...))`` calls
``Workflow.from_context(context)``, whose default is
``cls(tokenizer=..., gconfig=..., reward_target=..., reward_pool=...,
config=settings)``, so a subclass writes that constructor.

Members the kernel uses (``WorkflowProtocol``; the ``Workflow`` base class
gives defaults for all but the two episode methods):

- ``required_fields`` (class attribute, default ``("prompt",)``): the record
  fields it reads; every record is checked for them before any server starts.
- ``await arun_episode(engine, record) -> TrajectoryGroup | None``: the
  samples of one record as a group (``None`` rejects the record); many run at
  once on the controller's asyncio loop. Every trajectory carries the group's
  ``group_id``; ``loss_mask`` is 1 exactly on generated tokens.
- ``await aevaluate(engine, record, max_new_tokens) -> (reward, text)``: one
  greedy answer for the held-out evaluation.
- ``encode_prompt(record) -> list[int]``: the prompt's token ids, which
  ``areal check`` prints beside each sample. Optional: the base class's
  default raises, and ``areal check`` then shows no prompt.
- ``reward_calls``, ``reward_failures``, ``last_reward_error``: reward
  bookkeeping the trainer reads (and restores from recovery checkpoints) to
  stop a run whose reward keeps failing (``RewardScoring`` keeps them).
- ``close()``: called once when the run's rollout stops, before the servers.

What a trajectory carries for display and metrics (``Trajectory.metadata``):
``metadata[COMPLETION_KEY]`` (``"completion"``), the decoded completion that
``areal check`` and ``samples.jsonl`` show (empty without it), and
``metadata[SAMPLE_METRICS_KEY]`` (``"metrics"``), per-sample numbers logged as
``workflow/<name>`` means.

Rewards: a sample's reward is what the reward returned for it, or, for a
workflow that gives several attempts, a documented function of the rewards
of its attempts (the built-in ``multi_turn`` multiplies the reward of the
attempt that ended the episode by ``turn_discount**k``). Full text:
docs/plugin-authoring.md, "Workflows".
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from areal_kernel.api.io import GenerationConfig, TrajectoryGroup
from areal_kernel.api.kinds import KindContract, from_context

if TYPE_CHECKING:
    from areal_kernel.api.engine import InferenceEngine
    from areal_kernel.api.reward import Reward
    from areal_kernel.config.models import ExperimentConfig
    from areal_kernel.plugins.registry import FactorySpec

__all__ = [
    "Workflow",
    "WorkflowProtocol",
    "WorkflowContext",
    "COMPLETION_KEY",
    "SAMPLE_METRICS_KEY",
    "DEFAULT_REQUIRED_FIELDS",
    "KIND",
]

#: ``Trajectory.metadata`` key of the decoded completion (shown by ``areal check``).
COMPLETION_KEY = "completion"
#: ``Trajectory.metadata`` key of a sample's own metrics, ``{name: number}``.
SAMPLE_METRICS_KEY = "metrics"
#: The record fields a workflow that declares no ``required_fields`` reads.
DEFAULT_REQUIRED_FIELDS: tuple[str, ...] = ("prompt",)


@dataclass(frozen=True)
class WorkflowContext:
    """What a workflow is built with.

    - ``name``: the selected ``workflow.type``.
    - ``tokenizer``: the model's HF tokenizer.
    - ``gconfig``: the ``GenerationConfig`` of ``rollout.gconfig``
      (``n_samples`` is the group size); a copy per workflow, never shared
      in place.
    - ``reward``: the run's built ``Reward`` (``reward.target`` is what
      ``reward_pool.ascore`` takes; ``reward.success_threshold``).
    - ``reward_pool``: the kernel's ``RewardPool`` with the reward's settings
      bound (``await pool.ascore(reward.target, completion, answer)``).
    - ``settings``: the validated ``workflow.<name>`` section (an instance of
      its ``config_model``; ``None`` without one).
    - ``config``: the whole validated ``ExperimentConfig`` (``None`` outside a run).
    """

    name: str
    tokenizer: Any
    gconfig: GenerationConfig
    reward: "Reward"
    reward_pool: Any
    settings: Any = None
    config: "ExperimentConfig | None" = None


@runtime_checkable
class WorkflowProtocol(Protocol):
    """What the kernel calls or reads on a built workflow (``Registry.build``
    checks ``arun_episode``, ``aevaluate`` and the reward counters;
    ``encode_prompt`` and ``close`` are optional, see the module docstring)."""

    required_fields: tuple[str, ...]
    reward_calls: int
    reward_failures: int
    last_reward_error: str | None

    async def arun_episode(self, engine: "InferenceEngine", record: dict[str, Any]) -> TrajectoryGroup | None: ...

    async def aevaluate(
        self, engine: "InferenceEngine", record: dict[str, Any], max_new_tokens: int
    ) -> tuple[float, str]: ...

    def encode_prompt(self, record: dict[str, Any]) -> list[int]:
        """Optional: a workflow that cannot encode prompts raises
        ``NotImplementedError`` (the ``Workflow`` default)."""
        ...


class Workflow(abc.ABC):
    """Base class of workflows (the built-in ``rlvr``, ``multi_turn``,
    ``vision_rlvr`` and ``agent`` are subclasses). Combine it with
    ``areal_kernel.workflow.scoring.RewardScoring`` to score through the pool
    and keep the reward counters."""

    required_fields: tuple[str, ...] = DEFAULT_REQUIRED_FIELDS
    # Class defaults; the first ``+=`` gives each instance its own counter.
    reward_calls: int = 0
    reward_failures: int = 0
    last_reward_error: str | None = None

    @classmethod
    def from_context(cls, context: WorkflowContext) -> "Workflow":
        """The factory the kernel calls; the default is ``cls(tokenizer=...,
        gconfig=..., reward_target=context.reward.target, reward_pool=...,
        config=context.settings)``."""
        return cls(  # type: ignore[call-arg]
            tokenizer=context.tokenizer,
            gconfig=context.gconfig,
            reward_target=context.reward.target,
            reward_pool=context.reward_pool,
            config=context.settings,
        )

    @abc.abstractmethod
    async def arun_episode(self, engine: "InferenceEngine", record: dict[str, Any]) -> TrajectoryGroup | None:
        """The samples of ``record`` as one group, or ``None`` to reject it."""

    @abc.abstractmethod
    async def aevaluate(
        self, engine: "InferenceEngine", record: dict[str, Any], max_new_tokens: int
    ) -> tuple[float, str]:
        """One greedy answer to ``record``: ``(reward, completion)``."""

    def encode_prompt(self, record: dict[str, Any]) -> list[int]:
        """The prompt of ``record`` as token ids (``areal check`` prints it)."""
        raise NotImplementedError(f"workflow {type(self).__name__} does not encode prompts (encode_prompt)")

    def close(self) -> None:
        """Release what the workflow started; once, before the servers stop."""


def _old_shape(target: Any, ctx: WorkflowContext) -> Any:
    return target(
        tokenizer=ctx.tokenizer,
        gconfig=ctx.gconfig,
        reward_target=ctx.reward.target,
        reward_pool=ctx.reward_pool,
        config=ctx.settings,
    )


def _construct(target: Any, ctx: WorkflowContext, spec: "FactorySpec") -> WorkflowProtocol:
    return from_context(target, ctx, spec, _old_shape, "areal_kernel.api.workflow.Workflow")


KIND = KindContract(
    kind="workflow",
    context=WorkflowContext,
    contract=WorkflowProtocol,
    construct=_construct,
    contract_name="areal_kernel.api.workflow.Workflow (docs/plugin-authoring.md, Workflows)",
    members=("arun_episode", "aevaluate", "reward_calls", "reward_failures"),
)
