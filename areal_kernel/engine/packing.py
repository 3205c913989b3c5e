"""Micro-batching by token budget and sequence packing.

A micro-batch is one packed row: its sequences are concatenated and
``position_ids`` restart at 0 for each. transformers (5.16-5.19) then builds a
block-diagonal causal mask from the position ids for sdpa/eager/flex, but only
when ``attention_mask`` is None and no KV cache is passed, so every forward on
a packed row must use ``use_cache=False`` (FACTS.md: with the cache on,
packed sequences attend across documents).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def allocate_micro_batches(lengths: list[int], max_tokens_per_mb: int) -> list[list[int]]:
    """Group sequence indices into micro-batches of at most ``max_tokens_per_mb``
    tokens (first-fit decreasing). A sequence longer than the budget gets a
    micro-batch of its own: sequences are never split.

    Deterministic: the same lengths always give the same grouping. Indices
    inside a micro-batch are sorted so packed rows follow batch order.
    """
    if max_tokens_per_mb <= 0:
        raise ValueError(f"max_tokens_per_mb must be > 0, got {max_tokens_per_mb}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        n = lengths[i]
        for b, load in enumerate(loads):
            if load + n <= max_tokens_per_mb:
                bins[b].append(i)
                loads[b] += n
                break
        else:
            bins.append([i])
            loads.append(n)
    packed = [sorted(b) for b in bins]
    packed.sort(key=lambda b: b[0])
    return packed


@dataclass
class PackedRow:
    """One packed micro-batch on the device.

    ``data`` holds per-token 1-D tensors aligned with the row; ``seq_start``
    marks the first token of every sequence; ``seq_index`` are the batch
    indices of the packed sequences, in row order; ``cu_seqlens`` the
    boundaries (``len(seq_index) + 1`` entries).
    """

    input_ids: Any
    position_ids: Any
    seq_start: Any
    cu_seqlens: list[int]
    seq_index: list[int]
    data: dict[str, Any]

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def pack_row(
    indices: list[int],
    input_ids: list[list[int]],
    float_fields: dict[str, list[list[float]]],
    long_fields: dict[str, list[list[int]]],
    device: Any,
) -> PackedRow:
    """Concatenate sequences ``indices`` into one row on ``device``.

    ``float_fields`` / ``long_fields`` are per-sequence per-token lists that
    become float32 / int64 tensors in ``PackedRow.data``; ``seq_ids`` (the batch
    index of each token's sequence) is added.
    """
    import torch

    ids: list[int] = []
    pos: list[int] = []
    seq_ids: list[int] = []
    cu = [0]
    for i in indices:
        n = len(input_ids[i])
        ids.extend(input_ids[i])
        pos.extend(range(n))
        seq_ids.extend([i] * n)
        cu.append(cu[-1] + n)
    t_ids = torch.tensor(ids, dtype=torch.long, device=device)
    t_pos = torch.tensor(pos, dtype=torch.long, device=device)
    seq_start = t_pos == 0
    data: dict[str, Any] = {
        "input_ids": t_ids,
        "position_ids": t_pos,
        "seq_ids": torch.tensor(seq_ids, dtype=torch.long, device=device),
    }
    for name, rows in float_fields.items():
        flat = [x for i in indices for x in rows[i]]
        data[name] = torch.tensor(flat, dtype=torch.float32, device=device)
    for name, id_rows in long_fields.items():
        flat_ids = [x for i in indices for x in id_rows[i]]
        data[name] = torch.tensor(flat_ids, dtype=torch.long, device=device)
    return PackedRow(t_ids, t_pos, seq_start, cu, list(indices), data)
