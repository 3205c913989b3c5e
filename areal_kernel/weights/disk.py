"""Safetensors directories: sharded, indexed, written atomically, no pickles.

Layout follows the HF convention so any HF loader can read it:
``model.safetensors`` for one shard, otherwise
``model-00001-of-0000N.safetensors`` + ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Iterable

from areal_kernel.errors import DataError

if TYPE_CHECKING:
    import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def _nbytes(t: "torch.Tensor") -> int:
    return t.numel() * t.element_size()


def _shard_name(i: int, n: int) -> str:
    return SINGLE_NAME if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def save_state_dict_dir(
    named_tensors: Iterable[tuple[str, "torch.Tensor"]],
    path: str,
    shard_bytes: int = 2 << 30,
    metadata: dict[str, str] | None = None,
) -> list[str]:
    """Write ``named_tensors`` as safetensors shards under ``path``.

    The shards go to a sibling ``path.tmp-*`` directory first, which is renamed
    over ``path`` only when complete, so a reader never sees half a checkpoint.
    Other files already in ``path`` (config.json, tokenizer) are kept: they are
    copied into the new directory before the swap. Returns the shard file names.
    Tensors sharing storage (tied embeddings) are written once per name, as
    safetensors requires independent buffers.
    """
    from safetensors.torch import save_file

    if shard_bytes <= 0:
        raise DataError(f"save_state_dict_dir: shard_bytes must be > 0, got {shard_bytes}")
    # Group into shards in the given order (deterministic, bounded size).
    shards: list[dict[str, "torch.Tensor"]] = [{}]
    size = 0
    seen: set[str] = set()
    for name, tensor in named_tensors:
        if name in seen:
            raise DataError(f"save_state_dict_dir: tensor name {name!r} appears twice")
        seen.add(name)
        t = tensor.detach()
        t = t.to("cpu").contiguous()  # .to() returns host tensors as they are
        n = _nbytes(t)
        if shards[-1] and size + n > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    if not seen:
        raise DataError(f"save_state_dict_dir: no tensors given for {path!r}")

    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(path) + ".tmp-", dir=parent)
    try:
        if os.path.isdir(path):
            # Keep non-weight files (config, tokenizer) of an existing directory.
            for entry in os.listdir(path):
                src = os.path.join(path, entry)
                if os.path.isfile(src) and not (entry.endswith(".safetensors") or entry == INDEX_NAME):
                    shutil.copy2(src, os.path.join(tmp, entry))
        names = []
        weight_map: dict[str, str] = {}
        total = 0
        for i, shard in enumerate(shards):
            fname = _shard_name(i, len(shards))
            # clone() breaks storage sharing between tied tensors within a shard.
            shard = {k: (v.clone() if _shares_storage(v, shard, k) else v) for k, v in shard.items()}
            save_file(shard, os.path.join(tmp, fname), metadata={"format": "pt", **(metadata or {})})
            names.append(fname)
            for k, v in shard.items():
                weight_map[k] = fname
                total += _nbytes(v)
        if len(shards) > 1:
            with open(os.path.join(tmp, INDEX_NAME), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        old = None
        if os.path.exists(path):
            old = tempfile.mkdtemp(prefix=os.path.basename(path) + ".old-", dir=parent)
            os.rename(path, os.path.join(old, "d"))
        os.rename(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return names


def _shares_storage(t: "torch.Tensor", shard: dict[str, "torch.Tensor"], name: str) -> bool:
    ptr = t.untyped_storage().data_ptr()
    return any(k != name and v.untyped_storage().data_ptr() == ptr for k, v in shard.items())


def list_safetensors_files(path: str) -> list[str]:
    """The shard files of ``path`` (index order if an index exists)."""
    if not os.path.isdir(path):
        raise DataError(f"weights directory {path!r} does not exist or is not a directory")
    index = os.path.join(path, INDEX_NAME)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise DataError(f"weights directory {path!r} holds no *.safetensors file")
    missing = [f for f in files if not os.path.exists(os.path.join(path, f))]
    if missing:
        raise DataError(f"weights directory {path!r}: index names missing shard(s) {missing}")
    return [os.path.join(path, f) for f in files]


def read_shapes(path: str) -> dict[str, tuple[str, list[int]]]:
    """Name -> (safetensors dtype code such as ``"F32"``/``"BF16"``, shape) of
    every tensor in ``path``, read from the headers only (no data loaded)."""
    from safetensors import safe_open

    out: dict[str, tuple[str, list[int]]] = {}
    for fpath in list_safetensors_files(path):
        with safe_open(fpath, framework="pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                out[k] = (str(sl.get_dtype()), list(sl.get_shape()))
    return out


def iter_state_dict_dir(path: str) -> Iterable[tuple[str, "torch.Tensor"]]:
    """Yield ``(name, tensor)`` shard by shard (bounded memory)."""
    from safetensors.torch import load_file

    for fpath in list_safetensors_files(path):
        yield from load_file(fpath).items()


def load_state_dict_dir(path: str) -> dict[str, "torch.Tensor"]:
    """Every tensor of a safetensors directory, on CPU."""
    return dict(iter_state_dict_dir(path))
