"""HTTP front of the embedded server: ``python -m areal_kernel.inference.embedded.server``.

Routes (JSON; errors are ``{"error": msg}`` with 400 for bad input naming the
field, 401 for a missing/wrong admin token, 503 while loading, 500 otherwise):

- ``GET /health`` -> ``{"status": "ok"}``
- ``GET /info`` -> ``{"model", "weight_version", "paused", "running", "queued", "device", ...}``
- ``POST /generate {"rid", "input_ids", "sampling_params"}`` ->
  ``{"rid", "output_ids", "output_logprobs", "finish_reason", "weight_version", "matched_stop"}``
  (``sampling_params.stop``: strings that end the generation after the token
  completing one, which stays in ``output_ids``; ``matched_stop`` names it)
- ``POST /pause {"mode": "abort"|"keep"}``; ``POST /resume``; ``POST /abort {"rid"}``
- ``POST /update_weights_from_disk {"path", "version"}``
- ``POST /init_weights_group {"master_addr", "master_port", "world_size", "rank", "group_name", "backend"}``
- ``POST /update_weights_from_distributed {"version", "tensors": [{"name", "dtype", "shape"}], "bucket_bytes"}``
- ``POST /set_version {"version"}``
- LoRA adapters served beside the base weights (``areal_kernel.inference.embedded.lora``):
  ``POST /load_adapter {"name", "path", "version"}`` (a peft adapter directory;
  replaces what is served under ``name``), ``POST /unload_adapter {"name"}``,
  ``POST /update_adapter_from_distributed {"name", "version", "config",
  "tensors", "bucket_bytes"}`` (``config``: the adapter_config.json data);
  ``/generate`` takes ``"adapter": name`` and answers with that adapter's
  version. An adapter update aborts only the running rows of that adapter.

Semantics worth knowing: requests arriving while paused are queued; a weight
update aborts whatever is in the running batch (also rows frozen by
``keep``), because their KV cache came from the old weights and an answer
carries one weight version; queued requests then run on the new weights.

The port is bound *before* the model loads (``/health`` answers 503 until it
is ready), so a port clash is detected in milliseconds and reported with exit
code ``PORT_IN_USE_EXIT`` for the launcher to retry on another port.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import functools
import json
import logging
import os
import signal
import sys
import traceback
from typing import Any

from areal_kernel.utils.network import LOOPBACK_HOSTS, bearer_matches

PORT_IN_USE_EXIT = 98
ADMIN_TOKEN_ENV = "AREAL_EMBEDDED_ADMIN_TOKEN"
# Routes that change server state, and the weight fingerprint (it reads the
# weights and takes engine time); guarded by the admin token when one is set.
CONTROL_ROUTES = frozenset(
    {
        "/pause",
        "/resume",
        "/abort",
        "/update_weights_from_disk",
        "/init_weights_group",
        "/update_weights_from_distributed",
        "/set_version",
        "/load_adapter",
        "/unload_adapter",
        "/update_adapter_from_distributed",
        "/weight_fingerprint",
    }
)

log = logging.getLogger("areal.embedded.server")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m areal_kernel.inference.embedded.server")
    p.add_argument("--model", required=True, help="HF model directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attn-implementation", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument(
        "--admin-token",
        default=None,
        help=f"require 'Authorization: Bearer <token>' on control routes (or set {ADMIN_TOKEN_ENV})",
    )
    p.add_argument(
        "--keepalive-s",
        type=float,
        default=75.0,
        help="close an HTTP connection idle for this long (clients must not reuse pooled connections longer)",
    )
    p.add_argument(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        help="prefill every prompt whole: no KV reused for the prefix the prompts share (bit-repeatable runs)",
    )
    p.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="exit when this process is no longer our parent (the controller died without stopping us)",
    )
    args = p.parse_args(argv)
    if args.max_batch_size < 1:
        p.error("--max-batch-size must be >= 1")
    if args.admin_token is None:
        args.admin_token = os.environ.get(ADMIN_TOKEN_ENV) or None
    if args.host not in LOOPBACK_HOSTS and not args.admin_token:
        # Safe default: open control routes only where nobody else can reach them.
        p.error(
            f"--host {args.host} is not a loopback address ({', '.join(sorted(LOOPBACK_HOSTS))}); "
            f"control routes then need --admin-token or {ADMIN_TOKEN_ENV}"
        )
    return args


class ServerState:
    """What the handlers share: the engine once loaded, the weight group."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.engine: Any = None
        self.model: Any = None
        self.table: dict[str, Any] = {}  # HF name -> live tensor
        self.vocab_size = 0
        self.max_positions = 0
        self.group: Any = None
        self.identity: dict[str, Any] = {}


