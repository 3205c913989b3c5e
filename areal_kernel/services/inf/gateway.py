"""The ``areal inf`` gateway: one detached process serving every registered model.

``python -m areal_kernel.services.inf.gateway --home DIR`` (``areal inf run``
starts it in its own session, so it outlives the CLI). It

- binds ``host:port`` (127.0.0.1 by default; anywhere else the control routes
  need ``Authorization: Bearer <admin token>``), then writes ``gateway.json``;
- starts every model listed in ``config.toml``, and those registered later:
  the model's backend is built from a validated experiment config exactly as
  ``areal train`` builds it (``rollout.backend`` + the backend's section), its
  replicas are started by the backend's launcher on devices the local
  scheduler's ``replica_device_plan`` hands out, requests reach them through
  the backend's client (least-loaded, failover), and the kernel's
  ``ServerSupervisor`` restarts a replica whose process dies;
- probes every replica's health route; a live replica that keeps failing it
  is killed so that the supervisor restarts it;
- routes ``/v1/chat/completions``, ``/v1/completions`` (both also streaming)
  and ``/v1/models`` by the request's ``model``;
- on ``POST /admin/shutdown``, SIGTERM or SIGINT stops every replica's
  process group, removes ``gateway.json`` and exits.

Control routes: ``GET /admin/status``, ``GET /admin/models/<name>``,
``POST /admin/models`` (register), ``DELETE /admin/models/<name>``,
``POST /admin/shutdown``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from areal_kernel.agent.openai_wire import sse, token_logprobs
from areal_kernel.errors import ArealError, ConfigError, ServerError
from areal_kernel.logging import get_logger
from areal_kernel.services.detached import control_app, process_start_time, start_error
from areal_kernel.services.inf import openai_api as oa
from areal_kernel.services.inf.state import (
    INF,
    LOG_NAME,
    STATE_NAME,
    GatewaySettings,
    ModelEntry,
    ServiceConfig,
    check_model_name,
    load_config,
    save_config,
)
from areal_kernel.utils.network import bearer_matches

log = get_logger("areal.inf.gateway")
EXIT_BIND_FAILED = 3


class ModelService:
    """One registered model: its backend, replicas, client and supervisor.

    ``prepare`` validates everything a registration names and builds the
    backend (no process yet); ``start`` launches the replicas and blocks
    until they are healthy; both run in worker threads."""

    def __init__(self, name: str, entry: ModelEntry, run_dir: Path, settings: GatewaySettings) -> None:
        self.name = name
        self.entry = entry
        self.run_dir = run_dir
        self.settings = settings
        self.state = "starting"
        self.error: str | None = None
        self.created = int(time.time())
        self.cfg: Any = None  # the validated ExperimentConfig the backend was built from
        self.backend: Any = None
        self.client: Any = None
        self.supervisor: Any = None
        self.tokenizer: Any = None
        self.model_dir = ""
        self.stop_ids: list[int] = []
        self.devices: list[list[int]] = []
        self.health: dict[str, str] = {}
        self.fails: dict[str, int] = {}
        self._stopped = threading.Event()

    # -- validation and start (worker threads) ------------------------------------------
    def prepare(self, taken: set[int]) -> None:
        from areal_kernel.config.allocation import AllocationError, parse_allocation
        from areal_kernel.config.models import ExperimentConfig
        from areal_kernel.config.resolve import resolve
        from areal_kernel.config.sections import format_validation_error, validate_settings
        from areal_kernel.platforms import current_platform
        from areal_kernel.plugins import get_registry
        from areal_kernel.scheduling.local import replica_device_plan
        from areal_kernel.trainer.components import load_tokenizer, resolve_model_dir

        e = self.entry
        try:
            alloc = parse_allocation(e.backend)
        except AllocationError as err:
            raise ConfigError(f"--backend: {err}") from None
        try:
            spec = get_registry().get("inference_engine", alloc.backend)
        except ArealError as err:
            raise ConfigError(f"--backend: {err}") from None
        # The backend's own section, validated against the model it registered
        # (what `rollout.<backend>: {...}` is in a training config).
        try:
            settings = validate_settings("--set", "inference_engine", alloc.backend, e.args, spec=spec)
        except ConfigError as err:
            # "--set.max_model_len: ..." -> "--set max_model_len: ... (settings of backend 'vllm')"
            msg = str(err).replace("--set.", "--set ")
            raise ConfigError(f"{msg} (settings of backend '{alloc.backend}')") from None
        dtype = e.dtype or (e.args.get("dtype") if e.args.get("dtype") in ("float32", "bfloat16") else "float32")
        raw: dict[str, Any] = {
            "experiment_name": f"inf-{self.name}",
            "model": {"path": e.model_path, "dtype": dtype},
            "rollout": {
                "backend": e.backend,
                "max_server_restarts": e.max_restarts,
                "request_timeout_s": self.settings.request_timeout_s,
            },
        }
        if settings is not None:
            raw["rollout"][alloc.backend] = settings
        try:
            cfg = resolve(ExperimentConfig.model_validate(raw), get_registry())
        except ValidationError as err:
            raise ConfigError(format_validation_error(err, model=ExperimentConfig)) from None
        try:
            self.model_dir = resolve_model_dir(cfg)
        except ArealError as err:
            raise ConfigError(str(err).replace("model.path", "--model-path", 1)) from None
        if not os.path.isdir(self.model_dir):
            raise ConfigError(f"--model-path {e.model_path!r}: not a directory (expected an HF model directory)")
        try:
            self.tokenizer = load_tokenizer(self.model_dir)
        except ArealError as err:
            raise ConfigError(str(err).replace("model.path", "--model-path", 1)) from None
        self.stop_ids = _stop_ids(self.tokenizer, self.model_dir)
        from areal_kernel.api.inference_engine import InferenceBackendContext

        self.backend = get_registry().build("inference_engine", alloc.backend, InferenceBackendContext.for_config(cfg))
        self.cfg = cfg
        self.devices = replica_device_plan(current_platform(), alloc, taken)

    def start(self) -> None:
        from areal_kernel.inference.supervisor import start_supervisor

        self.run_dir.mkdir(parents=True, exist_ok=True)
        addresses = self.backend.launch(self.model_dir, self.devices, str(self.run_dir))
        if self._stopped.is_set():
            raise ServerError("deregistered while starting")
        self.client = self.backend.make_client(addresses)
        self.supervisor = start_supervisor(self.backend, self.client, self.cfg.rollout)
        self.health = {a: "healthy" for a in addresses}

    def stop(self) -> None:
        self._stopped.set()
        if self.supervisor is not None:
            self.supervisor.stop()  # first: replicas stopped below must not be restarted
        if self.client is not None:
            self.client.destroy()
        if self.backend is not None:
            self.backend.stop()

    # -- health (worker thread) -----------------------------------------------------------
    def check_health(self) -> None:
        """Probe every replica; kill one that is alive but keeps failing (the
        supervisor then restarts it, as it does a replica that died)."""
        if self.state != "ready":
            return
        if self.supervisor is not None and self.supervisor.error is not None:
            self.state = "failed"
            self.error = one_line(str(self.supervisor.error))
            log.error("model failed: replica restarts exhausted", model=self.name, error=self.error)
            return
        launcher = self.backend.launcher
        exited = launcher.exited()
        held = {s.address for s in self.client.servers if s.held}
        for i, info in enumerate(launcher.servers):
            a = info.address
            if a in held:
                self.health[a], self.fails[a] = "restarting", 0
            elif i in exited:
                self.health[a], self.fails[a] = "dead", 0
            elif launcher.healthy(a):
                self.health[a], self.fails[a] = "healthy", 0
            else:
                self.fails[a] = self.fails.get(a, 0) + 1
                self.health[a] = "unhealthy"
                if self.fails[a] >= self.settings.unhealthy_after:
                    log.warning(
                        "replica failed its health checks; killing it so that it is restarted",
                        model=self.name, replica=i, address=a, failed_probes=self.fails[a],
                    )  # fmt: skip
                    try:
                        os.killpg(info.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                    self.fails[a] = 0

    # -- reporting --------------------------------------------------------------------------
    def replicas(self) -> list[dict[str, Any]]:
        launcher = self.backend.launcher if self.backend is not None else None
        if launcher is None:
            return []
        restarts = dict(self.supervisor.restarts) if self.supervisor is not None else {}
        out = []
        for i, info in enumerate(launcher.servers):
            out.append(
                {
                    "index": i,
                    "address": info.address,
                    "pid": info.pid,
                    "start_time": process_start_time(info.pid),
                    "devices": list(info.device_ids),
                    "log": info.log_path,
                    "health": self.health.get(info.address, "starting"),
                    "restarts": restarts.get(info.address, 0),
                }
            )
        return out

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "backend": self.entry.backend,
            "model_path": self.entry.model_path,
            "model_dir": self.model_dir,
            "dtype": self.entry.dtype,
            "args": self.entry.args,
            "state": self.state,
            "error": self.error,
            "replicas": self.replicas(),
            "requests": self.client.stats.get("requests", 0) if self.client is not None else 0,
            "created": self.created,
        }

    # -- generation (event loop) ---------------------------------------------------------
    async def generate(self, ids: list[int], s: oa.Sampling, max_new: int, seed: int | None) -> Any:
        from areal_kernel.api.io import GenerationConfig, ModelRequest

        gconfig = GenerationConfig(
            max_new_tokens=max_new, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
            greedy=s.greedy, stop_token_ids=list(self.stop_ids), seed=seed,
        )  # fmt: skip
        try:
            return await self.client.agenerate(ModelRequest(input_ids=list(ids), gconfig=gconfig))
        except ServerError as e:
            msg = one_line(str(e))
            # The client raises at once (no failover) when a replica rejects a
            # request (HTTP 4xx): that is the request's fault, e.g. too long.
            if "rejected the request (HTTP 4" in msg:
                raise oa.OpenAIError(400, f"model '{self.name}': {msg}") from None
            raise oa.OpenAIError(503, f"model '{self.name}' could not answer: {msg}", code="replica_error") from None


def one_line(error: str) -> str:
    """A launcher's or supervisor's error (command, log tail...) cut to its
    first line plus the log file it names: the whole tail is in that log."""
    lines = error.strip().splitlines()
    logs = [ln.strip()[len("log:") :].strip() for ln in lines[1:] if ln.strip().startswith("log:")]
    return lines[0] + (f" (log: {logs[0]})" if logs else "") if lines else error


def _stop_ids(tokenizer: Any, model_dir: str) -> list[int]:
    """EOS ids from the tokenizer and the model's generation config: where a
    chat answer ends (vLLM's token route stops only where it is told)."""
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    path = os.path.join(model_dir, "generation_config.json")
    try:
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, ValueError):
        eos = None
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, list):
        ids.update(int(x) for x in eos if isinstance(x, int))
    return sorted(ids)


