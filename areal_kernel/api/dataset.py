"""Kind ``dataset`` (``dataset.type``; hook ``areal_register_datasets``).

The target is a function (``DatasetSource``) called in the controller,
before any server starts, as ``source(config, seed, required)``; it returns a
list of record dicts or a ``(train, eval)`` tuple of two such lists. The full
contract (record fields, ids, images, the held-out split) is the docstring of
``areal_kernel.data.contract``.

``Registry.build("dataset", name, DatasetContext(...))`` calls the source,
checks what it returned and every record under that contract (one
``DataError`` naming the dataset, its plugin and the record) and returns the
``DatasetSplits``; ``areal_kernel.data.contract.finish_dataset`` then checks
records' images and holds out ``dataset.eval_fraction`` of a plain list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Sequence, Union

from areal_kernel.api.kinds import KindContract, origin
from areal_kernel.errors import DataError

if TYPE_CHECKING:
    from areal_kernel.config.models import DatasetConfig
    from areal_kernel.plugins.registry import FactorySpec

__all__ = [
    "DatasetSource",
    "Record",
    "SourceResult",
    "DatasetContext",
    "DatasetSplits",
    "check_shape",
    "check_records",
    "check_source_result",
    "KIND",
]

Record = dict[str, Any]
SourceResult = Union[list[Record], tuple[list[Record], list[Record]]]


class DatasetSource(Protocol):
    """The type of a registered dataset target (contract: ``areal_kernel.data.contract``)."""

    def __call__(self, config: "DatasetConfig", seed: int, required: tuple[str, ...]) -> SourceResult: ...


def check_shape(result: Any, *, origin: str) -> None:
    """A list, or a 2-tuple of lists; anything else is a ``DataError``
    naming ``origin`` (the dataset and its plugin)."""
    if isinstance(result, list):
        return
    if isinstance(result, tuple) and len(result) == 2 and all(isinstance(part, list) for part in result):
        return
    if isinstance(result, tuple):
        shape = f"a tuple of {len(result)} ({', '.join(type(p).__name__ for p in result[:4])})"
    else:
        shape = f"a {type(result).__name__}"
    raise DataError(
        f"{origin} returned {shape}; a dataset source must return a list of record dicts "
        f"or a (train, eval) tuple of two such lists (see docs/plugin-authoring.md, 'Datasets')"
    )


def check_records(
    records: Sequence[Any], *, split: str | None, dataset: str, origin: str, required: Sequence[str], needed_by: str
) -> list[Record]:
    """Validated copies of ``records`` with string ids, generated where
    absent. ``split`` is ``"train"``/``"eval"`` for the parts of a
    ``(train, eval)`` tuple and ``None`` for a plain list (indexes are then
    positions in that list). ``needed_by`` names who reads ``required``
    (``workflow 'rlvr'``) for the message."""
    out: list[Record] = []
    seen: dict[str, int] = {}
    label = f"{split} record" if split else "record"
    id_prefix = f"{dataset}:{split}" if split else dataset
    for i, rec in enumerate(records):
        where = f"{origin}: {label} {i}"
        if not isinstance(rec, dict):
            raise DataError(f"{where} is a {type(rec).__name__}, expected a dict of fields")
        for name in required:
            value = rec.get(name)
            if name not in rec:
                raise DataError(
                    f"{where} has no {name!r} field, which {needed_by} needs (required: {list(required)}); "
                    f"its fields: {sorted(map(str, rec))}"
                )
            if value is None or (isinstance(value, (str, list, dict)) and len(value) == 0):
                raise DataError(f"{where} has an empty {name!r} field, which {needed_by} needs")
        rec = dict(rec)
        rid = rec.get("id")
        rec["id"] = f"{id_prefix}:{i}" if rid is None or rid == "" else str(rid)
        first = seen.setdefault(rec["id"], i)
        if first != i:
            raise DataError(
                f"{origin}: {label}s {first} and {i} both have id {rec['id']!r}; ids must be unique "
                f"(the samples of a prompt are grouped by id), or leave 'id' out to get generated ones"
            )
        out.append(rec)
    return out


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
    - ``origin``: how errors name the dataset and its plugin (the kernel
      passes ``dataset 'x' of plugin 'p' (dist 1.0)``); empty: the kind,
      name and plugin from the registration.
    """

    name: str
    config: "DatasetConfig"
    seed: int
    required: tuple[str, ...] = ("prompt",)
    needed_by: str = "the run"
    origin: str = ""


@dataclass(frozen=True)
class DatasetSplits:
    """What ``Registry.build("dataset", ...)`` returns: the source's records,
    shape and records checked (string ids, required fields present).

    - ``train``: the training records, or every record when the source
      returned a plain list;
    - ``eval``: the held-out records of a ``(train, eval)`` tuple, or
      ``None`` when the source returned a plain list: the kernel then holds
      out ``dataset.eval_fraction`` of ``train``
      (``areal_kernel.data.contract.finish_dataset``, which also checks
      records' images).
    """

    train: list[Record]
    eval: list[Record] | None


def check_source_result(result: Any, name: str, origin: str, ctx: DatasetContext) -> DatasetSplits:
    """``result`` (what source ``name`` returned) checked under the contract:
    its shape, then every record; ``origin`` names the dataset and its plugin
    in errors."""
    check_shape(result, origin=origin)

    def check(part: Sequence[Any], split: str | None) -> list[Record]:
        return check_records(
            part, split=split, dataset=name, origin=origin, required=ctx.required, needed_by=ctx.needed_by
        )

    if isinstance(result, tuple):
        return DatasetSplits(train=check(result[0], "train"), eval=check(result[1], "eval"))
    # Checked before any split, so that an index is a position in the list the source returned.
    return DatasetSplits(train=check(result, None), eval=None)


def _construct(target: Any, ctx: DatasetContext, spec: "FactorySpec") -> DatasetSplits:
    result = target(ctx.config, ctx.seed, ctx.required)
    return check_source_result(result, spec.name, ctx.origin or origin(spec), ctx)


KIND = KindContract(
    kind="dataset",
    context=DatasetContext,
    contract=DatasetSource,
    construct=_construct,
    contract_name="areal_kernel.data.contract",
    check=lambda obj: [],  # _construct checked the records
)
