"""A STAND-IN for an SGLang server (SGLang itself cannot run on these machines).

Written from SGLang's native HTTP API (release 0.5.23, see areal_sglang/__init__.py):
same command line as ``python -m sglang.launch_server`` (it parses the flags it
needs and ignores the rest), same routes, same request bodies, same answer
shapes (``output_ids``, ``meta_info.output_token_logprobs`` as
``[logprob, token_id, text]``, ``meta_info.finish_reason`` as
``{"type": ...}``, string ``weight_version``). When ``AREAL_SGLANG_ORACLE_URL``
is set, its own argv and every request body are first checked by SGLang's
real parser and request classes (tests/sglang_oracle.py); a rejected body is
answered 422 like FastAPI would.

The "model" is a toy by default: the next token is a hash of the loaded
weight files (and of the LoRA adapter a request names) and the last few
tokens, so outputs are deterministic, change when other weights are loaded
and come back when the old ones are reloaded; its logprobs mean nothing.
With ``AREAL_SGLANG_STANDIN_MODEL=hf`` in its environment (not a flag:
SGLang's own parser checks the argv) it serves the real Hugging Face causal
LM of ``--model-path`` instead (``HFModel``: CPU, the ``--dtype`` it is
given), sampling token by token at the request's temperature and reporting
each token's logprob as SGLang does; weight updates and LoRA adapters load
into it. Tokens are produced one at a time with a small delay so that
pauses land mid-generation. Test-only routes live under ``/_standin/``.

LoRA (``--enable-lora``): ``/load_lora_adapter`` / ``/unload_lora_adapter``
and ``GET /v1/models``, which lists the base model and one card per loaded
adapter (``id`` its name, ``root`` the path it was loaded from, ``parent``
the base model), as SGLang's ``available_models`` does; with the oracle,
that answer is checked against SGLang's ``ModelList`` class.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import random
import sys
import time
import urllib.request
from typing import Any

from aiohttp import web

VOCAB = 256


def weights_digest(path: str) -> str:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} is not a directory")
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        if name.endswith((".safetensors", ".bin", ".json")):
            with open(os.path.join(path, name), "rb") as f:
                h.update(name.encode())
                h.update(f.read())
    return h.hexdigest()


def oracle(path: str, payload: dict) -> dict:
    url = os.environ.get("AREAL_SGLANG_ORACLE_URL")
    if not url:
        return {"ok": True}
    req = urllib.request.Request(
        url + path, data=json.dumps(payload).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


class Req:
    def __init__(self, rid: str, ids: list[int], sp: dict, adapter: str | None = None) -> None:
        self.rid, self.ids, self.sp, self.adapter = rid, ids, sp, adapter
        self.out: list[int] = []
        self.lps: list[float] = []
        self.abort = False


def load_tensors(path: str, dtype: str) -> dict[str, Any]:
    """The weights of a safetensors directory in the server's dtype (as SGLang
    holds them after a load); {} for the tests' placeholder files, which are
    not safetensors."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            try:
                out.update(load_file(os.path.join(path, name)))
            except (SafetensorError, OSError, ValueError):
                return {}
    return {k: as_served(v, dtype) for k, v in out.items()}


def as_served(t: Any, dtype: str) -> Any:
    """``t`` converted to the server's --dtype (floating tensors only), as SGLang's loader copies it."""
    import torch

    served = {"half": "float16", "float": "float32"}.get(dtype, dtype)
    if dtype == "auto" or not t.is_floating_point():
        return t.clone()
    return t.to(getattr(torch, served))


