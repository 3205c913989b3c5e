"""Load prompt datasets as plain records (``list[dict]``) through HF ``datasets``.

A source is a local ``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv`` file, a
local directory of such files (split names from the file names, as
``datasets`` infers them), or a Hub dataset id ``owner/name``. Records come
back with canonical field names (``prompt``, ``answer``, ``id``,
``messages``...) and a stable ``id``. Every problem is a ``DataError`` that
names the source, the field and what would be valid.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any, Sequence

from areal_kernel.errors import ConfigError, DataError

# File suffix -> the ``datasets`` builder that reads it.
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
CANONICAL_FIELDS = ("id", "prompt", "answer", "messages", "solution", "metadata")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def load_records(
    source: str,
    *,
    split: str = "train",
    field_map: dict[str, str] | None = None,
    required: Sequence[str] = ("prompt",),
    limit: int | None = None,
    subset: str | None = None,
) -> list[dict[str, Any]]:
    """Read ``source`` and return its ``split`` as a list of dicts.

    ``field_map`` renames source fields to canonical ones
    (``{"question": "prompt"}``); ``required`` fields must exist and be
    non-empty in every record; ``limit`` keeps the first N records; ``subset``
    is the Hub dataset configuration name. Records without an ``id`` get
    ``"<basename>:<index>"`` (directory and Hub sources, which have several
    splits, get ``"<basename>:<split>:<index>"``). A numeric ``answer`` becomes
    a string, since rewards compare text.
    """
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ConfigError(f"limit must be a positive integer or None, got {limit!r}")
    ds, single_file = _load_split(source, split, subset)
    if len(ds) == 0:
        raise DataError(f"dataset {source!r} (split {split!r}) is empty: it has no records")
    ds = _rename(ds, source, field_map or {})
    if limit is not None and limit < len(ds):
        ds = ds.select(range(limit))
    _check_required(ds, source, list(required))
    base = os.path.basename(os.path.normpath(source)) or source
    prefix = base if single_file else f"{base}:{split}"
    records: list[dict[str, Any]] = []
    for i, row in enumerate(ds):
        rec = dict(row)
        _check_row(rec, i, source, list(required))
        if isinstance(rec.get("answer"), (int, float)) and not isinstance(rec["answer"], bool):
            rec["answer"] = str(rec["answer"])  # rewards compare text; JSON/CSV may type it as a number
        if rec.get("id") is None or rec.get("id") == "":
            rec["id"] = f"{prefix}:{i}"
        else:
            rec["id"] = str(rec["id"])
        records.append(rec)
    _check_unique_ids(records, source)
    return records


# -- loading -----------------------------------------------------------------


def _load_split(source: str, split: str, subset: str | None) -> tuple[Any, bool]:
    """``(dataset, is_single_file)`` for one split of ``source``."""
    if not isinstance(source, str) or not source.strip():
        raise ConfigError(f"dataset source must be a file, directory or Hub id, got {source!r}")
    path = os.path.expanduser(source)
    if os.path.isfile(path):
        return _load_file(path, split), True
    if os.path.isdir(path):
        return _load_dir(path, split), False
    suffix = os.path.splitext(path)[1].lower()
    if suffix in FORMATS or os.path.isabs(path) or path.startswith((".", "~")) or not _HUB_ID.match(source):
        raise DataError(
            f"dataset file {source!r} does not exist (cwd {os.getcwd()}); give an existing "
            f"{'/'.join(FORMATS)} file, a directory of them, or a Hub id 'owner/name'"
        )
    return _load_hub(source, split, subset), False


def _datasets() -> Any:
    import datasets

    datasets.disable_progress_bars()
    return datasets


def _load_file(path: str, split: str) -> Any:
    suffix = os.path.splitext(path)[1].lower()
    builder = FORMATS.get(suffix)
    if builder is None:
        raise DataError(
            f"dataset file {path!r} has unsupported extension {suffix or '(none)'!r}; supported: {', '.join(FORMATS)}"
        )
    if split != "train":
        # One file is one split; datasets names it "train".
        raise DataError(
            f"dataset file {path!r} has a single split 'train', not {split!r}; "
            "use split='train' or a directory with <split>.jsonl files"
        )
    if os.path.getsize(path) == 0 or (builder != "parquet" and not _has_text(path)):
        raise DataError(f"dataset file {path!r} is empty: it has no records")
    ds_lib = _datasets()
    # datasets logs parser failures itself (twice, at ERROR); we raise our own
    # one-line diagnosis instead, so silence its logger while it reads.
    ds_logger = logging.getLogger("datasets")
    old_level = ds_logger.level
    ds_logger.setLevel(logging.CRITICAL)
    try:
        return ds_lib.load_dataset(builder, data_files={"train": path}, split="train")
    except Exception as exc:  # datasets wraps parser errors in several types
        raise _diagnose(path, builder, exc) from exc
    finally:
        ds_logger.setLevel(old_level)


def _load_dir(path: str, split: str) -> Any:
    files = sorted(f for f in os.listdir(path) if os.path.splitext(f)[1].lower() in FORMATS)
    if not files:
        raise DataError(
            f"dataset directory {path!r} has no {'/'.join(FORMATS)} files "
            f"(it contains: {sorted(os.listdir(path))[:10]})"
        )
    try:
        dd = _datasets().load_dataset(path)
    except Exception as exc:
        raise DataError(f"could not read dataset directory {path!r}: {type(exc).__name__}: {exc}") from exc
    if split not in dd:
        raise DataError(f"dataset directory {path!r} has no split {split!r}; available splits: {sorted(dd)}")
    return dd[split]


def _load_hub(name: str, split: str, subset: str | None) -> Any:
    ds_lib = _datasets()
    try:
        dd = ds_lib.load_dataset(name, subset)
    except Exception as exc:
        raise DataError(
            f"dataset {name!r} could not be fetched from the Hugging Face Hub and is not a local path "
            f"({type(exc).__name__}: {exc}). A local file works: download it elsewhere and pass a "
            f"{'/'.join(FORMATS)} path (set HF_HUB_OFFLINE=1 to fail fast without network)"
        ) from exc
    if split not in dd:
        raise DataError(f"dataset {name!r} has no split {split!r}; available splits: {sorted(dd)}")
    return dd[split]


def _has_text(path: str) -> bool:
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 16):
            if chunk.strip():
                return True
    return False


def _diagnose(path: str, builder: str, exc: Exception) -> DataError:
    """Turn a parser failure into a message that points at the bad line."""
    if builder == "csv":
        with open(path, encoding="utf-8", errors="replace") as fh:
            if sum(1 for line in fh if line.strip()) <= 1:
                return DataError(f"dataset file {path!r} is empty: it has a header line at most, no records")
    if path.lower().endswith(".jsonl"):
        with open(path, encoding="utf-8", errors="replace") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as jerr:
                    return DataError(
                        f"dataset file {path!r}: line {lineno} is not valid JSON ({jerr.msg}): {line[:80]!r}"
                    )
                if not isinstance(value, dict):
                    return DataError(
                        f"dataset file {path!r}: line {lineno} is a JSON {type(value).__name__}, expected an object"
                    )
    cause = exc.__cause__ or exc.__context__ or exc
    return DataError(f"could not read dataset file {path!r} as {builder}: {type(cause).__name__}: {cause}")


# -- fields ------------------------------------------------------------------


def _rename(ds: Any, source: str, field_map: dict[str, str]) -> Any:
    cols = list(ds.column_names)
    missing = [src for src in field_map if src not in cols]
    if missing:
        raise DataError(
            f"dataset {source!r}: field_map names source field(s) {missing} that do not exist; fields present: {cols}"
        )
    clashes = [dst for src, dst in field_map.items() if dst in cols and dst not in field_map and dst != src]
    if clashes:
        raise DataError(
            f"dataset {source!r}: field_map target(s) {clashes} already exist as fields; "
            f"map them away too or pick other names (fields present: {cols})"
        )
    mapping = {s: d for s, d in field_map.items() if s != d}
    return ds.rename_columns(mapping) if mapping else ds


def _check_required(ds: Any, source: str, required: list[str]) -> None:
    cols = list(ds.column_names)
    missing = [f for f in required if f not in cols]
    if missing:
        raise DataError(
            f"dataset {source!r} lacks required field(s) {missing}; fields present: {cols}. "
            f"Rename a field with field_map, e.g. field_map={{'{_rename_candidate(cols, required)}': '{missing[0]}'}}"
        )


def _rename_candidate(cols: list[str], required: list[str]) -> str:
    # Suggest renaming a field the workflow does not already need.
    spare = [c for c in cols if c not in required]
    return spare[0] if spare else "question"


def _check_row(rec: dict[str, Any], index: int, source: str, required: list[str]) -> None:
    for f in required:
        value = rec.get(f)
        if value is None or (isinstance(value, (str, list)) and len(value) == 0):
            raise DataError(f"dataset {source!r}: record {index} has an empty or missing {f!r} field")


def _check_unique_ids(records: list[dict[str, Any]], source: str) -> None:
    seen: dict[str, int] = {}
    for i, rec in enumerate(records):
        j = seen.setdefault(rec["id"], i)
        if j != i:
            raise DataError(
                f"dataset {source!r}: field 'id' must be unique, but records {j} and {i} both have id {rec['id']!r}"
            )
