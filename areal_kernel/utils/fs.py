"""Directory writes that a reader never sees half-done (no torch).

Engines write HF directories and checkpoints that another process (an
inference server reloading weights, a resumed run) may read at any moment, so
every such directory is written into a temporary sibling and renamed onto its
final path only once complete. Train-engine plugins use these helpers the
same way the built-in engine does (docs/plugin-authoring.md, Train engines).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from typing import Iterator

# Files of a source model directory that are never copied into an exported HF
# directory: the weights (and their index) are written fresh by the exporter.
WEIGHT_SUFFIXES: tuple[str, ...] = (
    ".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".index.json",
)  # fmt: skip


def tmp_dir_beside(path: str) -> str:
    """A new empty directory next to ``path`` (same file system, so the final
    rename is atomic), named ``.<basename>.tmp-*``; the parent is created."""
    parent = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(path))}.tmp-", dir=parent)


def atomic_replace_dir(tmp: str, dst: str) -> None:
    """Move the finished directory ``tmp`` to ``dst``. A directory rename is
    atomic; an existing ``dst`` is moved aside first and deleted after, so a
    reader never sees a half-written ``dst``."""
    if not os.path.exists(dst):
        os.rename(tmp, dst)
        return
    old = f"{dst}.old-{uuid.uuid4().hex[:8]}"
    os.rename(dst, old)
    os.rename(tmp, dst)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(path: str) -> Iterator[str]:
    """``with atomic_dir(path) as tmp:`` write into ``tmp``; on success it
    replaces ``path`` (``atomic_replace_dir``), on any exception it is deleted
    and ``path`` is left as it was."""
    tmp = tmp_dir_beside(path)
    try:
        yield tmp
        atomic_replace_dir(tmp, os.path.abspath(path))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def copy_side_files(src: str | None, dst: str) -> None:
    """Copy the non-weight files of the model directory ``src`` (tokenizer,
    chat template, ...) into ``dst``, skipping ``WEIGHT_SUFFIXES`` and any
    file ``dst`` already has (configs written by the exporter win)."""
    if not src or not os.path.isdir(src):
        return
    for name in os.listdir(src):
        s = os.path.join(src, name)
        if not os.path.isfile(s) or name.endswith(WEIGHT_SUFFIXES) or os.path.exists(os.path.join(dst, name)):
            continue
        shutil.copy2(s, os.path.join(dst, name))