class HFModel:
    """The opt-in real model (``AREAL_SGLANG_STANDIN_MODEL=hf``): the HF causal
    LM of the model directory on CPU, in the server's dtype (float32 for
    ``auto``). Each token is one full forward pass without a cache (the
    stand-in serves tiny models; no cache means no cache bugs). LoRA adapters
    are applied unmerged through the kernel's ``AdapterSet`` (the embedded
    server's), selected per request."""

    def __init__(self, path: str, dtype: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from areal_kernel.inference.embedded.lora import AdapterSet

        served = {"half": "float16", "float": "float32", "auto": "float32"}.get(dtype, dtype)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, served)).eval()
        self.adapters = AdapterSet(self.model)

    def load(self, tensors: dict[str, Any]) -> None:
        """Copy ``tensors`` (HF names) into the model; a name it does not have is an error."""
        params = self.model.state_dict()
        unknown = sorted(set(tensors) - set(params))
        if unknown:
            raise ValueError(f"the model has no parameter(s) {unknown[:3]}")
        with self.torch.no_grad():
            for n, t in tensors.items():
                params[n].copy_(t)

    def table(self) -> dict[str, Any]:
        return self.model.state_dict()

    def next_token(self, ids: list[int], sp: dict, rng: random.Random, adapter: str | None) -> tuple[int, float]:
        """One sampled token and its logprob as SGLang reports it (sampler.py,
        default path): temperature 0 is greedy with log_softmax(logits);
        otherwise the token is drawn from softmax(logits / T) restricted by
        top_k / top_p, and its logprob is log_softmax(logits / T), before
        the top-k/top-p truncation."""
        torch = self.torch
        with torch.no_grad():
            self.adapters.rows = [adapter]
            logits = self.model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
        temp = float(sp.get("temperature", 1.0))
        if temp == 0.0:
            tok = int(torch.argmax(logits))
            return tok, float(torch.log_softmax(logits, -1)[tok])
        lps = torch.log_softmax(logits / temp, -1)
        probs = lps.exp()
        top_k = int(sp.get("top_k", -1))
        if 0 < top_k < probs.numel():
            probs = torch.where(probs >= torch.topk(probs, top_k).values[-1], probs, torch.zeros_like(probs))
        top_p = float(sp.get("top_p", 1.0))
        if top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            drop = torch.cumsum(sorted_p, 0) - sorted_p > top_p
            probs = probs.scatter(0, order[drop], 0.0)
        cdf = torch.cumsum(probs.double(), 0)
        tok = int(torch.searchsorted(cdf, rng.random() * float(cdf[-1]), right=True).clamp(max=probs.numel() - 1))
        return tok, float(lps[tok])


class State:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.digest = weights_digest(args.model_path)
        # The weights themselves, for /get_weights_by_name.
        self.tensors = load_tensors(args.model_path, args.dtype)
        mode = os.environ.get("AREAL_SGLANG_STANDIN_MODEL", "toy")
        if mode not in ("toy", "hf"):
            raise SystemExit(f"AREAL_SGLANG_STANDIN_MODEL must be 'toy' or 'hf', got {mode!r}")
        self.hf = HFModel(args.model_path, args.dtype) if mode == "hf" else None
        # Loaded LoRA adapters, in load order: name -> {"path", "digest"} (as SGLang's registry keeps them).
        self.adapters: dict[str, dict[str, str]] = {}
        self.version = args.weight_version
        self.paused: str | None = None  # None or the pause mode
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.running: dict[str, Req] = {}
        self.groups: dict[str, dict] = {}
        self.pgs: dict[str, Any] = {}  # group name -> torch process group (real gloo)
        self.session = False  # inside /begin_weight_update .. /end_weight_update
        self.received: dict[str, str] = {}  # tensor name -> sha256 of the bytes received last
        self.released: set[str] = set()
        self.log: list[dict] = []  # every control call, in order
        self.fail_next = 0
        self.fail_status = 503
        self.fail_route = "/generate"  # the route the injected failures hit
        self.token_delay = float(os.environ.get("AREAL_STANDIN_TOKEN_DELAY_S", "0.01"))

    def next_token(self, ids: list[int], sp: dict, rng: random.Random, adapter: str | None) -> tuple[int, float]:
        if self.hf is not None:
            return self.hf.next_token(ids, sp, rng, adapter)
        greedy = float(sp.get("temperature", 1.0)) == 0.0
        lora = self.adapters[adapter]["digest"] if adapter is not None else ""
        h = hashlib.sha256(f"{self.digest}:{lora}:{ids[-6:]}:{len(ids)}".encode()).digest()
        tok = int.from_bytes(h[:4], "little") % VOCAB
        lp = -0.05 - (h[4] / 255.0) * 2.0
        if not greedy and rng.random() < 0.5:
            tok = rng.randrange(VOCAB)
            lp = -math.log(VOCAB)
        return tok, lp


async def run_generation(st: State, r: Req) -> str:
    sp = r.sp
    rng = random.Random(sp.get("sampling_seed"))
    stop = set(sp.get("stop_token_ids") or [])
    max_new = int(sp.get("max_new_tokens", 128))
    ctx = st.args.context_length
    while True:
        if r.abort:
            return "abort"
        if st.paused in ("in_place", "retract"):
            await st.resumed.wait()
            continue
        if len(r.out) >= max_new or (ctx and len(r.ids) + len(r.out) >= ctx):
            return "length"
        tok, lp = st.next_token(r.ids + r.out, sp, rng, r.adapter)
        r.out.append(tok)
        r.lps.append(lp)
        if tok in stop:
            return "stop"
        await asyncio.sleep(st.token_delay)


