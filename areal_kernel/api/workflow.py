"""Kind ``workflow`` (``workflow.type``; hook ``areal_register_workflows``).

The kernel builds the selected workflow once per run, in the controller,
after the inference servers and the reward pool are up:
``Registry.build("workflow", name, WorkflowContext(...))`` calls
``Workflow.from_context(context)``, whose default is
``cls(tokenizer=..., gconfig=..., reward_target=..., reward_pool=...,
config=settings)``, so a subclass writes that constructor.

Members the kernel uses. Required (``WorkflowProtocol``; ``Registry.build``
checks the four below, and the ``Workflow`` base class gives the counters):

- ``await arun_episode(engine, record) -> TrajectoryGroup | None``: the
  samples of one record as a group (``None`` rejects the record); many run at
  once on the controller's asyncio loop. Every trajectory carries the group's
  ``group_id``; ``loss_mask`` is 1 exactly on generated tokens.
- ``await aevaluate(engine, record, max_new_tokens) -> (reward, text)``: one
  greedy answer for the held-out evaluation.
- ``reward_calls``, ``reward_failures``: reward bookkeeping the trainer reads
  (and restores from recovery checkpoints) to stop a run whose reward keeps
  failing (``RewardScoring`` keeps them).

Optional, with the kernel's default when absent:

- ``required_fields`` (class attribute; ``DEFAULT_REQUIRED_FIELDS``,
  ``("prompt",)``): the record fields it reads; every record is checked for
  them before any server starts.
- ``encode_prompt(record) -> list[int]``: the prompt's token ids, which
  ``areal check`` prints beside each sample. Without it (or when it raises
  ``NotImplementedError``, the ``Workflow`` default) ``areal check`` shows
  the tokens before the first generated token of the record's first
  trajectory.
- ``last_reward_error``: the last failed reward call's error, named when the
  trainer stops a run for failing rewards (``RewardScoring`` keeps it).
- ``close()``: called once when the run's rollout stops, before the servers.

What a trajectory carries for display and metrics (``Trajectory.metadata``,
both optional): ``metadata[COMPLETION_KEY]`` (``"completion"``), the text
``areal check`` prints for the sample (e.g. the last turn; default: its
generated tokens decoded with special tokens skipped), and
``metadata[SAMPLE_METRICS_KEY]`` (``"metrics"``), per-sample numbers logged
as ``workflow/<name>`` means, and ``metadata[SERVER_KEY]`` (``"server"``),
the generating server's address, recorded per trained sample in
``samples.jsonl`` (``Trajectory.from_response`` fills it in).

Rewards: a trajectory's reward comes from the reward calls the workflow made
on its own generated text, combined as the workflow likes (the built-in
``multi_turn`` multiplies the reward of the attempt that ended the episode by
``turn_discount**k``), but within ``[min(0, scores), max(0, scores)]`` of
those calls; 0 when every call failed. ``WorkflowContract`` checks this.
Full text: docs/plugin-authoring.md, "Workflows".
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from areal_kernel.api.io import SERVER_KEY, GenerationConfig, TrajectoryGroup
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
    "SERVER_KEY",
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
    """The members the kernel requires of a built workflow (``Registry.build``
    checks each); the optional ones (``required_fields``, ``encode_prompt``,
    ``last_reward_error``, ``close``) are read with a default, see the module
    docstring."""

    reward_calls: int
    reward_failures: int

    async def arun_episode(self, engine: "InferenceEngine", record: dict[str, Any]) -> TrajectoryGroup | None: ...

    async def aevaluate(
        self, engine: "InferenceEngine", record: dict[str, Any], max_new_tokens: int
    ) -> tuple[float, str]: ...


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
        """The prompt of ``record`` as token ids (``areal check`` prints it).
        Optional: this default raises ``NotImplementedError``, and ``areal
        check`` then shows the tokens the engine was asked to continue."""
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
