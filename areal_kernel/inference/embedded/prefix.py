"""The embedded server's prefix cache: the KV of the token prefix that the
prompts share (a chat template's system prompt, a few-shot header),
computed once per weight version and adapter and reused by every prefill
whose row starts with it.

Why: on a CPU the prefill of a short RL prompt costs as much as the decode
of its answer. Measured on SmolLM2-135M with two policies on one server (8
samples of 4 prompts per step, 12 new tokens): prefill was 41% of the
server's time, and 27 of every 44 prompt tokens were the chat template's
system prompt, the same in every prompt. Rows resumed after a weight update
(prompt plus the tokens generated so far) start with it too.

How the prefix is found: nobody declares it. The server keeps the longest
common prefix of the rows it has prefilled, from the second distinct row
on, when it is at least ``min_tokens`` long (a shorter one saves less than
the extra forward costs); a later row that shares fewer tokens with it, but
still ``min_tokens`` or more, shortens it. One prefix at a time: rows that do
not start with it are prefilled whole, as before.

What it costs in exactness: a row prefilled as prefix (cached) + the rest
differs from the same row prefilled whole in the last bits of its logits,
like a row prefilled in another batch does. A run that must be bit for bit
repeatable turns it off (``rollout.embedded.prefix_cache: false``, as
``areal_kernel.testing.recovery.EXACT_SERVER`` does), since what was cached
depends on what the server saw before.

Staleness: the cached KV came from the weights that computed it. The engine
drops every adapter's entry when the base weights change and an adapter's
entry when that adapter is loaded again or unloaded (``drop``).
"""

from __future__ import annotations

from typing import Any

import torch

# Below this many shared tokens a prefix is not worth an extra forward.
DEFAULT_MIN_TOKENS = 16


def common_prefix_len(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """The shared prefix (token ids) and its KV per adapter (None: the base).
    Used on the engine thread only."""

    def __init__(self, min_tokens: int = DEFAULT_MIN_TOKENS) -> None:
        self.min_tokens = max(1, min_tokens)
        self.tokens: tuple[int, ...] | None = None
        # adapter -> per layer (keys, values), each [1, kv heads, len(tokens), head dim]
        self.kv: dict[str | None, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._last: tuple[int, ...] | None = None  # the last row seen while no prefix is known
        # What /info reports: prefill tokens taken from the cache, and rows that used it.
        self.reused_tokens = 0
        self.rows = 0

    def observe(self, row: tuple[int, ...]) -> None:
        """Learn from a row about to be prefilled (before ``usable``)."""
        if self.tokens is None:
            if self._last is not None:
                n = common_prefix_len(self._last, row)
                if n >= self.min_tokens:
                    self.tokens = row[:n]
            self._last = row
            return
        n = len(self.tokens)
        if row[:n] == self.tokens:
            return
        shared = common_prefix_len(self.tokens, row)
        if shared >= self.min_tokens:
            self.tokens = self.tokens[:shared]
            # A prefix of a prefix: the leading KV columns are its KV (causal attention).
            self.kv = {a: [(k[:, :, :shared], v[:, :, :shared]) for k, v in layers] for a, layers in self.kv.items()}

    def usable(self, row: tuple[int, ...]) -> bool:
        """Whether ``row`` is prefilled as the cached prefix plus its rest
        (it starts with the prefix and has at least one token after it)."""
        t = self.tokens
        return t is not None and len(row) > len(t) and row[: len(t)] == t

    def drop(self, adapter: str | None = None, *, every: bool = False) -> None:
        """Forget cached KV: every adapter's (the base weights changed) or one adapter's."""
        if every:
            self.kv.clear()
        else:
            self.kv.pop(adapter, None)

    def stats(self) -> dict[str, Any]:
        return {
            "prefix_tokens": len(self.tokens) if self.tokens is not None else 0,
            "prefix_reused_tokens": self.reused_tokens,
            "prefix_rows": self.rows,
        }
