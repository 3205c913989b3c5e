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

from typing import TYPE_CHECKING, Sequence

# The types and the record checks are the dataset kind's contract
# (areal_kernel.api.dataset); importable here as before.
from areal_kernel.api.dataset import DatasetSource, DatasetSplits, Record, SourceResult, check_records, check_shape

if TYPE_CHECKING:
    from areal_kernel.config.models import DatasetConfig
    from areal_kernel.plugins.registry import FactorySpec

__all__ = [
    "DatasetSource",
    "Record",
    "SourceResult",
    "check_shape",
    "check_records",
    "load_dataset",
    "finish_dataset",
]


def load_dataset(
    spec: "FactorySpec", config: "DatasetConfig", seed: int, required: Sequence[str], needed_by: str
) -> tuple[list[Record], list[Record]]:
    """Call the source ``spec`` under the contract above and check its records
    (what ``Registry.build("dataset", ...)`` followed by ``finish_dataset`` does)."""
    from areal_kernel.api.dataset import DatasetContext, check_source_result
    from areal_kernel.plugins.blame import spec_origin

    ctx = DatasetContext(name=spec.name, config=config, seed=seed, required=tuple(required), needed_by=needed_by)
    result = spec.load()(config, seed, tuple(required))
    return finish_dataset(check_source_result(result, spec.name, spec_origin(spec), ctx), spec, config, seed)


def finish_dataset(
    splits: DatasetSplits, spec: "FactorySpec", config: "DatasetConfig", seed: int
) -> tuple[list[Record], list[Record]]:
    """The rest of the contract after ``Registry.build("dataset", ...)``
    checked the shape and the records: every record's images (missing
    files, sizes over the limits, counts that do not fit the prompt), then
    ``dataset.eval_fraction`` held out of a plain list (seeded by ``seed``)."""
    from areal_kernel.plugins.blame import spec_origin

    origin = spec_origin(spec)
    parts = [(splits.train, "train" if splits.eval is not None else None)]
    if splits.eval is not None:
        parts.append((splits.eval, "eval"))
    for records, split in parts:
        if any("images" in r for r in records):
            # Fails here, naming the record, before any server starts.
            from areal_kernel.data.images import check_records_images

            check_records_images(records, origin=f"{origin}{f' ({split})' if split else ''}")
    if splits.eval is not None:
        return splits.train, splits.eval
    if config.eval_fraction <= 0:
        return splits.train, []
    from areal_kernel.data.split import train_eval_split

    return train_eval_split(splits.train, config.eval_fraction, seed)
