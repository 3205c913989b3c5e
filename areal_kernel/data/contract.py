"""The dataset contract: what a registered dataset source is called with,
what it may return, and the checks every record passes before a run starts.

A source (``dataset.type: <name>``) is called in the controller as::

    source(config, seed, required) -> list[Record] | tuple[list[Record], list[Record]]

- ``config``: the validated ``dataset`` section (``DatasetConfig``); the
  source's own settings (``dataset.<name>: {...}``, validated against its
  ``config_model``) are ``config.plugin_config`` (``None`` without a model).
- ``seed``: the run's ``seed``.
- ``required``: the record fields the selected workflow (or offline trainer)
  reads, e.g. ``("prompt", "answer")`` for ``rlvr``. A source may use it to
  fail early with its own message; the kernel checks them anyway.

A plain list is the training pool: the kernel holds out
``dataset.eval_fraction`` of it (seeded by ``seed``) for evaluation. A
``(train, eval)`` tuple is used as given.

Every record must be a ``dict`` with each ``required`` field present and
non-empty. ``id`` is optional: a record without one gets
``"<dataset name>:<index>"`` (its position in a returned list) or
``"<dataset name>:<train|eval>:<index>"`` (its position in that part of a
returned tuple); ids become strings and must be unique within the list
(within each part of a tuple), because the samples of one prompt are
grouped (and their advantages normalised) by id. A violation is one
``DataError`` naming the dataset, its plugin and the record's index (as
above), raised before any server starts.

A record may carry ``images``: a list of image file paths or encoded image
bytes (``areal_kernel.data.images``); they are checked here too (files
exist, readable, within the size limits, as many as the prompt's
``<image>`` markers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Sequence, Union

from areal_kernel.errors import DataError

if TYPE_CHECKING:
    from areal_kernel.config.models import DatasetConfig
    from areal_kernel.plugins.registry import FactorySpec

Record = dict[str, Any]
SourceResult = Union[list[Record], tuple[list[Record], list[Record]]]


class DatasetSource(Protocol):
    """The type of a registered dataset target (see the module docstring)."""

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


def load_dataset(
    spec: "FactorySpec", config: "DatasetConfig", seed: int, required: Sequence[str], needed_by: str
) -> tuple[list[Record], list[Record]]:
    """Call the source ``spec`` under the contract above and check its records."""
    return call_source(spec.load(), spec, config, seed, required, needed_by)


def call_source(
    source: Any, spec: "FactorySpec", config: "DatasetConfig", seed: int, required: Sequence[str], needed_by: str
) -> tuple[list[Record], list[Record]]:
    """``source`` (the loaded target of ``spec``) called under the contract
    above: its result's shape and every record checked, the held-out split
    made. What ``Registry.build("dataset", ...)`` runs."""
    from areal_kernel.plugins.blame import spec_origin

    origin = spec_origin(spec)
    result = source(config, seed, tuple(required))
    check_shape(result, origin=origin)

    def check(part: Sequence[Any], split: str | None) -> list[Record]:
        checked = check_records(
            part, split=split, dataset=spec.name, origin=origin, required=tuple(required), needed_by=needed_by
        )
        if any("images" in r for r in checked):
            # Missing files, images over the limits and image counts that do
            # not fit the prompt fail here, naming the record, before any server starts.
            from areal_kernel.data.images import check_records_images

            check_records_images(checked, origin=f"{origin}{f' ({split})' if split else ''}")
        return checked

    if isinstance(result, tuple):
        return check(result[0], "train"), check(result[1], "eval")
    # Checked before the split, so that an index is a position in the list the source returned.
    records = check(result, None)
    if config.eval_fraction <= 0:
        return records, []
    from areal_kernel.data.split import train_eval_split

    return train_eval_split(records, config.eval_fraction, seed)