def load(args: argparse.Namespace, state: ServerState) -> None:
    """Load the model and start the engine (runs in a worker thread)."""
    import torch
    from transformers import AutoModelForCausalLM

    from areal_kernel.inference.embedded.engine import GenerationEngine
    from areal_kernel.platforms import current_platform
    from areal_kernel.weights.apply import model_tensor_table

    threads = int(os.environ.get("OMP_NUM_THREADS", "1") or 1)
    torch.set_num_threads(threads)
    platform = current_platform()
    platform.manual_seed(args.seed)
    device = platform.device()
    attn = args.attn_implementation
    if attn == "sdpa":
        # Same maths as transformers' sdpa, without repeating KV heads under a
        # padding mask on CPU (see attention.py).
        from areal_kernel.inference.embedded.attention import register

        attn = register()
    from areal_kernel.models import vision as V

    images: Any = None
    if V.is_vision_model(args.model):
        # A vision-language model: its image processor turns request images into pixels.
        model = V.load_model(args.model, getattr(torch, args.dtype), attn)
        images = V.ImageTensors(args.model)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            args.model, dtype=getattr(torch, args.dtype), attn_implementation=attn
        )
    model.to(device).eval()
    cfg = model.config
    eos: set[int] = set()
    for src in (getattr(model, "generation_config", None), cfg):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(e, int):
            eos.add(e)
        elif isinstance(e, (list, tuple)):
            eos.update(int(x) for x in e)
    pad = getattr(cfg, "pad_token_id", None)
    state.vocab_size = int(cfg.get_text_config().vocab_size)
    state.max_positions = int(getattr(cfg.get_text_config(), "max_position_embeddings", 1 << 20))
    state.model = model
    state.table = model_tensor_table(model)
    from areal_kernel.inference.fleet import model_identity

    state.identity = model_identity(args.model)
    decode: Any = None
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model)
        # Special tokens stay: a stop string may be one ("</tool_call>").
        decode = functools.partial(tok.decode, skip_special_tokens=False)
    except Exception as e:  # a weights-only directory: serves token ids, just no stop strings
        log.info("no tokenizer in %s (%s: %s); stop strings are unavailable", args.model, type(e).__name__, e)
    engine = GenerationEngine(
        model,
        max_batch_size=args.max_batch_size,
        eos_ids=sorted(eos),
        max_positions=state.max_positions,
        vocab_size=state.vocab_size,
        device=device,
        seed=args.seed,
        pad_id=pad if isinstance(pad, int) and 0 <= pad < state.vocab_size else 0,
        num_threads=threads,
        decode=decode,
        images=images,
        prefix_cache=args.prefix_cache,
    )
    engine.start()
    state.engine = engine
    log.info("model %s loaded (%s, eos=%s)", args.model, args.dtype, sorted(eos))


# -- HTTP ---------------------------------------------------------------------


