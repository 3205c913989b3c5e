"""Kind ``reward`` (``reward.type``; hook ``areal_register_rewards``).

The target is a function ``fn(completion: str, answer: str, **settings) ->
float`` (``RewardFunction``), run in the kernel's reward worker processes with
its timeout: ``completion`` is the decoded sample (special tokens skipped),
``answer`` the record's ``answer`` as a string, ``settings`` every field of
the validated ``reward.<name>`` section as JSON values (nothing without a
``config_model``).

``Registry.build("reward", name, RewardContext(name, settings))`` checks the
target and returns a ``Reward``: the function with its settings bound, plus
what the kernel needs to run it elsewhere (the import string the reward pool
sends to its workers, ``worker_preload``, ``success_threshold``). The kernel
holds the run's reward as this object; ``reward(completion, answer)`` scores
one sample in this process (contract suites, tests).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

from areal_kernel.api.kinds import KindContract, settings_fields

if TYPE_CHECKING:
    from areal_kernel.plugins.registry import FactorySpec

__all__ = ["RewardFunction", "RewardContext", "Reward", "DEFAULT_SUCCESS_THRESHOLD", "KIND"]

# What a reward that declares no success_threshold counts as solved (eval/accuracy).
DEFAULT_SUCCESS_THRESHOLD = 1.0


@runtime_checkable
class RewardFunction(Protocol):
    """The type of a registered reward target."""

    def __call__(self, completion: str, answer: str, **settings: Any) -> float: ...


@dataclass(frozen=True)
class RewardContext:
    """What the kernel builds a reward with.

    - ``name``: the selected ``reward.type``.
    - ``settings``: the validated ``reward.<name>`` section (an instance of
      its ``config_model``), a mapping, or ``None`` without one.
    """

    name: str
    settings: Any = None


@dataclass(frozen=True)
class Reward:
    """The run's reward, built: ``fn`` with ``settings`` bound.

    - ``target``: the registered ``"pkg.module:fn"``; the reward pool imports
      it in its workers, and workflows pass it to ``pool.ascore``.
    - ``settings``: the keywords every call receives, as JSON values (what
      crosses into a worker process).
    - ``success_threshold``: a sample whose reward reaches it counts as
      solved (``eval/accuracy``); ``DEFAULT_SUCCESS_THRESHOLD`` unless the
      registration declared one.
    - ``worker_preload``: what each reward worker loads before its first sample.
    """

    name: str
    target: str
    plugin: str
    # Callable[..., float]: a reward declares its settings as keyword
    # parameters, which a Protocol with **settings would refuse.
    fn: Callable[..., float]
    settings: dict[str, Any] = field(default_factory=dict)
    success_threshold: float = DEFAULT_SUCCESS_THRESHOLD
    worker_preload: tuple[str, ...] = ()

    def __call__(self, completion: str, answer: str) -> float:
        """Score one sample in this process, the way a reward worker does."""
        return float(self.fn(completion, str(answer), **self.settings))


def json_settings(settings: Any) -> dict[str, Any]:
    """Validated settings as the JSON values a reward worker receives
    (``model_dump(mode="json")``: every field, defaults included)."""
    if settings is None:
        return {}
    dump = getattr(settings, "model_dump", None)
    if callable(dump):
        return dict(dump(mode="json"))
    return dict(settings_fields(settings))


def _construct(target: Any, ctx: RewardContext, spec: "FactorySpec") -> Reward:
    return Reward(
        name=spec.name,
        target=spec.target,
        plugin=spec.plugin,
        fn=target,
        settings=json_settings(ctx.settings),
        success_threshold=DEFAULT_SUCCESS_THRESHOLD if spec.success_threshold is None else spec.success_threshold,
        worker_preload=tuple(spec.worker_preload),
    )


KIND = KindContract(
    kind="reward",
    context=RewardContext,
    contract=RewardFunction,
    construct=_construct,
    contract_name="areal_kernel.api.reward.RewardFunction (docs/plugin-authoring.md, Rewards)",
    check=lambda obj: [] if callable(obj.fn) else ["__call__"],
)