class Gateway:
    def __init__(self, home: Path, config: ServiceConfig, host: str, port: int, token: str | None) -> None:
        self.home = home
        self.config = config
        self.settings = config.gateway
        self.host = host
        self.port = port
        self.token = token
        self.models: dict[str, ModelService] = {}
        self.started = int(time.time())
        self.stop_event = asyncio.Event()
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="areal-inf")
        self._state_snapshot: Any = None
        self._config_lock = threading.Lock()
        # One registration validated at a time: each one's device plan must see the others'.
        self._prepare_lock = asyncio.Lock()

    # -- helpers -----------------------------------------------------------------------------
    async def run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def taken_devices(self) -> set[int]:
        return {d for s in self.models.values() if s.state in ("starting", "ready") for r in s.devices for d in r}

    def save_models(self) -> None:
        with self._config_lock:
            save_config(self.home, self.config)

    def write_state(self) -> None:
        replicas = {
            name: [{"pid": r["pid"], "start_time": r["start_time"]} for r in s.replicas()]
            for name, s in self.models.items()
        }
        self._state_snapshot = INF.publish_state(
            self.home, self._state_snapshot, host=self.host, port=self.port, token=self.token, started=self.started,
            replicas=replicas,
        )  # fmt: skip

    def status(self) -> dict[str, Any]:
        return {
            "gateway": {
                "pid": os.getpid(),
                "url": f"http://{self.host}:{self.port}",
                "host": self.host,
                "port": self.port,
                "started": self.started,
                "admin_token_required": self.token is not None,
                "log": str(self.home / LOG_NAME),
                "home": str(self.home),
            },
            "models": [s.status() for s in self.models.values()],
        }

    def known(self) -> str:
        return ", ".join(sorted(self.models)) or "none"

    # -- model lifecycle ----------------------------------------------------------------------
    async def add_model(self, name: str, entry: ModelEntry, *, persist: bool) -> ModelService:
        """Validate and reserve ``name``, then start its replicas in the background."""
        current = self.models.get(name)
        if current is not None and current.state != "failed":
            raise oa.OpenAIError(
                409,
                f"--model-name: a model named '{name}' is already registered (backend {current.entry.backend}, "
                f"{current.state}); deregister it first or choose another name",
                code="duplicate_model",
            )
        svc = ModelService(name, entry, self.home / "models" / name, self.settings)
        self.models[name] = svc  # reserved while it is validated: a second register of it is a duplicate
        try:
            async with self._prepare_lock:
                await self.run(svc.prepare, self.taken_devices())
        except Exception as e:
            if self.models.get(name) is svc:
                if current is not None:
                    self.models[name] = current
                else:
                    del self.models[name]
            if isinstance(e, ArealError):
                raise oa.OpenAIError(400, str(e), code="invalid_registration") from None
            # Backend (plugin) code that crashed on this registration: say whose and what.
            log.exception("registration failed", model=name)
            raise oa.OpenAIError(500, f"building backend {entry.backend!r} failed: {type(e).__name__}: {e}") from None
        asyncio.ensure_future(self._start(svc, persist))
        return svc

    async def _start(self, svc: ModelService, persist: bool) -> None:
        log.info("starting model", model=svc.name, backend=svc.entry.backend, model_dir=svc.model_dir)
        try:
            await self.run(svc.start)
        except BaseException as e:  # any failure is the model's state, never the gateway's death
            if svc.state == "stopping":
                return
            svc.state = "failed"
            full = str(e) if isinstance(e, ArealError) else f"{type(e).__name__}: {e}"
            svc.error = one_line(full)
            log.error("model failed to start", model=svc.name, error=full)
            await self.run(svc.stop)
            self.write_state()
            return
        if svc.state == "stopping":
            return
        svc.state = "ready"
        if persist:
            self.config.models[svc.name] = svc.entry
            await self.run(self.save_models)
        log.info("model ready", model=svc.name, replicas=[r["address"] for r in svc.replicas()])
        self.write_state()

    async def remove_model(self, name: str) -> ModelService:
        svc = self.models.get(name)
        if svc is None:
            raise oa.OpenAIError(
                404, f"no model named '{name}' is registered; registered: {self.known()}", code="model_not_found"
            )
        svc.state = "stopping"
        if name in self.config.models:
            del self.config.models[name]
            await self.run(self.save_models)
        if svc.client is not None:
            await svc.client.aclose(current_loop_only=True)
        await self.run(svc.stop)
        if self.models.get(name) is svc:
            del self.models[name]
        log.info("model deregistered", model=name)
        self.write_state()
        return svc

    async def restore(self) -> None:
        """Start the models ``config.toml`` lists (registered before a restart)."""
        for name, entry in list(self.config.models.items()):
            try:
                await self.add_model(name, entry, persist=False)
            except oa.OpenAIError as e:
                # Kept in config.toml: the user decides (fix the file, or deregister).
                svc = ModelService(name, entry, self.home / "models" / name, self.settings)
                svc.state, svc.error = "failed", e.message
                self.models[name] = svc
                log.error("registered model cannot start", model=name, error=e.message)

    async def health_loop(self) -> None:
        while not self.stop_event.is_set():
            for svc in list(self.models.values()):
                try:
                    await self.run(svc.check_health)
                except Exception as e:  # a probe bug must not end health checks
                    log.warning("health check failed", model=svc.name, error=f"{type(e).__name__}: {e}")
            self.write_state()
            try:
                await asyncio.wait_for(self.stop_event.wait(), self.settings.health_interval_s)
            except asyncio.TimeoutError:
                pass

    async def shutdown(self) -> None:
        log.info("stopping every model", models=sorted(self.models))
        for svc in self.models.values():
            svc.state = "stopping"
            if svc.client is not None:
                await svc.client.aclose(current_loop_only=True)
        await asyncio.gather(*(self.run(s.stop) for s in self.models.values()))

    # -- OpenAI routes -------------------------------------------------------------------------
    def model_for(self, body: dict[str, Any]) -> ModelService:
        name = body.get("model")
        if not isinstance(name, str) or not name:
            raise oa.OpenAIError(400, "'model' is required: the name a model was registered under", param="model")
        svc = self.models.get(name)
        if svc is None:
            raise oa.OpenAIError(
                404,
                f"the model '{name}' does not exist: no model of that name is registered; registered: {self.known()}",
                param="model",
                code="model_not_found",
            )
        if svc.state != "ready":
            why = f": {svc.error}" if svc.error else ""
            raise oa.OpenAIError(503, f"model '{name}' is {svc.state}{why}", param="model", code="model_not_ready")
        return svc

    async def completions(self, body: dict[str, Any], chat: bool) -> Any:
        svc = self.model_for(body)
        s = oa.parse_sampling(body, self.settings.default_max_tokens, chat=chat)
        ids = (
            oa.chat_prompt_ids(svc.tokenizer, body, svc.name) if chat else oa.completion_prompt_ids(svc.tokenizer, body)
        )
        if s.stream:
            return svc, s, ids
        seeds = [None if s.seed is None else s.seed + i for i in range(s.n)]
        outs = await asyncio.gather(*(svc.generate(ids, s, s.max_tokens, seed) for seed in seeds))
        choices = []
        n_out = 0
        for i, r in enumerate(outs):
            text, stopped = oa.cut_at_stop(svc.tokenizer.decode(r.output_ids, skip_special_tokens=True), s.stop)
            finish = "stop" if stopped or r.stop_reason.value == "stop" else "length"
            n_out += len(r.output_ids)
            lps = token_logprobs(svc.tokenizer.decode, r.output_ids, r.output_logprobs) if s.logprobs else None
            if chat:
                choices.append(
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": finish,
                        "logprobs": {"content": lps} if lps is not None else None,
                    }
                )
            else:
                choices.append(
                    {
                        "index": i,
                        "text": text,
                        "finish_reason": finish,
                        "logprobs": (
                            {"tokens": [x["token"] for x in lps], "token_logprobs": [x["logprob"] for x in lps]}
                            if lps is not None
                            else None
                        ),
                    }
                )
        return {
            "id": oa.new_id("chatcmpl" if chat else "cmpl"),
            "object": "chat.completion" if chat else "text_completion",
            "created": oa.now(),
            "model": svc.name,
            "choices": choices,
            "usage": oa.usage(len(ids), n_out),
        }

    async def stream(self, request: Any, svc: ModelService, s: oa.Sampling, ids: list[int], chat: bool) -> Any:
        """Server-sent events: the generation runs ``stream_chunk_tokens`` at a
        time (each step continues from the tokens so far, as the client does
        after an interruption), and each step's new text is sent at once."""
        from aiohttp import web

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        cid = oa.new_id("chatcmpl" if chat else "cmpl")
        created = oa.now()
        obj = "chat.completion.chunk" if chat else "text_completion"

        async def send(choices: list[dict[str, Any]], **extra: Any) -> None:
            data = {"id": cid, "object": obj, "created": created, "model": svc.name, "choices": choices, **extra}
            await resp.write(sse(data))

        def choice(i: int, text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
            if not chat:
                return {"index": i, "text": text or "", "finish_reason": finish, "logprobs": None}
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"index": i, "delta": delta, "finish_reason": finish, "logprobs": None}

        try:
            await self._stream_choices(resp, send, choice, svc, s, ids, chat)
        except ConnectionResetError:
            return resp  # the caller went away; nothing more to send
        await resp.write(sse("[DONE]"))
        await resp.write_eof()
        return resp

    async def _stream_choices(
        self, resp: Any, send: Any, choice: Any, svc: ModelService, s: oa.Sampling, ids: list[int], chat: bool
    ) -> None:
        n_out = 0
        try:
            for i in range(s.n):
                seed = None if s.seed is None else s.seed + i
                if chat:
                    await send([choice(i, "", None, role=True)])
                out: list[int] = []
                texts = oa.TextStream(svc.tokenizer, s.stop)
                finish = "length"
                while len(out) < s.max_tokens:
                    k = min(self.settings.stream_chunk_tokens, s.max_tokens - len(out))
                    r = await svc.generate(ids + out, s, k, seed)
                    out.extend(r.output_ids)
                    # No token at all: the context is full (a step would never make progress).
                    ended = r.stop_reason.value == "stop" or len(out) >= s.max_tokens or not r.output_ids
                    delta, stopped = texts.delta(out, final=ended)
                    if delta:
                        await send([choice(i, delta, None)])
                    if stopped or r.stop_reason.value == "stop":
                        finish = "stop"
                        break
                    if ended:
                        break
                n_out += len(out)
                await send([choice(i, None if chat else "", finish)])
            if s.include_usage:
                await send([], usage=oa.usage(len(ids), n_out))
        except oa.OpenAIError as e:
            # Headers are sent: the error travels as an event, as OpenAI's API does.
            await resp.write(sse(e.body()))

    # -- the HTTP app -------------------------------------------------------------------------
    def app(self) -> Any:
        from aiohttp import web

        def error(e: oa.OpenAIError) -> web.Response:
            return web.json_response(e.body(), status=e.status)

        @web.middleware
        async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
            if self.token and request.path.startswith("/admin"):
                if not bearer_matches(request.headers.get("Authorization", ""), self.token):
                    return error(
                        oa.OpenAIError(
                            401,
                            f"{request.path} needs 'Authorization: Bearer <admin token>' (the gateway listens "
                            f"beyond loopback; the token is in {self.home / STATE_NAME})",
                            code="unauthorized",
                        )
                    )
            try:
                return await handler(request)
            except oa.OpenAIError as e:
                return error(e)
            except web.HTTPException as e:
                if e.status < 400:
                    raise
                # aiohttp's own answers (no such route, wrong method) in OpenAI's shape too: clients parse them.
                if e.status == 404:
                    msg = (f"{request.method} {request.path}: no such route; the gateway serves GET /v1/models, "
                           "POST /v1/chat/completions and POST /v1/completions")  # fmt: skip
                    return error(oa.OpenAIError(404, msg, code="unknown_route"))
                if e.status == 405:
                    return error(oa.OpenAIError(405, f"{request.method} {request.path}: method not allowed",
                                                code="method_not_allowed"))  # fmt: skip
                return error(oa.OpenAIError(e.status, f"{request.method} {request.path}: {e.reason}"))
            except Exception as e:  # the gateway keeps serving; the caller sees why
                log.exception("request failed", path=request.path)
                return error(oa.OpenAIError(500, f"{type(e).__name__}: {e}"))

        async def body_of(request: web.Request) -> dict[str, Any]:
            try:
                data = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise oa.OpenAIError(400, f"{request.path}: the body is not valid JSON") from None
            if not isinstance(data, dict):
                raise oa.OpenAIError(400, f"{request.path}: the body must be a JSON object")
            return data

        def model_card(s: ModelService) -> dict[str, Any]:
            return {"id": s.name, "object": "model", "created": s.created, "owned_by": "areal", "root": s.model_dir}

        async def list_models(_: web.Request) -> web.Response:
            data = [model_card(s) for s in self.models.values() if s.state == "ready"]
            return web.json_response({"object": "list", "data": data})

        async def get_model(request: web.Request) -> web.Response:
            return web.json_response(model_card(self.model_for({"model": request.match_info["name"]})))

        async def chat(request: web.Request) -> web.StreamResponse:
            return await complete(request, True)

        async def completion(request: web.Request) -> web.StreamResponse:
            return await complete(request, False)

        async def complete(request: web.Request, is_chat: bool) -> web.StreamResponse:
            out = await self.completions(await body_of(request), is_chat)
            if isinstance(out, tuple):
                svc, sampling, ids = out
                return await self.stream(request, svc, sampling, ids, chat=is_chat)
            return web.json_response(out)

        async def model_status(request: web.Request) -> web.Response:
            name = request.match_info["name"]
            svc = self.models.get(name)
            if svc is None:
                raise oa.OpenAIError(
                    404, f"no model named '{name}' is registered; registered: {self.known()}", code="model_not_found"
                )
            return web.json_response(svc.status())

        async def register(request: web.Request) -> web.Response:
            data = await body_of(request)
            name = data.pop("name", None)
            try:
                check_model_name(name if isinstance(name, str) else "")
            except ConfigError as e:
                raise oa.OpenAIError(400, str(e), param="name") from None
            try:
                entry = ModelEntry.model_validate(data)
            except ValidationError as e:
                from areal_kernel.config.sections import format_validation_error

                raise oa.OpenAIError(400, format_validation_error(e, model=ModelEntry)) from None
            svc = await self.add_model(name, entry, persist=True)
            return web.json_response(svc.status(), status=202)

        async def deregister(request: web.Request) -> web.Response:
            svc = await self.remove_model(request.match_info["name"])
            return web.json_response({"ok": True, "name": svc.name, "replicas_stopped": len(svc.devices)})

        app = control_app(guard, 32 << 20, lambda: {"status": "ok"}, self.status, self.stop_event)
        app.router.add_get("/v1/models", list_models)
        app.router.add_get("/v1/models/{name}", get_model)
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_post("/v1/completions", completion)
        app.router.add_get("/admin/models/{name}", model_status)
        app.router.add_post("/admin/models", register)
        app.router.add_delete("/admin/models/{name}", deregister)
        return app