# -- SGLang's weight-update group, mirrored (torch.distributed, real gloo) ----------
# SGLang 0.5.23: WeightUpdater.init_weights_update_group (model_runner_components/
# weight_updater.py) calls sglang.srt.utils.init_custom_process_group with
# init_method "tcp://<master_address>:<master_port>", rank rank_offset + tp_rank
# (this stand-in is one TP rank), inside a process that already has a default group.


def join_update_group(
    master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
) -> Any:
    import datetime

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world, rendezvous

    if not dist.is_initialized():  # SGLang asserts its TP default group exists; ours is a 1-rank one
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert group_name != "", "Group name cannot be empty"
    rank = rank_offset + 0
    timeout = datetime.timedelta(seconds=300)
    host = f"[{master_address}]" if ":" in master_address else master_address
    store, rank, world_size = next(rendezvous(f"tcp://{host}:{master_port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = dist.PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size, rank, [], dist.Backend(backend), store, group_name=group_name, backend_options=None, timeout=timeout
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def flattened_bucket_empty(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> tuple[Any, list]:
    """What FlattenedTensorBucket.empty (srt/weight_sync/tensor_bucket.py) allocates:
    one dense uint8 buffer, no padding, a misaligned tensor refused."""
    import torch

    spans = []
    offset = 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        dt = getattr(torch, dtype)
        shape = torch.Size(shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"Negative dimension in received tensor {name}: {shape}")
        if offset % dt.itemsize:
            raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dt}")
        size = shape.numel() * dt.itemsize
        spans.append((name, dt, shape, offset, offset + size))
        offset += size
    if not spans:
        raise ValueError("Cannot create empty tensor bucket")
    return torch.empty(offset, dtype=torch.uint8), spans


def receive_weights(
    pg: Any,
    names: list[str],
    dtypes: list[str],
    shapes: list[list[int]],
    load_format: str | None,
    kept: dict[str, Any] | None = None,
) -> dict[str, str]:
    """WeightUpdater.receive_weights_from_distributed: one broadcast per bucket
    (flattened_bucket) or one per tensor; returns sha256 of each tensor's bytes."""
    import torch
    import torch.distributed as dist

    if load_format == "flattened_bucket":
        flat, spans = flattened_bucket_empty(names, dtypes, shapes)
        dist.broadcast(flat, src=0, group=pg)
        tensors = [(n, flat[a:b].view(dt).reshape(shape)) for n, dt, shape, a, b in spans]
    else:
        tensors = [(n, torch.empty(shape, dtype=getattr(torch, d))) for n, d, shape in zip(names, dtypes, shapes)]
        for handle in [dist.broadcast(t, src=0, group=pg, async_op=True) for _, t in tensors]:
            handle.wait()
    if kept is not None:
        kept.update((n, t.clone()) for n, t in tensors)
    return {
        n: hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        for n, t in tensors
    }


def build_app(st: State) -> web.Application:
    async def body_of(request: web.Request) -> Any:
        raw = await request.read()
        return json.loads(raw) if raw else {}

    def check(route: str, body: Any) -> web.Response | None:
        res = oracle("/check_request", {"route": route, "body": body})
        if not res.get("ok"):
            return web.json_response({"detail": res.get("error")}, status=422)
        return None

    @web.middleware
    async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
        key = st.args.api_key
        if key and request.path != "/health" and request.headers.get("Authorization") != f"Bearer {key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def model_info(request: web.Request) -> web.Response:
        return web.json_response(
            {"model_path": st.args.model_path, "weight_version": st.version, "is_generation": True}
        )

    async def generate(request: web.Request) -> web.Response:
        body = await body_of(request)
        if (bad := check("/generate", body)) is not None:
            return bad
        if st.fail_next > 0 and st.fail_route == "/generate":
            st.fail_next -= 1
            return web.json_response({"error": "injected failure (stand-in)"}, status=st.fail_status)
        if "weights" in st.released:
            return web.json_response({"error": "weights are released (resume_memory_occupation first)"}, status=400)
        # Requests that arrive while paused wait for /continue_generation (as in SGLang).
        await st.resumed.wait()
        rid = body.get("rid") or os.urandom(8).hex()
        if rid in st.running:
            return web.json_response({"error": f"Duplicate request ID detected: {rid}"}, status=400)
        adapter = body.get("lora_path")
        if adapter is not None and adapter not in st.adapters:
            # SGLang's LoRARegistry.acquire refuses a name it has not loaded.
            return web.json_response(
                {"error": {"message": f"The following requested LoRA adapters are not loaded: {adapter}"}}, status=400
            )
        r = Req(rid, list(body["input_ids"]), dict(body.get("sampling_params") or {}), adapter)
        st.running[rid] = r
        t0 = time.monotonic()
        try:
            kind = await run_generation(st, r)
        finally:
            st.running.pop(rid, None)
        fr: dict[str, Any] = {"type": kind}
        if kind == "stop":
            fr["matched"] = r.out[-1]
        elif kind == "length":
            fr["length"] = len(r.out)
        else:
            fr.update(message="Abort in waiting queue" if not r.out else "Aborted", status_code=None, err_type=None)
        meta = {
            "id": rid,
            "finish_reason": fr,
            "prompt_tokens": len(r.ids),
            "completion_tokens": len(r.out),
            "cached_tokens": 0,
            "weight_version": st.version,
            "e2e_latency": time.monotonic() - t0,
        }
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(r.lps, r.out)]
        return web.json_response({"text": "", "output_ids": r.out, "meta_info": meta})

    def control(route: str):
        def deco(fn):
            async def handler(request: web.Request) -> web.Response:
                body = await body_of(request) if request.method == "POST" else {}
                if route != "/flush_cache" and (bad := check(route, body)) is not None:
                    return bad
                if st.fail_next > 0 and st.fail_route == route:
                    # An injected refusal of this control call (the request changes nothing).
                    st.fail_next -= 1
                    return web.json_response(
                        {"success": False, "message": "injected failure (stand-in)"}, status=st.fail_status
                    )
                st.log.append(
                    {
                        "route": route,
                        "body": body,
                        "version": st.version,
                        "paused": st.paused,
                        "running": len(st.running),
                    }
                )
                return await fn(body)

            return handler

        return deco

    def abort_all() -> None:
        for r in st.running.values():
            r.abort = True

    @control("/pause_generation")
    async def pause(body: dict) -> web.Response:
        mode = body.get("mode", "abort")
        st.paused = mode
        st.resumed.clear()
        if mode == "abort":
            abort_all()
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    @control("/continue_generation")
    async def cont(body: dict) -> web.Response:
        st.paused = None
        st.resumed.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def wait_idle() -> None:
        # Without a pause, SGLang's weight update waits for running requests to finish.
        while st.paused is None and st.running:
            await asyncio.sleep(0.005)

    @control("/update_weights_from_disk")
    async def from_disk(body: dict) -> web.Response:
        if body.get("abort_all_requests"):
            abort_all()
        await wait_idle()
        try:
            st.digest = weights_digest(body["model_path"])
            st.tensors = load_tensors(body["model_path"], st.args.dtype)
            if st.hf is not None:
                st.hf.load(st.tensors)
        except (OSError, ValueError) as e:
            return web.json_response(
                {"success": False, "message": f"Failed to load weights: {e}", "num_paused_requests": 0}, status=400
            )
        if body.get("weight_version") is not None:
            st.version = body["weight_version"]
        return web.json_response(
            {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        )

    @control("/init_weights_update_group")
    async def init_group(body: dict) -> web.Response:
        # Joins for real, through the torch.distributed calls SGLang makes (see join_update_group).
        name = body.get("group_name", "weight_update_group")
        try:
            st.pgs[name] = await asyncio.to_thread(
                join_update_group,
                body["master_address"],
                int(body["master_port"]),
                int(body["rank_offset"]),
                int(body["world_size"]),
                name,
                body.get("backend", "nccl"),
            )
        except Exception as e:
            return web.json_response(
                {"success": False, "message": f"Failed to initialize custom process group: {e}."}, status=400
            )
        st.groups[name] = body
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    @control("/destroy_weights_update_group")
    async def destroy_group(body: dict) -> web.Response:
        name = body.get("group_name", "weight_update_group")
        if name not in st.pgs:
            return web.json_response(
                {"success": False, "message": "The group to be destroyed does not exist."}, status=400
            )
        import torch.distributed as dist

        dist.destroy_process_group(st.pgs.pop(name))
        st.groups.pop(name, None)
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    @control("/begin_weight_update")
    async def begin_update(body: dict) -> web.Response:
        if st.session:
            return web.json_response(
                {
                    "success": False,
                    "message": "a weight-update session is already open; call end_weight_update() first",
                },
                status=400,
            )
        st.session = True
        return web.json_response({"success": True, "message": "Success"})

    @control("/end_weight_update")
    async def end_update(body: dict) -> web.Response:
        if not st.session:
            return web.json_response(
                {"success": False, "message": "no weight-update session is open; call begin_weight_update() first"},
                status=400,
            )
        st.session = False
        return web.json_response({"success": True, "message": "Success"})

    @control("/update_weights_from_distributed")
    async def from_dist(body: dict) -> web.Response:
        g = body.get("group_name", "weight_update_group")
        if not st.session:
            return web.json_response(
                {
                    "success": False,
                    "message": "update_weights_from_distributed must run between "
                    "begin_weight_update() and end_weight_update()",
                },
                status=400,
            )
        if g not in st.pgs:
            return web.json_response(
                {
                    "success": False,
                    "message": f"Group {g} not in {list(st.pgs)}. Please call `init_weights_update_group` first.",
                },
                status=400,
            )
        await wait_idle()
        try:
            received: dict[str, Any] = {}
            sums = await asyncio.to_thread(
                receive_weights, st.pgs[g], body["names"], body["dtypes"], body["shapes"], body.get("load_format"),
                received,
            )  # fmt: skip
            served = {n: as_served(t, st.args.dtype) for n, t in received.items()}
            st.tensors.update(served)
            if st.hf is not None:
                st.hf.load(served)
        except Exception as e:
            return web.json_response({"success": False, "message": f"Failed to receive weights: {e}"}, status=400)
        st.received.update(sums)
        st.digest = hashlib.sha256((st.digest + json.dumps(sorted(sums.items()))).encode()).hexdigest()
        if body.get("weight_version") is not None:
            st.version = body["weight_version"]
        return web.json_response({"success": True, "message": "Succeeded to update parameter online."})

    @control("/update_weight_version")
    async def set_version(body: dict) -> web.Response:
        if body.get("abort_all_requests", True):
            abort_all()
        st.version = body["new_version"]
        return web.json_response(
            {"success": True, "message": f"Weight version updated to {st.version}", "new_version": st.version}
        )

    @control("/flush_cache")
    async def flush(body: dict) -> web.Response:
        if st.running and st.paused != "retract":
            return web.Response(text="Flush cache failed: requests are running.\n", status=400)
        return web.Response(text="Cache flushed.\n")

    @control("/abort_request")
    async def abort(body: dict) -> web.Response:
        if body.get("abort_all"):
            abort_all()
        elif body.get("rid") in st.running:
            st.running[body["rid"]].abort = True
        return web.Response(status=200)

    @control("/release_memory_occupation")
    async def release(body: dict) -> web.Response:
        st.released |= set(body.get("tags") or ["weights", "kv_cache"])
        return web.Response(status=200)

    @control("/resume_memory_occupation")
    async def resume_mem(body: dict) -> web.Response:
        st.released -= set(body.get("tags") or ["weights", "kv_cache"])
        return web.Response(status=200)

    async def standin_state(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "version": st.version,
                "paused": st.paused,
                "running": len(st.running),
                "running_tokens": [len(r.out) for r in st.running.values()],
                "released": sorted(st.released),
                "groups": st.groups,
                "log": st.log,
                "digest": st.digest,
                "received": st.received,
                "session": st.session,
                "adapters": st.adapters,
            }
        )

    async def standin_fail(request: web.Request) -> web.Response:
        b = await body_of(request)
        st.fail_next, st.fail_status = int(b.get("n", 1)), int(b.get("status", 503))
        st.fail_route = b.get("route", "/generate")
        return web.json_response({"ok": True})

    async def get_weights_by_name(request: web.Request) -> web.Response:
        # SGLang's own route: the parameter's leading `truncate_size` rows
        # (weight.to(float32).tolist()[:truncate_size]); an unknown name is
        # SGLang's error response ("Get parameter by name failed", HTTP 400).
        body = await body_of(request)
        if (bad := check("/get_weights_by_name", body)) is not None:
            return bad
        st.log.append({"route": "/get_weights_by_name", "body": body, "paused": st.paused})
        # The real model's parameters when there is one (what it generates with).
        t = (st.hf.table() if st.hf is not None else st.tensors).get(body["name"])
        if t is None:
            return web.json_response({"error": {"message": "Get parameter by name failed"}}, status=400)
        import torch

        return web.json_response(t.to(torch.float32).tolist()[: int(body.get("truncate_size", 100))])

    def lora_result(success: bool, error: str | None = None) -> web.Response:
        # LoRAUpdateOutput: loaded_adapters maps every loaded name to its path.
        loaded = {n: a["path"] for n, a in st.adapters.items()}
        return web.json_response(
            {"success": success, "error_message": error, "loaded_adapters": loaded}, status=200 if success else 400
        )

    @control("/load_lora_adapter")
    async def load_lora(body: dict) -> web.Response:
        name, path = body["lora_name"], body["lora_path"]
        if not st.args.enable_lora:
            return lora_result(False, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        if name in st.adapters:
            return lora_result(False, f"Failed to load LoRA adapter {name} because it is already loaded")
        try:
            digest = weights_digest(path)
            if st.hf is not None:
                from areal_kernel.engine.lora import read_adapter_dir

                config, tensors = read_adapter_dir(path)
                st.hf.adapters.load(name, config, sorted(tensors.items()), 0)
        except Exception as e:  # what SGLang's loader says goes into error_message
            return lora_result(False, f"Failed to load LoRA adapter {name} from {path}: {e}")
        st.adapters[name] = {"path": path, "digest": digest}
        return lora_result(True)

    @control("/unload_lora_adapter")
    async def unload_lora(body: dict) -> web.Response:
        name = body["lora_name"]
        if name not in st.adapters:
            return lora_result(False, f"LoRA with name {name} does not exist. Loaded LoRAs: {list(st.adapters)}")
        del st.adapters[name]
        if st.hf is not None:
            st.hf.adapters.unload(name)
        return lora_result(True)

    async def models(request: web.Request) -> web.Response:
        # SGLang's available_models: the base model's card (id and root: the
        # served model name, by default the model path), then one per adapter.
        base = st.args.served_model_name or st.args.model_path
        cards: list[dict[str, Any]] = [
            {"id": base, "object": "model", "created": int(time.time()), "owned_by": "sglang", "root": base,
             "parent": None, "max_model_len": st.args.context_length or 2048}
        ]  # fmt: skip
        if st.args.enable_lora:
            cards += [
                {"id": n, "object": "model", "created": int(time.time()), "owned_by": "sglang", "root": a["path"],
                 "parent": base, "max_model_len": None}
                for n, a in st.adapters.items()
            ]  # fmt: skip
        body = {"object": "list", "data": cards}
        res = oracle("/check_response", {"route": "/v1/models", "body": body})
        if not res.get("ok"):
            return web.json_response(
                {"error": f"stand-in answer rejected by SGLang's class: {res.get('error')}"}, status=500
            )
        return web.json_response(body)

    app = web.Application(middlewares=[auth], client_max_size=64 << 20)
    app.router.add_get("/health", health)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_post("/generate", generate)
    for path, h in [
        ("/pause_generation", pause),
        ("/continue_generation", cont),
        ("/update_weights_from_disk", from_disk),
        ("/init_weights_update_group", init_group),
        ("/update_weights_from_distributed", from_dist),
        ("/update_weight_version", set_version),
        ("/destroy_weights_update_group", destroy_group),
        ("/begin_weight_update", begin_update),
        ("/end_weight_update", end_update),
        ("/abort_request", abort),
        ("/release_memory_occupation", release),
        ("/resume_memory_occupation", resume_mem),
        ("/load_lora_adapter", load_lora),
        ("/unload_lora_adapter", unload_lora),
    ]:
        app.router.add_post(path, h)
    app.router.add_route("*", "/flush_cache", flush)
    app.router.add_route("*", "/get_weights_by_name", get_weights_by_name)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/_standin/state", standin_state)
    app.router.add_post("/_standin/fail_next", standin_fail)
    return app


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sglang-standin")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--api-key", default=None)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--enable-lora", action="store_true")
    args, _rest = p.parse_known_args(argv)  # the other flags only matter to a real SGLang
    return args


def main() -> None:
    argv = sys.argv[1:]
    res = oracle("/check_argv", {"argv": argv})
    if not res.get("ok"):
        print(f"SGLang's argument parser rejected the command line: {res.get('error')}", flush=True)
        sys.exit(2)
    args = parse_args(argv)
    print(f"stand-in SGLang server on {args.host}:{args.port} serving {args.model_path}", flush=True)

    async def serve() -> None:
        st = State(args)
        runner = web.AppRunner(build_app(st), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, args.host, args.port).start()
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
