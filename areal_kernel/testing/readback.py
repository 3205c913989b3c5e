"""Read back what the built-in metric sinks wrote, from their own files and
formats (never from anything a sink reports about itself): what a
``MetricSinkContract`` subclass's ``read_back`` returns, and what the
end-to-end tests compare with ``metrics.jsonl``.

Each reader returns ``{step: {key: value}}``; rows of one step logged in
several calls are merged, later values winning.
"""

from __future__ import annotations

import glob
import json
import os
import re
import struct
from typing import Any, Iterator

Rows = dict[int, dict[str, Any]]


def jsonl_rows(path: str) -> Rows:
    """The rows of a ``metrics.jsonl`` written by the ``jsonl`` sink."""
    rows: Rows = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                rows.setdefault(int(row["step"]), {}).update(row)
    return rows


def console_rows(text: str) -> Rows:
    """The values the ``console`` sink printed (3 decimals), by metric key."""
    from areal_kernel.metrics.sinks import ConsoleSink

    by_label = dict(ConsoleSink.KEYS)
    rows: Rows = {}
    for line in text.splitlines():
        m = re.search(r"step (\d+)(?:/\d+)?\s+(.*)$", line)
        if not m:
            continue
        row = rows.setdefault(int(m.group(1)), {})
        for label, value in re.findall(r"([\w/]+) (-?[\d.]+|nan|inf|-inf)", m.group(2)):
            if label in by_label:
                row[by_label[label]] = float(value)
    return rows


def tensorboard_rows(log_dir: str) -> Rows:
    """Scalars of every event file under ``log_dir`` (the ``tensorboard`` sink's)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows: Rows = {}
    for path in sorted(glob.glob(os.path.join(log_dir, "**", "events.out.tfevents.*"), recursive=True)):
        acc = EventAccumulator(path, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            for ev in acc.Scalars(tag):
                rows.setdefault(int(ev.step), {})[tag] = float(ev.value)
    return rows


def _wandb_records(run_file: str) -> Iterator[Any]:
    """The protobuf ``Record`` messages of a ``run-<id>.wandb`` file.

    The file is wandb's LevelDB-style log: a 7-byte header (``:W&B``, magic,
    version), then 32 KiB blocks of chunks, each with a 7-byte header (crc32,
    length, type: 1 full, 2 first, 3 middle, 4 last); a block's last < 7
    bytes are padding."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(run_file, "rb") as f:
        data = f.read()
    if data[:4] != b":W&B":
        raise ValueError(f"{run_file} is not a wandb run file (header {data[:7]!r})")
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            continue
        pending += chunk
        if kind not in (1, 4):
            continue
        # wandb picks the generated module by protobuf version at import time (star import), so mypy sees no names.
        record = pb.Record()  # type: ignore[attr-defined]
        record.ParseFromString(pending)
        pending = b""
        yield record


def wandb_history(run_file: str) -> Rows:
    """``step -> {key: value}`` from the history records of a ``run-<id>.wandb`` file."""
    rows: Rows = {}
    for record in _wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
            rows.setdefault(int(row["_step"]), {}).update(row)
    return rows


def wandb_run_complete(run_file: str) -> bool:
    """Whether the run file holds wandb's exit record (written after the run finished)."""
    return any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(run_file))


def wandb_offline_rows(wandb_root: str, timeout_s: float = 60.0) -> Rows:
    """The history of every offline run under ``<wandb_root>/wandb/``, oldest
    run first (a resumed areal run is a second wandb run in the same place).

    ``run.finish()`` returns before wandb's service process has written a
    run's last records, so this first waits (up to ``timeout_s``) for each
    run file's exit record."""
    from areal_kernel.testing.waits import wait_until

    files = glob.glob(os.path.join(wandb_root, "wandb", "offline-run-*", "run-*.wandb"))
    wait_until(lambda: all(wandb_run_complete(p) for p in files), timeout_s=timeout_s, interval_s=0.05,
               what=f"wandb to finish writing {len(files)} offline run(s) under {wandb_root}")  # fmt: skip
    rows: Rows = {}
    for path in sorted(files, key=os.path.getmtime):
        for step, row in wandb_history(path).items():
            rows.setdefault(step, {}).update(row)
    return rows
