"""Kind ``dataset`` (``dataset.type``; hook ``areal_register_datasets``).

The target is a function (``DatasetSource``) called in the controller,
before any server starts, as ``source(config, seed, required)``; it returns a
list of record dicts or a ``(train, eval)`` tuple of two such lists. The full
contract (record fields, ids, images, the held-out split) is the docstring of
``areal_kernel.data.contract``.

``Registry.build("dataset", name, DatasetContext(...))`` calls the source,
checks what it returned and every record under that contract (one
``DataError`` naming the dataset, its plugin and the record), holds out
``dataset.eval_fraction`` of a plain list, and returns the
``DatasetSplits``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from areal_kernel.api.kinds import KindContract
from areal_kernel.data.contract import DatasetSource, Record

if TYPE_CHECKING:
    from areal_kernel.config.models import DatasetConfig
    from areal_kernel.plugins.registry import FactorySpec

__all__ = ["DatasetSource", "Record", "DatasetContext", "DatasetSplits", "KIND"]


@dataclass(frozen=True)
class DatasetContext:
    """What a dataset source is called with.

    - ``name``: the selected ``dataset.type``.
    - ``config``: the validated ``dataset`` section (``DatasetConfig``); the
      source's own settings are ``config.plugin_config``.
    - ``seed``: the run's ``seed`` (the held-out split is seeded by it too).
    - ``required``: the record fields the reader needs (the workflow's
      ``required_fields``, or an offline trainer's).
    - ``needed_by``: who reads them, for messages (``"workflow 'rlvr'"``).
    """

    name: str
    config: "DatasetConfig"
    seed: int
    required: tuple[str, ...] = ("prompt",)
    needed_by: str = "the run"


@dataclass(frozen=True)
class DatasetSplits:
    """A dataset's checked records: ``train`` and the held-out ``eval`` part."""

    train: list[Record]
    eval: list[Record]


def _construct(target: Any, ctx: DatasetContext, spec: "FactorySpec") -> DatasetSplits:
    from areal_kernel.data.contract import call_source

    train, evals = call_source(target, spec, ctx.config, ctx.seed, ctx.required, ctx.needed_by)
    return DatasetSplits(train=train, eval=evals)


KIND = KindContract(
    kind="dataset",
    context=DatasetContext,
    contract=DatasetSource,
    construct=_construct,
    contract_name="areal_kernel.data.contract",
    check=lambda obj: [],  # _construct checked the records
)
