"""Atomic, bounded checkpoint directories (stdlib only; no torch).

A checkpoint is a directory ``<root>/step<N>`` that some ``writer(path)``
fills (model shards, optimizer state, a JSON of counters...). It becomes
visible only when complete:

1. the writer fills ``<root>/.partial-step<N>-<pid>-<rand>`` (same filesystem,
   so the final rename is atomic);
2. a ``COMPLETE`` marker (JSON: step, file list, time) is written last, every
   file and the directory are fsynced;
3. the directory is renamed to ``step<N>`` and ``<root>`` is fsynced;
4. only then are older checkpoints beyond ``keep_last`` removed.

A crash or error at any point leaves earlier checkpoints as they were; a
failed save removes its partial directory and raises ``CheckpointError``
naming the path and the OS reason. ``latest()`` sees only directories with
the marker, so partial directories of a killed process are ignored (and
``discard_partials()`` deletes them).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from areal_kernel.errors import ArealError

MARKER = "COMPLETE"
PARTIAL_PREFIX = ".partial-"
_STEP = re.compile(r"^step(\d+)$")


class CheckpointError(ArealError):
    """A checkpoint could not be written (the previous ones are intact)."""


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: str


def _fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> list[str]:
    """fsync every file and directory under ``root``; the relative file names."""
    files = []
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            if os.path.isfile(p) and not os.path.islink(p):
                _fsync_path(p)
                files.append(os.path.relpath(p, root))
        _fsync_path(dirpath, directory=True)
    return sorted(files)


def _reason(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno is not None:
        name = errno.errorcode.get(e.errno, str(e.errno))
        return f"{e.strerror or e} ({name})"
    return f"{type(e).__name__}: {e}"


def atomic_write_dir(target: str, writer: Callable[[str], None], *, meta: dict | None = None) -> str:
    """Have ``writer`` fill a temporary directory beside ``target``, then
    publish it as ``target`` in one rename. ``target`` must not exist yet."""
    target = os.path.abspath(target)
    parent, name = os.path.split(target)
    if os.path.exists(target):
        raise CheckpointError(f"checkpoint {target} already exists; refusing to overwrite a complete checkpoint")
    tmp = os.path.join(parent, f"{PARTIAL_PREFIX}{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        os.makedirs(parent, exist_ok=True)
        os.mkdir(tmp)
        writer(tmp)
        files = _fsync_tree(tmp)
        marker = os.path.join(tmp, MARKER)
        with open(marker, "w", encoding="utf-8") as f:
            json.dump({**(meta or {}), "files": files, "written_at": time.time()}, f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_path(tmp, directory=True)
        os.rename(tmp, target)
        _fsync_path(parent, directory=True)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(f"could not write checkpoint {target}: {_reason(e)}") from e
    return target


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


class CheckpointManager:
    """``step<N>`` checkpoints under ``root``, newest ``keep_last`` kept."""

    def __init__(self, root: str, keep_last: int = 2) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.root = os.path.abspath(root)
        self.keep_last = keep_last

    def path_for(self, step: int) -> str:
        return os.path.join(self.root, f"step{step}")

    def complete(self) -> list[Checkpoint]:
        """Complete checkpoints, oldest first (partial and unmarked dirs ignored)."""
        if not os.path.isdir(self.root):
            return []
        found = []
        for name in os.listdir(self.root):
            m = _STEP.match(name)
            path = os.path.join(self.root, name)
            if m and os.path.isdir(path) and is_complete(path):
                found.append(Checkpoint(int(m.group(1)), path))
        return sorted(found, key=lambda c: c.step)

    def latest(self) -> Checkpoint | None:
        done = self.complete()
        return done[-1] if done else None

    def save(self, step: int, writer: Callable[[str], None]) -> Checkpoint:
        """Write checkpoint ``step`` atomically, then prune beyond ``keep_last``.

        On failure: ``CheckpointError`` naming the path, the OS reason and the
        newest checkpoint that is still intact."""
        target = self.path_for(step)
        if os.path.isdir(target) and not is_complete(target):
            # An unmarked leftover (e.g. written by a non-atomic writer) is not a checkpoint.
            shutil.rmtree(target, ignore_errors=True)
        try:
            atomic_write_dir(target, writer, meta={"step": step})
        except CheckpointError as e:
            prev = self.latest()
            keep = f"; the previous checkpoint {prev.path} is intact" if prev else "; no earlier checkpoint exists"
            raise CheckpointError(f"{e}{keep}") from e.__cause__
        self._prune()
        return Checkpoint(step, target)

    def _prune(self) -> None:
        done = self.complete()
        for old in done[: max(0, len(done) - self.keep_last)]:
            # Rename first so a crash mid-delete never leaves a marked, half-deleted dir.
            doomed = os.path.join(
                self.root, f"{PARTIAL_PREFIX}deleting-{os.path.basename(old.path)}-{uuid.uuid4().hex[:8]}"
            )
            try:
                os.rename(old.path, doomed)
            except OSError:
                continue
            shutil.rmtree(doomed, ignore_errors=True)

    def partials(self) -> list[str]:
        if not os.path.isdir(self.root):
            return []
        return sorted(os.path.join(self.root, n) for n in os.listdir(self.root) if n.startswith(PARTIAL_PREFIX))

    def discard_partials(self) -> list[str]:
        """Delete partial directories left by a killed writer (call when no
        other process is saving into ``root``, e.g. at startup)."""
        gone = self.partials()
        for p in gone:
            shutil.rmtree(p, ignore_errors=True)
        return gone


__all__ = ["Checkpoint", "CheckpointError", "CheckpointManager", "atomic_write_dir", "is_complete", "MARKER"]