def build_app(state: ServerState) -> Any:
    from aiohttp import web

    from areal_kernel.errors import ArealError
    from areal_kernel.inference.embedded import protocol as P

    def err(status: int, msg: str) -> web.Response:
        return web.json_response({"error": msg}, status=status)

    @web.middleware
    async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
        token = state.args.admin_token
        if token and request.path in CONTROL_ROUTES:
            if not bearer_matches(request.headers.get("Authorization", ""), token):
                return err(401, f"{request.path} needs header 'Authorization: Bearer <admin token>'")
        if request.path != "/health" and state.engine is None:
            return err(503, "model is still loading")
        try:
            return await handler(request)
        except P.RequestError as e:
            return err(400, str(e))
        except ArealError as e:
            return err(400, str(e))
        except web.HTTPException:
            raise
        except Exception as e:  # the server keeps running; the client sees why
            log.exception("handler %s failed", request.path)
            return err(500, f"{type(e).__name__}: {e}")

    async def body(request: web.Request) -> Any:
        try:
            return await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise P.RequestError(f"{request.path}: body is not valid JSON") from None

    async def wait(fut: Any) -> Any:
        return await asyncio.wrap_future(fut)

    async def health(_: web.Request) -> web.Response:
        if state.engine is None:
            return web.json_response({"status": "loading"}, status=503)
        return web.json_response({"status": "ok"})

    async def info(_: web.Request) -> web.Response:
        e = state.engine
        return web.json_response(
            {
                "model": state.args.model,
                "weight_version": e.version,
                "paused": e.paused,
                "running": e.n_running,
                "queued": e.n_queued,
                "tokens_generated": e.tokens_generated,
                "dtype": state.args.dtype,
                # Where the weights live (e.g. "cuda:0"): how a check tells a GPU server from a CPU one.
                "device": str(next(state.model.parameters()).device),
                "max_batch_size": state.args.max_batch_size,
                "adapters": dict(e.lora.versions),
                # The shared-prompt prefix cache (prefix.py): its length and what it saved; null when off.
                "prefix_cache": e.prefix.stats() if e.prefix is not None else None,
                # What a fleet checks before it admits this server (same model and tokenizer).
                "identity": state.identity,
            }
        )

    async def generate(request: web.Request) -> web.Response:
        b = P.parse_generate(await body(request), state.vocab_size, state.max_positions)
        return web.json_response(await wait(state.engine.submit(b)))

    async def pause(request: web.Request) -> web.Response:
        data = await body(request) if request.can_read_body else {}
        mode = (data or {}).get("mode", "abort")
        if mode not in ("abort", "keep"):
            raise P.RequestError(f"/pause: field 'mode' must be 'abort' or 'keep', got {mode!r}")
        return web.json_response(await wait(state.engine.pause(mode)))

    async def resume(_: web.Request) -> web.Response:
        return web.json_response(await wait(state.engine.resume()))

    async def abort(request: web.Request) -> web.Response:
        rid = P.get_str(await body(request), "rid", "/abort")
        return web.json_response(await wait(state.engine.abort(rid)))

    async def set_version(request: web.Request) -> web.Response:
        v = P.get_int(await body(request), "version", "/set_version", minimum=0)
        return web.json_response(await wait(state.engine.set_version(v)))

    async def update_from_disk(request: web.Request) -> web.Response:
        from areal_kernel.weights.apply import check_meta, copy_into_model
        from areal_kernel.weights.disk import iter_state_dict_dir, read_shapes

        data = await body(request)
        path = P.get_str(data, "path", "/update_weights_from_disk")
        version = P.get_int(data, "version", "/update_weights_from_disk", minimum=0)
        loop = asyncio.get_running_loop()
        # Validate every name and shape from the headers before touching the
        # model, so a bad directory leaves the old weights fully in place.
        shapes = await loop.run_in_executor(None, read_shapes, path)
        check_meta(state.table, [{"name": k, "shape": s} for k, (_, s) in shapes.items()])

        def do_load() -> None:
            copy_into_model(state.table, iter_state_dict_dir(path))

        res = await wait(state.engine.update_weights(do_load, version))
        return web.json_response({"ok": True, **res})

    async def init_group(request: web.Request) -> web.Response:
        from areal_kernel.weights.broadcast import init_weight_group

        data = await body(request)
        what = "/init_weights_group"
        addr = P.get_str(data, "master_addr", what)
        port = P.get_int(data, "master_port", what, minimum=1)
        world = P.get_int(data, "world_size", what, minimum=2)
        rank = P.get_int(data, "rank", what, minimum=1)
        if rank >= world:
            raise P.RequestError(f"{what}: field 'rank' must be in [1, world_size={world}), got {rank}")
        name = P.get_str(data, "group_name", what, default="areal_weights")
        backend = data.get("backend")
        if backend is not None and not isinstance(backend, str):
            raise P.RequestError(f"{what}: field 'backend' must be a string like 'gloo' or 'nccl'")
        timeout = data.get("timeout_s", 300)
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise P.RequestError(f"{what}: field 'timeout_s' must be a positive number")
        if state.group is not None:
            state.group.destroy()
            state.group = None
        # Blocks until every rank joined: keep it off the event loop.
        state.group = await asyncio.get_running_loop().run_in_executor(
            None, lambda: init_weight_group(addr, port, world, rank, name, backend, float(timeout))
        )
        return web.json_response({"ok": True, "rank": rank, "world_size": world})

    async def update_from_dist(request: web.Request) -> web.Response:
        from areal_kernel.weights.apply import check_meta, copy_into_model
        from areal_kernel.weights.broadcast import parse_dtype, recv_buckets

        data = await body(request)
        what = "/update_weights_from_distributed"
        version = P.get_int(data, "version", what, minimum=0)
        bucket = P.get_int(data, "bucket_bytes", what, minimum=1)
        meta = P.parse_tensor_meta(data, what)
        for i, m in enumerate(meta):
            try:
                parse_dtype(m["dtype"])
            except ArealError as e:
                raise P.RequestError(f"{what}: tensors[{i}].dtype: {e}") from None
        check_meta(state.table, meta)
        group = state.group
        if group is None:
            raise P.RequestError(f"{what}: no weight group; call /init_weights_group first")

        def do_load() -> None:
            copy_into_model(state.table, recv_buckets(group, meta, bucket))

        res = await wait(state.engine.update_weights(do_load, version))
        return web.json_response({"ok": True, **res})

    async def load_adapter(request: web.Request) -> web.Response:
        from areal_kernel.engine.lora import read_adapter_dir
        from areal_kernel.errors import DataError

        data = await body(request)
        what = "/load_adapter"
        name = P.get_str(data, "name", what)
        path = P.get_str(data, "path", what)
        version = P.get_int(data, "version", what, minimum=0)
        try:
            config, tensors = await asyncio.get_running_loop().run_in_executor(None, read_adapter_dir, path)
        except DataError as e:
            raise P.RequestError(f"{what}: field 'path': {e}") from None
        lora = state.engine.lora
        # Checked before anything changes: a bad adapter leaves the served one in place.
        lora.check(config, [{"name": k, "shape": list(t.shape)} for k, t in tensors.items()])
        res = await wait(
            state.engine.load_adapter(name, lambda: lora.load(name, config, tensors.items(), version), version)
        )
        return web.json_response({"ok": True, **res})

    async def unload_adapter(request: web.Request) -> web.Response:
        name = P.get_str(await body(request), "name", "/unload_adapter")
        return web.json_response({"ok": True, **(await wait(state.engine.unload_adapter(name)))})

    async def update_adapter_from_dist(request: web.Request) -> web.Response:
        from areal_kernel.weights.broadcast import parse_dtype, recv_buckets

        data = await body(request)
        what = "/update_adapter_from_distributed"
        name = P.get_str(data, "name", what)
        version = P.get_int(data, "version", what, minimum=0)
        bucket = P.get_int(data, "bucket_bytes", what, minimum=1)
        config = data.get("config")
        if not isinstance(config, dict):
            raise P.RequestError(f"{what}: field 'config' must be the adapter's adapter_config.json object")
        meta = P.parse_tensor_meta(data, what)
        for i, m in enumerate(meta):
            try:
                parse_dtype(m["dtype"])
            except ArealError as e:
                raise P.RequestError(f"{what}: tensors[{i}].dtype: {e}") from None
        lora = state.engine.lora
        lora.check(config, meta)
        group = state.group
        if group is None:
            raise P.RequestError(f"{what}: no weight group; call /init_weights_group first")

        def do_load() -> None:
            lora.load(name, config, recv_buckets(group, meta, bucket), version)

        res = await wait(state.engine.load_adapter(name, do_load, version))
        return web.json_response({"ok": True, **res})

    async def weight_fingerprint(request: web.Request) -> web.Response:
        from areal_kernel.monitor.weights import FingerprintSpec, fingerprint

        try:
            spec = FingerprintSpec.from_json(await body(request))
        except ArealError as e:
            raise P.RequestError(f"/weight_fingerprint: {e}") from None
        engine = state.engine

        def compute() -> dict:
            import torch

            # In a worker thread, not on the engine thread: a busy server's
            # generation step (a prefill of many rows takes seconds on a CPU)
            # would delay the answer, and with it the trainer's step. Under the
            # weights lock, which every load and version change holds: never
            # mid-update. Reading the tensors beside a forward is safe (both read).
            with engine.weights_lock, torch.inference_mode():
                if spec.adapter is None:
                    return fingerprint(state.table, spec, engine.version)
                if spec.adapter not in engine.lora:
                    return fingerprint({}, spec, None)
                return fingerprint(engine.lora.tensor_table(spec.adapter), spec, engine.lora.versions[spec.adapter])

        return web.json_response(await asyncio.get_running_loop().run_in_executor(None, compute))

    app = web.Application(middlewares=[guard], client_max_size=64 << 20)
    app.router.add_get("/health", health)
    app.router.add_get("/info", info)
    app.router.add_post("/generate", generate)
    app.router.add_post("/pause", pause)
    app.router.add_post("/resume", resume)
    app.router.add_post("/abort", abort)
    app.router.add_post("/set_version", set_version)
    app.router.add_post("/update_weights_from_disk", update_from_disk)
    app.router.add_post("/init_weights_group", init_group)
    app.router.add_post("/update_weights_from_distributed", update_from_dist)
    app.router.add_post("/load_adapter", load_adapter)
    app.router.add_post("/unload_adapter", unload_adapter)
    app.router.add_post("/update_adapter_from_distributed", update_adapter_from_dist)
    app.router.add_post("/weight_fingerprint", weight_fingerprint)
    return app


