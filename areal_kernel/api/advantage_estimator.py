"""Kind ``advantage_estimator`` (``algorithm.advantage``; hook ``areal_register_advantage_estimators``).

The target is a function (``AdvantageEstimator``) called in the controller
once per training batch as::

    est(rewards, group_ids, *, loss_masks, token_rewards, values, knobs, **settings)

returning one advantage per trajectory, one row per trajectory (a value per
token) or an ``areal_kernel.algo.estimators.AdvantageResult``. ``knobs`` is
one frozen ``AdvantageKnobs`` object built from the validated ``algorithm``
section (``AdvantageKnobs.of(config)``: ``gamma``, ``lam``, ``adv_norm``,
``std_normalize``, ``adv_eps``, each with the config's default, read from
``RLSettings``); ``settings`` are the fields of its validated
``algorithm.<name>`` section. It takes and ignores keywords it does not know
(``**kwargs``). An estimator without a ``knobs`` parameter (the convention
before ``AdvantageKnobs``) gets the knobs as keywords instead (``gamma``,
``lam``, ``norm``, ``std_normalize``, ``eps``), with a
``DeprecationWarning`` naming it, until the next minor release. Registered with capability
``needs_values``, it gets per-token critic ``values`` and returns an
``AdvantageResult`` with returns. The full contract: docs/plugin-authoring.md,
"Advantage estimators and losses" (checked by
``AdvantageEstimatorContract``).

``Registry.build("advantage_estimator", name, AdvantageEstimatorContext(name,
settings))`` checks the target and returns it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Sequence, runtime_checkable

from areal_kernel.api.kinds import KindContract
from areal_kernel.config.knobs import AdvantageKnobs

if TYPE_CHECKING:
    from areal_kernel.plugins.registry import FactorySpec

__all__ = ["AdvantageEstimator", "AdvantageEstimatorContext", "AdvantageKnobs", "NEEDS_VALUES", "KIND"]

# The capability of an estimator that needs critic values (the run then trains a critic).
NEEDS_VALUES = "needs_values"


@runtime_checkable
class AdvantageEstimator(Protocol):
    """The type of a registered advantage estimator."""

    def __call__(
        self,
        rewards: Sequence[float],
        group_ids: Sequence[str],
        *,
        loss_masks: Any,
        knobs: AdvantageKnobs,
        **kwargs: Any,
    ) -> Any: ...


@dataclass(frozen=True)
class AdvantageEstimatorContext:
    """What an estimator is built with: the selected ``name`` and its
    validated ``algorithm.<name>`` section (``None`` without a ``config_model``),
    which the RL step passes as keywords on every call (the shared knobs
    arrive as ``knobs``)."""

    name: str
    settings: Any = None


def _construct(target: Any, ctx: AdvantageEstimatorContext, spec: "FactorySpec") -> AdvantageEstimator:
    return target


KIND = KindContract(
    kind="advantage_estimator",
    context=AdvantageEstimatorContext,
    contract=AdvantageEstimator,
    construct=_construct,
    contract_name="areal_kernel.api.advantage_estimator.AdvantageEstimator",
    callable_result=True,
)
