"""The generation engine: one background thread owns the model and steps the
running batch; everything else talks to it through a command inbox.

Why one owner thread: weight updates, pause/abort and batch surgery then
happen strictly *between* decode steps without locks, and a ``/pause`` that
returned guarantees no step is in flight. HTTP handlers get
``concurrent.futures.Future`` objects and await them with
``asyncio.wrap_future``.

Each loop iteration: run queued commands; admit waiting requests (prefill
them as one left-padded batch and merge into the running batch, so requests
join between decode steps); one decode step for every running row; finished
rows leave the batch at once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable

import torch

from areal_kernel.inference.embedded.kvbatch import Request, RunningBatch, _layers, _set_kv, new_cache, stop_matrix
from areal_kernel.inference.embedded.lora import AdapterSet
from areal_kernel.inference.embedded.prefix import DEFAULT_MIN_TOKENS, PrefixCache
from areal_kernel.inference.embedded.protocol import GenerateBody, RequestError
from areal_kernel.inference.embedded.sampling import RowParams, row_uniforms, sample
from areal_kernel.inference.embedded.stopstr import StopStrings

log = logging.getLogger("areal.embedded.engine")

_STOP = object()


class GenerationEngine:
    def __init__(
        self,
        model: Any,
        *,
        max_batch_size: int,
        eos_ids: list[int],
        max_positions: int,
        vocab_size: int,
        device: torch.device,
        seed: int = 0,
        pad_id: int = 0,
        num_threads: int = 1,
        admit_window_s: float = 0.005,
        decode: Callable[[list[int]], str] | None = None,
        images: Any = None,
        prefix_cache: bool = True,
        prefix_min_tokens: int = DEFAULT_MIN_TOKENS,
    ) -> None:
        self.model = model
        # ``areal_kernel.models.vision.ImageTensors`` for a vision-language model, else None.
        self.images = images
        self.max_batch_size = max_batch_size
        self.eos_ids = list(eos_ids)
        self.max_positions = max_positions
        self.vocab_size = vocab_size
        self.device = device
        self.pad_id = pad_id
        self.num_threads = num_threads
        self.admit_window_s = admit_window_s
        # Token ids -> text (the model's tokenizer); needed only for stop strings.
        self.decode = decode
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

        self.version = 0
        # Held by every change of the weights or of a version (always on the
        # engine thread) and by what reads them elsewhere (the weight
        # fingerprint): such a reader never sees a load halfway, and need not
        # wait for the engine thread to finish a generation step.
        self.weights_lock = threading.Lock()
        # LoRA adapters served beside the base weights (each with its own version).
        self.lora = AdapterSet(model)
        # The KV of the prompts' shared prefix (prefix.py). Not for image
        # prompts: their placeholder tokens are filled from the request's images.
        self.prefix = PrefixCache(prefix_min_tokens) if prefix_cache and images is None else None
        self.paused = False
        # Tokens sampled since start (reported by /info): lets a caller wait for
        # "the server has generated" instead of guessing with a sleep.
        self.tokens_generated = 0
        self.waiting: deque[Request] = deque()
        self.batch: RunningBatch | None = None
        self._active: dict[str, Request] = {}
        self._admitting: list[Request] = []
        self._inbox: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="areal-engine", daemon=True)
        self._check_cache_layout()

    # -- public, thread-safe ------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._inbox.put(_STOP)
        self._thread.join(timeout)

    @property
    def n_running(self) -> int:
        # From the bookkeeping dict, not the batch: a finished row is removed
        # from _active before its answer is sent, so /info never lags behind.
        return max(0, len(self._active) - len(self.waiting))

    @property
    def n_queued(self) -> int:
        return len(self.waiting)

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the engine thread between steps; its result or
        exception lands in the returned future."""
        fut: Future = Future()
        self._inbox.put((fn, fut))
        return fut

    def submit(self, body: GenerateBody) -> Future:
        """Queue a generation; the future resolves to the response body."""
        if body.params.stop and self.decode is None:
            raise RequestError(
                "sampling_params.stop: this server has no tokenizer (none in the model directory), "
                "so it cannot match stop strings; use stop_token_ids"
            )
        fut: Future = Future()
        req = Request(body.rid, body.input_ids, body.params, fut=fut, adapter=body.adapter)
        if body.images is not None:
            req.image_digest, req.pixels = body.images.digest, self._pixels(body)
        elif self.images is not None and self.images.count_placeholders(body.input_ids):
            raise RequestError(
                f"input_ids hold {self.images.count_placeholders(body.input_ids)} image placeholder tokens "
                "but the request has no images"
            )
        if body.params.stop and self.decode is not None:
            req.stop_strings = StopStrings(body.params.stop, self.decode)

        def add() -> None:
            if req.rid in self._active:
                fut.set_exception(RequestError(f"rid {req.rid!r} is already queued or running; rids must be unique"))
                return
            if req.adapter is not None and req.adapter not in self.lora:
                served = sorted(self.lora.adapters) or "none"
                fut.set_exception(RequestError(f"adapter {req.adapter!r} is not loaded (served: {served})"))
                return
            self._active[req.rid] = req
            self.waiting.append(req)

        self._inbox.put((add, None))

        # A client that went away should not keep a batch row busy.
        def drop_if_cancelled(f: Future) -> None:
            if f.cancelled():
                self._inbox.put((lambda: self._drop(req), None))

        fut.add_done_callback(drop_if_cancelled)
        return fut

    def _pixels(self, body: GenerateBody) -> dict[str, Any]:
        """The request's decoded images, checked against its placeholder tokens."""
        from areal_kernel.errors import DataError

        assert body.images is not None
        if self.images is None:
            raise RequestError("images: this server's model is not a vision-language model")
        try:
            pixels = self.images.pixels(body.images, where=f"request {body.rid}")
        except DataError as e:
            raise RequestError(str(e)) from None
        n_ph = self.images.count_placeholders(body.input_ids)
        want = len(body.images) * self.images.tokens_per_image()
        if n_ph != want:
            raise RequestError(
                f"input_ids hold {n_ph} image placeholder tokens but {len(body.images)} image(s) need {want} "
                f"({self.images.tokens_per_image()} each): render the prompt with the model's processor"
            )
        return pixels

    def pause(self, mode: str) -> Future:
        def do() -> dict:
            self.paused = True
            n = 0
            if mode == "abort":
                n = self._abort_running()
            return {"paused": True, "aborted": n}

        return self.call(do)

    def resume(self) -> Future:
        def do() -> dict:
            self.paused = False
            return {"paused": False}

        return self.call(do)

    def abort(self, rid: str) -> Future:
        def do() -> dict:
            req = self._active.get(rid)
            if req is None:
                return {"aborted": False}
            self._drop(req)
            return {"aborted": True}

        return self.call(do)

    def update_weights(self, load: Callable[[], Any], version: int) -> Future:
        """Run ``load`` (copies tensors into the model) between steps and set
        ``version``. Rows in the running batch (including ones frozen by
        pause ``keep``) are aborted first: their KV cache came from the old
        weights, and one answer must come from one weight version. Queued
        requests stay queued and run on the new weights."""

        def do() -> dict:
            n = self._abort_running()
            # Before the load: a load that fails halfway leaves no KV of the old weights behind.
            if self.prefix is not None:
                self.prefix.drop(every=True)
            with self.weights_lock:
                load()
                self.version = version
            return {"version": version, "aborted": n}

        return self.call(do)

    def set_version(self, version: int) -> Future:
        def do() -> dict:
            with self.weights_lock:
                self.version = version
            return {"version": version}

        return self.call(do)

    def load_adapter(self, name: str, load: Callable[[], Any], version: int) -> Future:
        """Run ``load`` (it puts the adapter into ``self.lora``) between steps.
        Running rows of this adapter are aborted first (their KV cache came
        from its old weights); rows of other adapters and of the base go on."""

        def do() -> dict:
            n = self._abort_rows(lambda r: r.adapter == name)
            if self.prefix is not None:
                self.prefix.drop(name)  # before the load, as in update_weights
            with self.weights_lock:
                load()
            return {"adapter": name, "version": version, "aborted": n}

        return self.call(do)

    def unload_adapter(self, name: str) -> Future:
        """Stop serving ``name``: its running rows end with 'abort', its queued requests fail."""

        def do() -> dict:
            n = self._abort_rows(lambda r: r.adapter == name)
            for r in [r for r in self.waiting if r.adapter == name]:
                self.waiting.remove(r)
                self._active.pop(r.rid, None)
                r.fail(RequestError(f"adapter {name!r} was unloaded"))
            if self.prefix is not None:
                self.prefix.drop(name)
            with self.weights_lock:
                unloaded = self.lora.unload(name)
            return {"adapter": name, "unloaded": unloaded, "aborted": n}

        return self.call(do)

    # -- engine thread ------------------------------------------------------
    def _check_cache_layout(self) -> None:
        # Left-padding merges and in-place appends assume plain full-attention
        # layers (no sliding windows, no linear-attention state).
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        cache = DynamicCache(config=self.model.config)
        kinds = {type(layer).__name__ for layer in cache.layers}
        if not cache.layers or kinds != {DynamicLayer.__name__}:
            raise RuntimeError(
                f"embedded server supports full-attention models only; this model's cache layers are {sorted(kinds)}"
            )

    def _busy(self) -> bool:
        return not self.paused and (self.batch is not None or bool(self.waiting))

    def _run(self) -> None:
        torch.set_num_threads(self.num_threads)
        with torch.inference_mode():
            while True:
                try:
                    item = self._inbox.get(block=not self._busy())
                except queue.Empty:
                    item = None
                while item is not None:
                    if item is _STOP:
                        self._abort_running()
                        return
                    self._exec(item)
                    try:
                        item = self._inbox.get_nowait()
                    except queue.Empty:
                        item = None
                if self._busy() and self.batch is None:
                    if self._gather_burst():
                        return
                if self._busy():
                    try:
                        self._step()
                    except Exception as e:  # keep serving; fail only what was running
                        log.exception("generation step failed")
                        self._fail_running(e)

    def _gather_burst(self) -> bool:
        """Starting from idle: wait up to ``admit_window_s`` for more requests
        so a burst (e.g. a batch of rollouts sent together) is prefilled as
        one batch instead of one request followed by the rest. Returns True
        if a shutdown arrived meanwhile."""
        deadline = time.monotonic() + self.admit_window_s
        while len(self.waiting) < self.max_batch_size and not self.paused:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                item = self._inbox.get(timeout=left)
            except queue.Empty:
                break
            if item is _STOP:
                self._abort_running()
                return True
            self._exec(item)
        return False

    def _exec(self, item: tuple[Callable[[], Any], Future | None]) -> None:
        fn, fut = item
        try:
            res = fn()
        except Exception as e:
            if fut is None:
                log.exception("engine command failed")
            else:
                fut.set_exception(e)
            return
        if fut is not None:
            fut.set_result(res)

    def _finish(self, req: Request, reason: str, matched_stop: str | None = None) -> None:
        self._active.pop(req.rid, None)
        # An adapter's tokens carry the adapter's version (each adapter is its own policy).
        version = self.lora.versions.get(req.adapter, self.version) if req.adapter is not None else self.version
        req.finish(reason, version, matched_stop)

    def _abort_rows(self, which: Callable[[Request], bool]) -> int:
        b = self.batch
        if b is None:
            return 0
        hit = [r for r in b.reqs if which(r)]
        for r in hit:
            self._drop(r)
        return len(hit)

    def _abort_running(self) -> int:
        b = self.batch
        if b is None:
            return 0
        for r in b.reqs:
            self._finish(r, "abort")
        self.batch = None
        return b.size

    def _fail_running(self, err: Exception) -> None:
        b, self.batch = self.batch, None
        admitting, self._admitting = self._admitting, []
        for r in (b.reqs if b is not None else []) + admitting:
            self._active.pop(r.rid, None)
            r.fail(RuntimeError(f"generation failed: {type(err).__name__}: {err}"))

    def _drop(self, req: Request) -> None:
        """Abort one request wherever it is (partial output, 'abort')."""
        if req.finished:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        elif self.batch is not None and req in self.batch.reqs:
            keep = [i for i, r in enumerate(self.batch.reqs) if r is not req]
            if keep:
                self.batch.select(keep)
            else:
                self.batch = None
        self._finish(req, "abort")

    def _step(self) -> None:
        room = self.max_batch_size - (self.batch.size if self.batch is not None else 0)
        if self.waiting and room > 0:
            new = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
            self._admitting = new  # so a failing prefill still answers them
            fresh = self._prefill(new)
            self._admitting = []
            if fresh is not None:
                if self.batch is None:
                    self.batch = fresh
                else:
                    self.batch.merge(fresh)
        if self.batch is not None:
            self._decode(self.batch)

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor | None, pos_ids: torch.Tensor, cache: Any, **images: Any
    ) -> torch.Tensor:
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            **images,
        )
        return out.logits[:, -1, :].float()

    def _prefill(self, reqs: list[Request]) -> RunningBatch | None:
        """Prefill ``reqs`` into a running batch (None if every row finished
        at its first token): rows that start with the cached prefix as its
        KV plus their rest, the others whole (two forwards, then merged)."""
        cache = self.prefix
        if cache is None:
            return self._prefill_rows(reqs, 0)
        rows = [tuple(r.input_ids) if r.image_digest is None else None for r in reqs]
        for row in dict.fromkeys(x for x in rows if x is not None):
            cache.observe(row)
        use = [row is not None and cache.usable(row) for row in rows]
        cached = [r for r, u in zip(reqs, use) if u]
        if not cached:
            return self._prefill_rows(reqs, 0)
        whole = [r for r, u in zip(reqs, use) if not u]
        n_prefix = len(cache.tokens or ())
        out = self._prefill_rows(cached, n_prefix)
        if whole:
            rest = self._prefill_rows(whole, 0)
            if out is None:
                return rest
            if rest is not None:
                out.merge(rest)
        return out

    def _prefix_kv(self, adapters: list[str | None]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the cached prefix's (keys, values) for rows using
        ``adapters`` (one entry per row), computing what is not cached yet
        in one forward of the prefix under each missing adapter."""
        cache = self.prefix
        assert cache is not None and cache.tokens is not None
        missing = [a for a in dict.fromkeys(adapters) if a not in cache.kv]
        if missing:
            n = len(cache.tokens)
            ids = torch.tensor([list(cache.tokens)] * len(missing), dtype=torch.long, device=self.device)
            pos_ids = torch.arange(n, device=self.device).expand(len(missing), n)
            self.lora.rows = missing
            kv = new_cache(self.model.config)
            self._forward(ids, None, pos_ids, kv)
            for j, a in enumerate(missing):
                # Copies: the layers' tensors are views of buffers with headroom.
                cache.kv[a] = [
                    (layer.keys[j : j + 1].clone(), layer.values[j : j + 1].clone()) for layer in _layers(kv)
                ]
        per_layer = zip(*(cache.kv[a] for a in adapters))
        return [(torch.cat([k for k, _ in parts]), torch.cat([v for _, v in parts])) for parts in per_layer]

    def _prefill_rows(self, reqs: list[Request], n_prefix: int) -> RunningBatch | None:
        """Prefill ``reqs`` as one batch; with ``n_prefix`` > 0 their first
        ``n_prefix`` tokens (the prefix cache's) come from the cache and only
        the rest runs, left-padded after the prefix (the padding then sits
        between the prefix and the rest, masked like any other)."""
        # Samples of one prompt (a GRPO group) arrive together with identical
        # input ids: prefill each distinct prompt once and copy its cache rows.
        # The copies then sample independently.
        # Same prompt under two adapters: two caches.
        # Same ids with other images: two rows (the key holds the images' digest).
        first_of: dict[tuple[str | None, tuple[int, ...], str | None], int] = {}
        firsts: list[Request] = []
        src = []
        for r in reqs:
            key = (r.adapter, tuple(r.input_ids), r.image_digest)
            if key not in first_of:
                first_of[key] = len(first_of)
                firsts.append(r)
            src.append(first_of[key])
        adapters = [k[0] for k in first_of]
        uniq_ids = [list(k[1])[n_prefix:] for k in first_of]
        cache = new_cache(self.model.config)
        if n_prefix:
            assert self.prefix is not None
            for layer, (k, v) in zip(_layers(cache), self._prefix_kv(adapters)):
                layer.lazy_initialization(k, v)
                _set_kv(layer, k, v)
            self.prefix.reused_tokens += n_prefix * len(uniq_ids)
            self.prefix.rows += len(uniq_ids)
        self.lora.rows = adapters
        lens = [len(x) for x in uniq_ids]
        width = max(lens)
        rows = [[self.pad_id] * (width - n) + x for x, n in zip(uniq_ids, lens)]
        ids = torch.tensor(rows, dtype=torch.long, device=self.device)
        lens_t = torch.tensor(lens, dtype=torch.long, device=self.device)
        padded = min(lens) < width
        mask = None
        pos_ids = torch.arange(width, device=self.device).expand(len(uniq_ids), width)
        if padded:
            mask = torch.arange(width, device=self.device).unsqueeze(0) >= (width - lens_t).unsqueeze(1)
            pos_ids = (mask.long().cumsum(1) - 1).clamp(min=0)
        if n_prefix:
            pos_ids = pos_ids + n_prefix
            lens_t = lens_t + n_prefix
            if mask is not None:
                mask = torch.cat([mask.new_ones(len(uniq_ids), n_prefix), mask], dim=1)
        logits = self._forward(ids, mask, pos_ids, cache, **self._image_kwargs(firsts))
        if len(uniq_ids) < len(reqs):
            idx = torch.tensor(src, dtype=torch.long, device=self.device)
            for layer in _layers(cache):
                _set_kv(layer, layer.keys.index_select(0, idx), layer.values.index_select(0, idx))
            logits = logits.index_select(0, idx)
            lens_t = lens_t.index_select(0, idx)
            mask = mask.index_select(0, idx) if mask is not None else None
        batch = RunningBatch(
            reqs=reqs,
            cache=cache,
            mask=mask,
            pos=lens_t,
            last=torch.zeros(len(reqs), dtype=torch.long, device=self.device),
            n_gen=torch.zeros(len(reqs), dtype=torch.long, device=self.device),
            max_new=torch.tensor([r.params.max_new_tokens for r in reqs], dtype=torch.long, device=self.device),
            stop=stop_matrix(reqs, self.eos_ids, self.device),
            rows=RowParams.build([r.params for r in reqs], self.vocab_size, self.device),
        )
        return self._consume(batch, logits)

    def _image_kwargs(self, rows: list[Request]) -> dict[str, Any]:
        """Image keywords of a prefill over ``rows`` (images in row order: the
        model fills placeholder tokens in that order); {} when none has images."""
        parts = [r.pixels for r in rows if r.pixels is not None]
        if not parts:
            return {}
        dtype = next(self.model.parameters()).dtype
        out = {"pixel_values": torch.cat([p["pixel_values"] for p in parts])[None].to(self.device, dtype)}
        if all("pixel_attention_mask" in p for p in parts):
            out["pixel_attention_mask"] = torch.cat([p["pixel_attention_mask"] for p in parts])[None].to(self.device)
        return out

    def _decode(self, b: RunningBatch) -> None:
        if b.mask is not None:
            b.mask = torch.cat([b.mask, b.mask.new_ones(b.size, 1)], dim=1)
        self.lora.rows = [r.adapter for r in b.reqs]
        logits = self._forward(b.last.unsqueeze(1), b.mask, b.pos.unsqueeze(1), b.cache)
        b.pos = b.pos + 1
        self.batch = self._consume(b, logits)

    def _consume(self, b: RunningBatch, logits: torch.Tensor) -> RunningBatch | None:
        """Sample one token per row, record it, and remove finished rows.
        ``b.pos`` is the position the new token occupies."""
        # Seeded requests: the draw for a token depends on (seed, its absolute position) only.
        u = row_uniforms(
            [r.params.seed for r in b.reqs],
            [len(r.input_ids) + len(r.output_ids) for r in b.reqs],
            self.generator,
            logits.device,
        )
        tok, lp = sample(logits, b.rows, self.generator, u)
        self.tokens_generated += b.size
        b.n_gen = b.n_gen + 1
        b.last = tok
        hit = (tok.unsqueeze(1) == b.stop).any(1)
        done = hit | (b.n_gen >= b.max_new) | (b.pos + 1 >= self.max_positions)
        # One device->host transfer per step for the whole batch.
        toks, lps, hits, dones = torch.stack([tok.double(), lp.double(), hit.double(), done.double()]).cpu().tolist()
        keep = []
        for i, r in enumerate(b.reqs):
            r.output_ids.append(int(toks[i]))
            r.output_logprobs.append(lps[i])
            matched = r.stop_strings.match(r.output_ids) if r.stop_strings is not None and not hits[i] else None
            if matched is not None:
                self._finish(r, "stop", matched_stop=matched)
            elif dones[i]:
                self._finish(r, "stop" if hits[i] else "length")
            else:
                keep.append(i)
        if not keep:
            return None
        if len(keep) < b.size:
            b.select(keep)
        return b
