"""Kind ``loss`` (``algorithm.loss``; hook ``areal_register_losses``), and the
loss contract every train engine keeps.

The registered target is a function (``PolicyLoss``)::

    loss(logprobs, data, *, entropy, knobs, **settings) -> (loss, stats)

The RL step binds the shared knobs, one frozen ``LossKnobs`` object built
from the validated ``algorithm`` section (``LossKnobs.of(config)``), and the
fields of the loss's validated ``algorithm.<name>`` section (as keywords) to
it and hands the result to ``TrainEngine.train_batch`` as ``loss_fn``; it
ignores keywords it does not know (``**kwargs``). Every knob's default is
the config's (``RLSettings``); ``LossKnobs`` reads it from there. A loss
without a ``knobs`` parameter (the convention before ``LossKnobs``) gets the
knobs as keywords instead, with a ``DeprecationWarning`` naming it, until
the next minor release.

Loss contract (what ``train_batch`` promises ``loss_fn`` and expects back)
--------------------------------------------------------------------------
``loss_fn(logprobs, entropy, data) -> (loss, stats)`` (``LossFn``) is called
once per micro-batch. All tensors are 1-D and aligned with the packed row
(the micro-batch's sequences concatenated):

* ``logprobs[i]`` = log p(token i | tokens before it in its own sequence),
  computed as ``log_softmax(logits / temperature)``; 0.0 at each sequence's
  first token. Carries gradients.
* ``entropy[i]``: entropy of the distribution that produced token i (0.0 at
  sequence starts). Detached unless ``loss_fn.needs_entropy_grad`` is True.
* ``data``: ``input_ids``, ``position_ids``, ``seq_ids`` (batch index of the
  token's trajectory), ``versions`` (int64), and float32 ``loss_mask`` (0/1),
  ``old_logprobs`` (= ``Trajectory.logprobs``, the behaviour policy),
  ``rewards`` (the trajectory reward on every token), ``seq_loss_tokens``
  (loss tokens of the token's trajectory), every key of ``extra`` (e.g.
  ``advantages``, ``prox_logprobs``, ``ref_logprobs``), and two 0-d float32
  tensors describing the *whole batch*: ``batch_loss_tokens`` and
  ``batch_n_seqs``.

``loss`` must be this micro-batch's *share* of the batch loss, i.e. a sum of
per-token terms normalised by batch-level quantities, e.g.
``(tok_loss * loss_mask).sum() / batch_loss_tokens`` (token mean) or
``(tok_loss * loss_mask / seq_loss_tokens).sum() / batch_n_seqs`` (sequence
mean of token means). The engine back-propagates each share and sums them, so
the step does not depend on how the batch was split into micro-batches.
``stats`` follow the same rule: values are summed over micro-batches, except
keys ending in ``_max`` / ``_min`` (max / min). ``LossContract`` of
``areal_kernel.testing`` checks a registered loss under this contract.

``Registry.build("loss", name, LossContext(name, settings))`` checks the
target and returns it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from areal_kernel.api.kinds import KindContract
from areal_kernel.config.knobs import LossKnobs

if TYPE_CHECKING:
    from areal_kernel.plugins.registry import FactorySpec

__all__ = ["PolicyLoss", "LossFn", "LossContext", "LossKnobs", "KIND"]


@runtime_checkable
class PolicyLoss(Protocol):
    """The type of a registered loss."""

    def __call__(
        self, logprobs: Any, data: dict[str, Any], *, entropy: Any, knobs: LossKnobs, **kwargs: Any
    ) -> tuple[Any, dict[str, Any]]: ...


@runtime_checkable
class LossFn(Protocol):
    """What ``TrainEngine.train_batch`` calls per micro-batch (a ``PolicyLoss``
    with its keywords bound; ``areal_kernel.algo.rl.bind_loss``)."""

    def __call__(self, logprobs: Any, entropy: Any, data: dict[str, Any]) -> tuple[Any, dict[str, Any]]: ...


@dataclass(frozen=True)
class LossContext:
    """What a loss is built with: the selected ``name`` and its validated
    ``algorithm.<name>`` section (``None`` without a ``config_model``), which
    the RL step binds as keywords (the shared knobs arrive as ``knobs``)."""

    name: str
    settings: Any = None


def _construct(target: Any, ctx: LossContext, spec: "FactorySpec") -> PolicyLoss:
    return target


KIND = KindContract(
    kind="loss",
    context=LossContext,
    contract=PolicyLoss,
    construct=_construct,
    contract_name="areal_kernel.api.loss.PolicyLoss",
    callable_result=True,
)
