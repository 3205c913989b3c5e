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

The "model" is a toy: the next token is a hash of the loaded weight files
and the last few tokens, so outputs are deterministic, change when other
weights are loaded and come back when the old ones are reloaded. Tokens are
produced one at a time with a small delay so that pauses land mid-generation.
Test-only routes live under ``/_standin/``.
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
    req = urllib.request.Request(url + path, data=json.dumps(payload).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


class Req:
    def __init__(self, rid: str, ids: list[int], sp: dict) -> None:
        self.rid, self.ids, self.sp = rid, ids, sp
        self.out: list[int] = []
        self.lps: list[float] = []
        self.abort = False


class State:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.digest = weights_digest(args.model_path)
        self.version = args.weight_version
        self.paused: str | None = None  # None or the pause mode
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.running: dict[str, Req] = {}
        self.groups: dict[str, dict] = {}
        self.released: set[str] = set()
        self.log: list[dict] = []  # every control call, in order
        self.fail_next = 0
        self.fail_status = 503
        self.token_delay = float(os.environ.get("AREAL_STANDIN_TOKEN_DELAY_S", "0.01"))

    def next_token(self, ids: list[int], greedy: bool, rng: random.Random) -> tuple[int, float]:
        h = hashlib.sha256(f"{self.digest}:{ids[-6:]}:{len(ids)}".encode()).digest()
        tok = int.from_bytes(h[:4], "little") % VOCAB
        lp = -0.05 - (h[4] / 255.0) * 2.0
        if not greedy and rng.random() < 0.5:
            tok = rng.randrange(VOCAB)
            lp = -math.log(VOCAB)
        return tok, lp


async def run_generation(st: State, r: Req) -> str:
    sp = r.sp
    greedy = float(sp.get("temperature", 1.0)) == 0.0
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
        tok, lp = st.next_token(r.ids + r.out, greedy, rng)
        r.out.append(tok)
        r.lps.append(lp)
        if tok in stop:
            return "stop"
        await asyncio.sleep(st.token_delay)


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
        return web.json_response({"model_path": st.args.model_path, "weight_version": st.version, "is_generation": True})

    async def generate(request: web.Request) -> web.Response:
        body = await body_of(request)
        if (bad := check("/generate", body)) is not None:
            return bad
        if st.fail_next > 0:
            st.fail_next -= 1
            return web.json_response({"error": "injected failure (stand-in)"}, status=st.fail_status)
        if "weights" in st.released:
            return web.json_response({"error": "weights are released (resume_memory_occupation first)"}, status=400)
        # Requests that arrive while paused wait for /continue_generation (as in SGLang).
        await st.resumed.wait()
        rid = body.get("rid") or os.urandom(8).hex()
        if rid in st.running:
            return web.json_response({"error": f"Duplicate request ID detected: {rid}"}, status=400)
        r = Req(rid, list(body["input_ids"]), dict(body.get("sampling_params") or {}))
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
            "id": rid, "finish_reason": fr, "prompt_tokens": len(r.ids), "completion_tokens": len(r.out),
            "cached_tokens": 0, "weight_version": st.version, "e2e_latency": time.monotonic() - t0,
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
                st.log.append({"route": route, "body": body, "version": st.version, "paused": st.paused,
                               "running": len(st.running)})
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
        except OSError as e:
            return web.json_response({"success": False, "message": f"Failed to load weights: {e}",
                                      "num_paused_requests": 0}, status=400)
        if body.get("weight_version") is not None:
            st.version = body["weight_version"]
        return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                                  "num_paused_requests": 0})

    @control("/init_weights_update_group")
    async def init_group(body: dict) -> web.Response:
        # A stand-in cannot join a real NCCL group; it records the request.
        st.groups[body.get("group_name", "weight_update_group")] = body
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    @control("/update_weights_from_distributed")
    async def from_dist(body: dict) -> web.Response:
        g = body.get("group_name", "weight_update_group")
        if g not in st.groups:
            return web.json_response({"success": False, "message": f"Group {g} not in {list(st.groups)}. "
                                      "Please call `init_weights_update_group` first."}, status=400)
        await wait_idle()
        st.digest = hashlib.sha256((st.digest + json.dumps(body["names"])).encode()).hexdigest()
        if body.get("weight_version") is not None:
            st.version = body["weight_version"]
        return web.json_response({"success": True, "message": "Succeeded to update parameter online."})

    @control("/update_weight_version")
    async def set_version(body: dict) -> web.Response:
        if body.get("abort_all_requests", True):
            abort_all()
        st.version = body["new_version"]
        return web.json_response({"success": True, "message": f"Weight version updated to {st.version}",
                                  "new_version": st.version})

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
        return web.json_response({"version": st.version, "paused": st.paused, "running": len(st.running),
                                  "running_tokens": [len(r.out) for r in st.running.values()],
                                  "released": sorted(st.released), "groups": st.groups, "log": st.log,
                                  "digest": st.digest})

    async def standin_fail(request: web.Request) -> web.Response:
        b = await body_of(request)
        st.fail_next, st.fail_status = int(b.get("n", 1)), int(b.get("status", 503))
        return web.json_response({"ok": True})

    app = web.Application(middlewares=[auth], client_max_size=64 << 20)
    app.router.add_get("/health", health)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_post("/generate", generate)
    for path, h in [("/pause_generation", pause), ("/continue_generation", cont),
                    ("/update_weights_from_disk", from_disk), ("/init_weights_update_group", init_group),
                    ("/update_weights_from_distributed", from_dist), ("/update_weight_version", set_version),
                    ("/abort_request", abort), ("/release_memory_occupation", release),
                    ("/resume_memory_occupation", resume_mem)]:
        app.router.add_post(path, h)
    app.router.add_route("*", "/flush_cache", flush)
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
