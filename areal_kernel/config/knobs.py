"""The RL knobs a loss and an advantage estimator receive, as two frozen objects.

``LossKnobs`` and ``AdvantageKnobs`` are built once per RL step from the
validated ``algorithm`` settings (``of(settings)``) and passed whole, as
``knobs=``, to every loss and estimator. Each field *is* the ``RLSettings``
field of the same name: its type, bounds, description and default are read
from there, so the config's default is the only default (no function
signature restates one). ``LossKnobs()`` / ``AdvantageKnobs()`` are the
defaults of an unset ``algorithm:`` section.

A loss or estimator written before the knobs objects (no ``knobs``
parameter) still gets the knobs as keywords, with a ``DeprecationWarning``
naming it, until the next minor release: ``legacy_keywords`` is that
mapping, and ``LEGACY_*_KEYWORDS`` the names it uses, which a plugin's own
settings may not take while the old calling convention lives.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable, Literal, TypeVar

from pydantic import BaseModel, ConfigDict

from areal_kernel.config.models import RLSettings
from areal_kernel.errors import ArealDeprecationWarning

__all__ = [
    "LossKnobs",
    "AdvantageKnobs",
    "LOSS_CALL_KEYWORDS",
    "ESTIMATOR_CALL_KEYWORDS",
    "LEGACY_LOSS_KEYWORDS",
    "LEGACY_ESTIMATOR_KEYWORDS",
    "legacy_keywords",
    "knobs_with",
    "old_keywords_attribute",
]


def _setting(name: str) -> Any:
    # The RLSettings field itself (default, bounds, description): written once, there.
    return copy.copy(RLSettings.model_fields[name])


K = TypeVar("K", bound="_Knobs")


class _Knobs(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    @classmethod
    def of(cls: type[K], settings: RLSettings) -> K:
        """The knobs of validated ``algorithm`` settings (an ``AlgorithmConfig``
        or an ``RLConfig``)."""
        return cls(**{name: getattr(settings, name) for name in cls.model_fields})


class LossKnobs(_Knobs):
    """The shared knobs of the policy loss (``algorithm.<field>``).

    ``kl_coef`` is the weight of the KL term *in the loss*: ``of`` sets it to
    0 when ``algorithm.kl_in`` is ``reward`` (the KL then goes into the
    rewards, before the estimator)."""

    eps_clip: float = _setting("eps_clip")
    eps_clip_high: float | None = _setting("eps_clip_high")
    dual_clip: float | None = _setting("dual_clip")
    ratio_level: Literal["token", "sequence"] = _setting("ratio_level")
    behav_imp_weight_cap: float | None = _setting("behav_imp_weight_cap")
    behav_imp_weight_mode: Literal["mask", "clamp"] = _setting("behav_imp_weight_mode")
    kl_coef: float = _setting("kl_coef")
    kl_estimator: Literal["k1", "k2", "k3"] = _setting("kl_estimator")
    entropy_coef: float = _setting("entropy_coef")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = _setting("loss_agg")

    @classmethod
    def of(cls, settings: RLSettings) -> "LossKnobs":
        knobs = super().of(settings)
        return knobs if settings.kl_in == "loss" else knobs.model_copy(update={"kl_coef": 0.0})


class AdvantageKnobs(_Knobs):
    """The shared knobs of the advantage estimator (``algorithm.<field>``).
    ``adv_norm`` ``None`` means the estimator's own normalisation level."""

    gamma: float = _setting("gamma")
    lam: float = _setting("lam")
    adv_norm: Literal["group", "batch", "none"] | None = _setting("adv_norm")
    std_normalize: bool = _setting("std_normalize")
    adv_eps: float = _setting("adv_eps")


# Per-call inputs besides the positional ones (they are data, not knobs).
LOSS_CALL_KEYWORDS = ("entropy", "knobs")
ESTIMATOR_CALL_KEYWORDS = ("loss_masks", "token_rewards", "values", "knobs")

# The keyword name of a knob in the old calling convention, where it differs from the field's.
_LEGACY_NAMES = {"adv_norm": "norm", "adv_eps": "eps"}


def legacy_keywords(knobs: _Knobs) -> dict[str, Any]:
    """``knobs`` as the keywords of the old calling convention (deprecated;
    ``AdvantageKnobs.adv_norm`` / ``adv_eps`` are ``norm`` / ``eps`` there)."""
    return {_LEGACY_NAMES.get(name, name): getattr(knobs, name) for name in type(knobs).model_fields}


def knobs_with(cls: type[K], knobs: K | None, keywords: dict[str, Any]) -> K:
    """``knobs`` (default: ``cls()``, the config's defaults) with the entries
    of ``keywords`` that name one of its knobs (by field name or old keyword
    name) put in; other keywords are ignored. How a built-in loss or
    estimator takes both ``knobs=`` and the old keywords of a direct caller.
    Not validated again: the function checks its values itself."""
    base = cls() if knobs is None else knobs
    fields = {_LEGACY_NAMES.get(name, name): name for name in cls.model_fields} | {n: n for n in cls.model_fields}
    update = {fields[key]: value for key, value in keywords.items() if key in fields}
    return base.model_copy(update=update) if update else base


LEGACY_LOSS_KEYWORDS = tuple(legacy_keywords(LossKnobs()))
LEGACY_ESTIMATOR_KEYWORDS = tuple(legacy_keywords(AdvantageKnobs()))


def old_keywords_attribute(
    module: str, name: str, who: str, knobs: type[BaseModel], api: str, value: tuple[str, ...]
) -> Callable[[str], Any]:
    """A module ``__getattr__`` that still serves ``<module>.<name>``: the
    keywords ``who`` took before the knobs objects, now ``knobs`` (documented
    in ``api``), with an ``ArealDeprecationWarning`` at the caller."""

    def __getattr__(attr: str) -> Any:
        if attr != name:
            raise AttributeError(f"module {module!r} has no attribute {attr!r}")
        cls = knobs.__name__
        warnings.warn(
            f"{module}.{name} is deprecated: {who} takes knobs= ({api}.{cls}); the names are {cls}.model_fields",
            ArealDeprecationWarning,
            stacklevel=2,
        )
        return value

    return __getattr__
