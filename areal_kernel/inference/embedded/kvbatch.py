"""The running batch: requests, their KV cache and per-row state.

Rows are left-padded so that every row's newest token sits in the last cache
column; a 2-D attention mask marks real tokens and ``pos`` holds each row's
next position id (rotary positions ignore padding). New requests are
prefilled as their own batch and then *merged* (caches left-padded to a
common length and concatenated), so they join between decode steps; finished
rows are removed and all-padding leading columns trimmed, so compute follows
the live rows.
"""

from __future__ import annotations

from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

import torch

from areal_kernel.inference.embedded.growcache import new_cache  # noqa: F401  (re-exported for the engine)
from areal_kernel.inference.embedded.protocol import SamplingParams
from areal_kernel.inference.embedded.sampling import RowParams
from areal_kernel.inference.embedded.stopstr import StopStrings


@dataclass
class Request:
    """One generation request as the engine tracks it."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    fut: Future  # resolves once, to the response body (or the failure)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    finished: bool = False
    # Set by the engine when the request has stop strings.
    stop_strings: StopStrings | None = None
    adapter: str | None = None  # the LoRA adapter it generates with (None: base weights)
    # Vision-language prompts: the images' digest and pixel tensors (image
    # keyword -> [n_images, ...]), decoded once when the request arrives.
    image_digest: str | None = None
    pixels: dict[str, Any] | None = None

    def finish(self, reason: str, version: int, matched_stop: str | None = None) -> None:
        if self.finished:
            return
        self.finished = True
        self._settle(
            result={
                "rid": self.rid,
                "output_ids": self.output_ids,
                "output_logprobs": self.output_logprobs,
                "finish_reason": reason,
                "weight_version": version,
                "matched_stop": matched_stop,
            }
        )

    def fail(self, err: BaseException) -> None:
        if not self.finished:
            self.finished = True
            self._settle(error=err)

    def _settle(self, result: dict | None = None, error: BaseException | None = None) -> None:
        try:
            if self.fut.done():  # cancelled by the HTTP side
                return
            if error is not None:
                self.fut.set_exception(error)
            else:
                self.fut.set_result(result)
        except InvalidStateError:  # cancelled between the check and the set
            pass


def _layers(cache: Any) -> list[Any]:
    return list(cache.layers)


def _set_kv(layer: Any, keys: torch.Tensor, values: torch.Tensor) -> None:
    if hasattr(layer, "set_kv"):
        layer.set_kv(keys, values)
    else:
        layer.keys, layer.values = keys, values


@dataclass
class RunningBatch:
    reqs: list[Request]
    cache: Any  # transformers DynamicCache
    mask: torch.Tensor | None  # [B, L] bool; None: no padding anywhere
    pos: torch.Tensor  # [B] long: position id of the next token to feed
    last: torch.Tensor  # [B] long: last sampled token (not yet in the cache)
    n_gen: torch.Tensor  # [B] long
    max_new: torch.Tensor  # [B] long
    stop: torch.Tensor  # [B, S] long, -1 padded (S >= 1)
    rows: RowParams

    @property
    def size(self) -> int:
        return len(self.reqs)

    @property
    def length(self) -> int:
        return int(_layers(self.cache)[0].keys.shape[-2])

    def full_mask(self) -> torch.Tensor:
        if self.mask is not None:
            return self.mask
        return torch.ones(self.size, self.length, dtype=torch.bool, device=self.pos.device)

    # -- shape changes ---------------------------------------------------------
    def select(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (in that order), then trim padding."""
        idx = torch.tensor(keep, dtype=torch.long, device=self.pos.device)
        for layer in _layers(self.cache):
            _set_kv(layer, layer.keys.index_select(0, idx), layer.values.index_select(0, idx))
        self.reqs = [self.reqs[i] for i in keep]
        if self.mask is not None:
            self.mask = self.mask.index_select(0, idx)
        self.pos, self.last = self.pos[idx], self.last[idx]
        self.n_gen, self.max_new, self.stop = self.n_gen[idx], self.max_new[idx], self.stop[idx]
        self.rows = self.rows.select(idx)
        self.trim()

    def trim(self) -> None:
        """Drop leading cache columns that are padding in every row."""
        if self.mask is None:
            return
        used = self.mask.any(0)
        first = int(used.to(torch.uint8).argmax().item())
        if first > 0:
            for layer in _layers(self.cache):
                _set_kv(layer, layer.keys[:, :, first:], layer.values[:, :, first:])
            self.mask = self.mask[:, first:]
        if bool(self.mask.all().item()):
            self.mask = None

    def merge(self, other: "RunningBatch") -> None:
        """Append ``other``'s rows (left-padding the shorter cache)."""
        la, lb = self.length, other.length
        L = max(la, lb)
        ma, mb = self.full_mask(), other.full_mask()
        for a, b in zip(_layers(self.cache), _layers(other.cache)):
            _set_kv(
                a,
                torch.cat([_left_pad(a.keys, L), _left_pad(b.keys, L)], 0),
                torch.cat([_left_pad(a.values, L), _left_pad(b.values, L)], 0),
            )
        mask = torch.cat([_left_pad_mask(ma, L), _left_pad_mask(mb, L)], 0)
        self.mask = None if bool(mask.all().item()) else mask
        self.reqs = self.reqs + other.reqs
        self.pos = torch.cat([self.pos, other.pos])
        self.last = torch.cat([self.last, other.last])
        self.n_gen = torch.cat([self.n_gen, other.n_gen])
        self.max_new = torch.cat([self.max_new, other.max_new])
        s = max(self.stop.shape[1], other.stop.shape[1])
        self.stop = torch.cat([_right_pad_ids(self.stop, s), _right_pad_ids(other.stop, s)], 0)
        self.rows = RowParams.cat(self.rows, other.rows)


def _left_pad(kv: torch.Tensor, length: int) -> torch.Tensor:
    # Zeros, not garbage: masked keys/values still enter the attention matmul
    # with weight 0, and 0 * NaN would poison the row.
    n = length - kv.shape[-2]
    if n == 0:
        return kv
    pad = kv.new_zeros(kv.shape[0], kv.shape[1], n, kv.shape[3])
    return torch.cat([pad, kv], dim=-2)


def _left_pad_mask(mask: torch.Tensor, length: int) -> torch.Tensor:
    n = length - mask.shape[1]
    if n == 0:
        return mask
    return torch.cat([mask.new_zeros(mask.shape[0], n), mask], dim=1)


def _right_pad_ids(ids: torch.Tensor, width: int) -> torch.Tensor:
    n = width - ids.shape[1]
    if n == 0:
        return ids
    return torch.cat([ids, ids.new_full((ids.shape[0], n), -1)], dim=1)


def stop_matrix(reqs: list[Request], eos_ids: list[int], device: torch.device) -> torch.Tensor:
    rows = [sorted(set(r.params.stop_token_ids) | set(eos_ids)) or [-1] for r in reqs]
    width = max(len(r) for r in rows)
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.long, device=device)