async def serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    state = ServerState(args)
    runner = web.AppRunner(build_app(state), access_log=None, keepalive_timeout=args.keepalive_s)
    await runner.setup()
    try:
        await web.TCPSite(runner, args.host, args.port).start()
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            print(f"port {args.port} on {args.host} is already in use", file=sys.stderr, flush=True)
            return PORT_IN_USE_EXIT
        raise
    print(f"listening on http://{args.host}:{args.port} (loading {args.model})", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # The process that started us: a scheduler's agent on this node says so in
    # the environment; started directly, the controller passed its pid.
    parent_pid = int(os.environ.get("AREAL_PARENT_PID") or args.parent_pid or 0)
    if parent_pid:
        # A killed controller (kill -9) cannot stop its servers; they notice
        # being orphaned and stop themselves instead of holding memory forever.
        from areal_kernel.utils.procs import ParentWatch

        parent = ParentWatch(parent_pid)

        async def watch_parent() -> None:
            while not parent.gone():
                await asyncio.sleep(1.0)
            print("parent process is gone; shutting down", file=sys.stderr, flush=True)
            stop.set()

        watcher = asyncio.ensure_future(watch_parent())  # noqa: F841 (kept alive by the loop)
    loader = loop.run_in_executor(None, load, args, state)
    waiters: list[asyncio.Future[Any]] = [loader, asyncio.ensure_future(stop.wait())]
    done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    load_error = loader.exception() if loader in done else None
    if load_error is not None:
        traceback.print_exception(type(load_error), load_error, load_error.__traceback__)
        print(
            f"failed to load model from {args.model!r}: {type(load_error).__name__}: {load_error}",
            file=sys.stderr,
            flush=True,
        )
        await runner.cleanup()
        return 1
    if not stop.is_set():
        print("ready", flush=True)
        await stop.wait()
    if state.engine is not None:
        state.engine.shutdown()
    await runner.cleanup()
    return 0


def main(argv: list[str] | None = None) -> None:
    # Single-threaded torch unless the operator asked otherwise: must be set
    # before torch is imported (it sizes its OpenMP pool once).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    code = asyncio.run(serve(args))
    # The interpreter's own teardown of torch and transformers' modules costs
    # ~1.4 s of CPU on every stop, and the server holds nothing it would
    # flush: exit handlers (logging's, temporary directories') run, the
    # streams are flushed, and the process ends.
    import atexit

    from areal_kernel.utils.procs import flush_std_streams

    atexit._run_exitfuncs()
    flush_std_streams()
    os._exit(code)


if __name__ == "__main__":
    main()
