"""HF models in and out of a train engine: loading, the weight list that
travels to inference servers, and the one HF-directory writer.

Every engine writes its HF directories (``save_hf``, ``send_weights`` with
``kind="disk"``) through ``write_hf_weights`` + ``finish_hf_dir``, so an
export holds the same names, files and configs whichever engine made it. A
single process calls ``save_hf_dir``; a distributed engine gathers one file's
weights at a time on all ranks and lets one rank write it (areal-fsdp).
Weight names are the model's ``state_dict`` names with tied aliases dropped
(``weights_for_transfer``): what ``from_pretrained`` loads and what the
broadcast transport sends.
"""

from __future__ import annotations

import json
import os
from typing import Any

from areal_kernel.utils.fs import atomic_dir, copy_side_files

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def load_causal_lm(model_path: str, dtype: Any, attn_implementation: str) -> Any:
    """``AutoModelForCausalLM.from_pretrained`` of an HF directory on the host
    (callers move it to their device or shard it); a vision-language directory
    loads with its image-text-to-text head (``areal_kernel.models.vision``)."""
    from transformers import AutoModelForCausalLM

    from areal_kernel.models import vision

    if vision.is_vision_model(model_path):
        return vision.load_model(model_path, dtype, attn_implementation)

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation=attn_implementation)


def weights_for_transfer(model: Any) -> list[tuple[str, Any]]:
    """``(name, tensor)`` of ``model.state_dict()`` in order, tied aliases
    dropped (the first name of a shared storage is kept, e.g.
    ``model.embed_tokens.weight`` and not ``lm_head.weight``): exactly what
    ``from_pretrained`` / ``load_state_dict(strict=False)`` accept. Tensors
    are detached views of the live weights, not copies."""
    seen: set[tuple[int, tuple[int, ...], str]] = set()
    out: list[tuple[str, Any]] = []
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), tuple(t.shape), str(t.dtype))
        if t.numel() > 0 and key in seen:
            continue
        seen.add(key)
        out.append((name, t.detach()))
    return out


def hf_files(meta: list[dict[str, Any]], shard_bytes: int | None) -> list[tuple[str, list[str]]]:
    """``(file name, weight names)`` of each safetensors file of an export of
    the weights described by ``meta`` (``tensor_meta`` of
    ``weights_for_transfer``), at most ``shard_bytes`` per file (``None``: one
    file). Deterministic, so every rank of a distributed engine plans the same
    files."""
    from areal_kernel.weights.broadcast import plan_buckets

    groups = [list(range(len(meta)))] if shard_bytes is None else plan_buckets(meta, shard_bytes)
    if len(groups) == 1:
        return [(SINGLE_FILE, [m["name"] for m in meta])]
    n = len(groups)
    return [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", [meta[j]["name"] for j in g]) for i, g in enumerate(groups)]


def write_hf_weights(directory: str, file_name: str, named: list[tuple[str, Any]]) -> dict[str, Any]:
    """Write ``named`` as the safetensors file ``file_name`` of an export;
    returns ``{"bytes": ..., "names": [...]}`` for ``finish_hf_dir``."""
    from safetensors.torch import save_file

    tensors = {n: t.contiguous() for n, t in named}
    save_file(tensors, os.path.join(directory, file_name), metadata={"format": "pt"})
    return {"bytes": sum(t.numel() * t.element_size() for t in tensors.values()), "names": list(tensors)}


def finish_hf_dir(directory: str, model: Any, files: dict[str, dict[str, Any]], source_dir: str | None) -> None:
    """Complete an export whose weight files are written (``files``: file name
    -> what ``write_hf_weights`` returned): the index when there are several
    files, ``config.json`` (with the model's dtype and class, as
    ``save_pretrained`` records them), the generation config of generative
    models, and the source directory's tokenizer and other side files."""
    if len(files) > 1:
        weight_map = {n: f for f, info in files.items() for n in info["names"]}
        total = sum(info["bytes"] for info in files.values())
        with open(os.path.join(directory, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    cfg = model.config
    cfg.dtype = str(model.dtype).split(".")[1]
    # A sharded model's class is FSDP<Model>: record the model class itself.
    cfg.architectures = [type(model).__name__.removeprefix("FSDP")]
    cfg.save_pretrained(directory)
    gen = getattr(model, "generation_config", None)
    if gen is not None and model.can_generate():
        gen.save_pretrained(directory)
    copy_side_files(source_dir, directory)


def save_hf_dir(path: str, model: Any, source_dir: str | None, shard_bytes: int | None = None) -> None:
    """Write ``model`` (all of it in this process) as an HF directory at
    ``path``, atomically (``areal_kernel.utils.fs.atomic_dir``)."""
    from areal_kernel.weights.broadcast import tensor_meta

    named = weights_for_transfer(model)
    by_name = dict(named)
    with atomic_dir(path) as tmp:
        files = {}
        for fname, names in hf_files(tensor_meta(named), shard_bytes):
            files[fname] = write_hf_weights(tmp, fname, [(n, by_name[n]) for n in names])
        finish_hf_dir(tmp, model, files, source_dir)
