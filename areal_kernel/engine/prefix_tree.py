"""Shared-prompt packing: run a group's common prompt through the model once.

GRPO samples ``n`` completions per prompt, so a batch holds ``n`` copies of
every prompt. Plain packing pushes each copy through the decoder; with short
answers to long chat prompts that is most of the training compute (SmolLM2
demo: 44 prompt tokens, ~4 answer tokens, 8 samples -> 384 tokens per group
packed, 76 shared).

A *tree row* holds, per group, the prompt once followed by each member's
suffix. Suffix tokens keep the positions they have in their own sequence and
attend to the prompt and to their own earlier suffix tokens only, so every
hidden state equals the one the unshared sequence would produce; the prompt
tokens' gradients collect the contributions of all members, exactly as the
sum over separate copies would.

The loss contract is unchanged: ``train_batch`` still builds the *virtual*
row (all sequences concatenated, see ``packing.pack_row``) and loss
functions see tensors aligned with it. ``TreeRow.virt_to_tree`` maps each
virtual token to the tree position that computes its hidden state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from areal_kernel.engine.packing import allocate_micro_batches


@dataclass(frozen=True)
class SharedChunk:
    """Sequences ``members`` whose first ``prefix_len`` tokens are identical
    (``prefix_len`` 0: nothing shared, one member)."""

    prefix_len: int
    members: tuple[int, ...]

    def cost(self, lengths: Sequence[int]) -> int:
        """Tokens this chunk puts through the model."""
        return self.prefix_len + sum(lengths[m] - self.prefix_len for m in self.members)


def shared_prefix_len(input_ids: Sequence[int], loss_mask: Sequence[int]) -> int:
    """The prompt part that may be shared: tokens before the first loss token,
    keeping at least one token of the sequence outside it (that token is what
    the prefix's last position predicts)."""
    p = 0
    n = len(input_ids)
    while p < n and not loss_mask[p]:
        p += 1
    return min(p, n - 1)


def plan_chunks(
    input_ids: Sequence[Sequence[int]],
    loss_masks: Sequence[Sequence[int]],
    max_tokens_per_mb: int,
) -> list[SharedChunk]:
    """Group sequences with the same prompt into chunks that fit the budget.

    Deterministic: members keep batch order; a group too large for one
    micro-batch is cut into several chunks, each sharing the prompt anew."""
    lengths = [len(x) for x in input_ids]
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (ids, mask) in enumerate(zip(input_ids, loss_masks)):
        p = shared_prefix_len(ids, mask)
        groups.setdefault(tuple(ids[:p]) if p > 0 else ("__alone", i), []).append(i)  # type: ignore[arg-type]
    chunks: list[SharedChunk] = []
    for key, members in groups.items():
        p = len(key) if key and key[0] != "__alone" else 0
        if len(members) == 1 or p == 0:
            chunks.extend(SharedChunk(0, (m,)) for m in members)
            continue
        cur: list[int] = []
        cost = p
        for m in members:
            extra = lengths[m] - p
            if cur and cost + extra > max_tokens_per_mb:
                chunks.append(_chunk(p, cur))
                cur, cost = [], p
            cur.append(m)
            cost += extra
        chunks.append(_chunk(p, cur))
    return chunks


def _chunk(p: int, members: list[int]) -> SharedChunk:
    return SharedChunk(p if len(members) > 1 else 0, tuple(members))


def allocate_shared_micro_batches(
    input_ids: Sequence[Sequence[int]],
    loss_masks: Sequence[Sequence[int]],
    max_tokens_per_mb: int,
) -> list[list[SharedChunk]]:
    """Micro-batches of chunks whose *shared* token count fits the budget
    (first-fit decreasing over chunk costs, as ``allocate_micro_batches``)."""
    chunks = plan_chunks(input_ids, loss_masks, max_tokens_per_mb)
    lengths = [len(x) for x in input_ids]
    bins = allocate_micro_batches([c.cost(lengths) for c in chunks], max_tokens_per_mb)
    return [[chunks[k] for k in b] for b in bins]


@dataclass
class TreeRow:
    """The model input of one micro-batch with shared prompts.

    ``attention_mask`` is ``[1, 1, T, T]`` (bool for sdpa, additive float for
    eager); ``virt_to_tree[v]`` is the tree position holding virtual token v."""

    input_ids: Any
    position_ids: Any
    attention_mask: Any
    virt_to_tree: Any

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def virtual_order(chunks: Sequence[SharedChunk]) -> list[int]:
    """Batch indices in the order the virtual row concatenates them."""
    return [m for c in chunks for m in c.members]


def build_tree_row(
    chunks: Sequence[SharedChunk],
    input_ids: Sequence[Sequence[int]],
    device: Any,
    *,
    additive_mask_dtype: Any = None,
) -> TreeRow:
    """The tree row for ``chunks`` (virtual order = ``virtual_order(chunks)``).

    ``additive_mask_dtype``: None gives a bool mask (True = attend, for sdpa);
    a float dtype gives 0 / most-negative entries (for eager attention)."""
    import torch

    ids: list[int] = []
    pos: list[int] = []
    chunk_of: list[int] = []
    branch_of: list[int] = []  # 0 = shared prompt (or an unshared sequence), j+1 = member j's suffix
    v2t: list[int] = []
    for c_idx, chunk in enumerate(chunks):
        p = chunk.prefix_len
        base = len(ids)
        if p:
            first = input_ids[chunk.members[0]]
            ids.extend(first[:p])
            pos.extend(range(p))
            chunk_of.extend([c_idx] * p)
            branch_of.extend([0] * p)
        for j, m in enumerate(chunk.members):
            seq = input_ids[m]
            start = len(ids)
            ids.extend(seq[p:])
            pos.extend(range(p, len(seq)))
            chunk_of.extend([c_idx] * (len(seq) - p))
            branch_of.extend([j + 1 if p else 0] * (len(seq) - p))
            v2t.extend(range(base, base + p))
            v2t.extend(range(start, start + len(seq) - p))
    t_pos = torch.tensor(pos, dtype=torch.long, device=device)
    t_chunk = torch.tensor(chunk_of, dtype=torch.long, device=device)
    t_branch = torch.tensor(branch_of, dtype=torch.long, device=device)
    allowed = (
        (t_chunk[:, None] == t_chunk[None, :])
        & (t_pos[None, :] <= t_pos[:, None])
        & ((t_branch[None, :] == 0) | (t_branch[None, :] == t_branch[:, None]))
    )
    if additive_mask_dtype is None:
        mask = allowed
    else:
        mask = torch.zeros(allowed.shape, dtype=additive_mask_dtype, device=device)
        mask = mask.masked_fill(~allowed, torch.finfo(additive_mask_dtype).min)
    return TreeRow(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        position_ids=t_pos,
        attention_mask=mask[None, None],
        virt_to_tree=torch.tensor(v2t, dtype=torch.long, device=device),
    )