async def serve(home: Path, config: ServiceConfig, host: str, port: int, token: str | None) -> int:
    gw = Gateway(home, config, host, port, token)
    runner = await INF.listen(gw.app(), host, port)
    if runner is None:
        return EXIT_BIND_FAILED
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, gw.stop_event.set)
    gw.write_state()
    log.info("gateway listening", url=f"http://{host}:{port}", admin_token_required=token is not None)
    await gw.restore()
    health = asyncio.ensure_future(gw.health_loop())
    await gw.stop_event.wait()
    health.cancel()
    try:
        await gw.shutdown()
    finally:
        INF.remove_state(home, os.getpid())
        await runner.cleanup()
        gw.pool.shutdown(wait=False, cancel_futures=True)
    log.info("gateway stopped")
    return 0


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    p = argparse.ArgumentParser(prog="python -m areal_kernel.services.inf.gateway")
    p.add_argument("--home", required=True, help="the service directory ($AREAL_HOME/inf)")
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None)
    args = p.parse_args(argv)
    home = Path(args.home)
    try:
        config = load_config(home)
        host = args.host or config.gateway.host
        port = args.port or config.gateway.port
        token = INF.admin_token(host, config.gateway.admin_token)
        from areal_kernel.plugins import get_plugin_manager

        get_plugin_manager().ensure_loaded()  # once, before worker threads look names up
    except ArealError as e:
        start_error(str(e))
        sys.exit(2)
    sys.exit(asyncio.run(serve(home, config, host, port, token)))


if __name__ == "__main__":
    main()
