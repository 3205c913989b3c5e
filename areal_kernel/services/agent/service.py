"""The ``areal agent`` service: one detached process running N agent workers.

``python -m areal_kernel.services.agent.service --home DIR`` (``areal agent
run`` starts it in its own session, so it outlives the CLI). It

- reads ``run.json`` (``AgentRunSpec``) and its records (a ``.jsonl`` file,
  or the dataset section of a config through the kernel's dataset registry);
- binds its control address, then writes ``service.json``;
- local mode: starts the model exactly as ``areal inf register`` does
  (``services.inf.gateway.ModelService``: backend section validated, replicas
  launched by the backend's launcher, restarted by the kernel's supervisor,
  reached through the backend's client), and the kernel's agent proxy in
  front of it; every session gets a ``SessionAffinity`` view of the client,
  so a session's turns go to the replica that answered its first one;
- online RL mode (``proxy_url``): sessions are opened on a training run's
  proxy (``areal agent serve``), which trains on them once rewarded;
- starts the workers (``worker``), each in its own process group; a worker
  asks ``POST /work/next`` for a record and a session, runs the agent and
  reports ``POST /work/done``; the service sets the reward, ends the session
  and appends it (with its token-exact rows) to ``sessions.jsonl``;
- restarts a worker that died (its record is handed out again);
- on ``POST /admin/shutdown``, SIGTERM or SIGINT stops workers, proxy and
  model replicas, removes ``service.json`` and exits.

Control routes (``/admin/*`` need the admin token off loopback):
``GET /health``, ``GET /admin/status``, ``POST /admin/shutdown``; the work
routes need the workers' token (``AREAL_AGENT_WORKER_TOKEN``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import http.client
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_kernel.errors import ArealError, ConfigError, DataError
from areal_kernel.logging import get_logger
from areal_kernel.services.agent.spec import (
    AGENT,
    LOG_NAME,
    SESSION_LOG,
    SPEC_NAME,
    STATE_NAME,
    WORKER_TOKEN_ENV,
    AgentRunSpec,
)
from areal_kernel.services.detached import (
    connect_host,
    control_app,
    kill_groups,
    process_start_time,
    spawn_logged,
    start_error,
)
from areal_kernel.utils.network import bearer_matches

log = get_logger("areal.agent.service")
EXIT_BIND_FAILED = 3
WORKER_MODULE = "areal_kernel.services.agent.worker"


class SessionAffinity:
    """One session's view of the inference client: every request after the
    first goes to the replica that answered the previous one (it holds the
    conversation's prefix in cache); another replica only if that one is down."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner  # the proxy closes the wrapped client's connections, not this view's
        self.server: str | None = None
        self.servers: list[str] = []

    async def agenerate(self, req: Any) -> Any:
        if self.server:
            req.metadata["server"] = self.server
        resp = await self.inner.agenerate(req)
        if resp.server:
            self.server = resp.server
            if resp.server not in self.servers:
                self.servers.append(resp.server)
        return resp


def read_jsonl(path: Path, what: str) -> list[dict[str, Any]]:
    """Records of a ``.jsonl`` file: one JSON object a line (blank lines skipped)."""
    out: list[dict[str, Any]] = []
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{what} {path}: cannot read: {e}") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise DataError(f"{what} {path}, line {n}: not JSON ({e})") from None
        if not isinstance(rec, dict):
            raise DataError(f"{what} {path}, line {n}: a record must be a JSON object, got {type(rec).__name__}")
        rec.setdefault("id", f"rec-{len(out)}")
        out.append(rec)
    if not out:
        raise DataError(f"{what} {path}: no records")
    return out


def load_spec_records(spec: AgentRunSpec) -> list[dict[str, Any]]:
    if spec.records:
        return read_jsonl(Path(spec.records), "--records")
    from areal_kernel.config import load_config
    from areal_kernel.plugins import get_registry
    from areal_kernel.trainer.components import load_data

    assert spec.dataset is not None
    train, _ = load_data(load_config(spec.dataset, registry=get_registry()), (), needed_by="areal agent run")
    return train


@dataclass
class Work:
    """One record being run by one worker in one proxy session."""

    record: dict[str, Any]
    worker: int
    session_id: str
    api_key: str
    base_url: str
    session: Any = None  # local mode: the proxy's Session
    affinity: SessionAffinity | None = None
    started: float = field(default_factory=time.time)


@dataclass
class Worker:
    index: int
    log_path: Path
    proc: subprocess.Popen | None = None
    restarts: int = 0
    sessions: int = 0
    start_time: int | None = None


class AgentService:
    def __init__(self, home: Path, spec: AgentRunSpec, token: str | None, worker_token: str) -> None:
        self.home = home
        self.spec = spec
        self.token = token
        self.worker_token = worker_token
        self.state = "starting"
        self.error: str | None = None
        self.started = int(time.time())
        self.running_since: float | None = None
        self.records: list[dict[str, Any]] = []
        self.queue: collections.deque[dict[str, Any]] = collections.deque()
        self.epoch = 0
        self.model: Any = None  # local mode: services.inf.gateway.ModelService
        self.proxy: Any = None  # local mode: the AgentProxy
        self.workers: list[Worker] = []
        self.inflight: dict[int, Work] = {}
        self.finished = 0
        self.failed = 0
        self.rewarded = 0
        self.reward_sum = 0.0
        self.tokens = 0
        self.port = spec.port
        self.stop_event = asyncio.Event()
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="areal-agent")
        self._snapshot: Any = None
        self._done_logged = False
        self._session_log = open(home / SESSION_LOG, "a", encoding="utf-8")

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.port}"

    async def run_in_pool(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # -- start ------------------------------------------------------------------------------
    def start_backend(self) -> None:
        """Local mode: the model (as `areal inf register` starts one) and the proxy in front."""
        if self.spec.proxy_url:
            return
        from areal_kernel.agent.config import ProxyConfig
        from areal_kernel.agent.proxy import AgentProxy
        from areal_kernel.api.io import GenerationConfig
        from areal_kernel.services.inf.gateway import ModelService
        from areal_kernel.services.inf.state import GatewaySettings, ModelEntry

        s = self.spec
        assert s.backend is not None and s.model_path is not None
        entry = ModelEntry(
            backend=s.backend, model_path=s.model_path, dtype=s.dtype, max_restarts=s.max_restarts, args=s.args
        )
        self.model = ModelService(s.model_name, entry, self.home / "model", GatewaySettings())
        self.model.prepare(set())
        self.write_state()
        self.model.start()
        self.model.state = "ready"
        gconfig = GenerationConfig(max_new_tokens=s.max_new_tokens, stop_token_ids=list(self.model.stop_ids))
        self.proxy = AgentProxy(self.model.tokenizer, ProxyConfig(model_name=s.model_name), gconfig)
        self.proxy.start()

    def spawn(self, w: Worker) -> None:
        env = dict(os.environ)
        env[WORKER_TOKEN_ENV] = self.worker_token
        env.setdefault("OMP_NUM_THREADS", "1")
        control = f"http://{connect_host(self.spec.host)}:{self.port}"
        cmd = [sys.executable, "-m", WORKER_MODULE, "--index", str(w.index), "--control", control]
        header = f"=== worker {w.index} starting ({time.strftime('%Y-%m-%d %H:%M:%S')})\n"
        w.proc = spawn_logged(cmd, w.log_path, header, env, self.spec.cwd)
        w.start_time = process_start_time(w.proc.pid)

    def write_state(self) -> None:
        replicas: dict[str, list[dict[str, Any]]] = {
            "workers": [{"pid": w.proc.pid, "start_time": w.start_time} for w in self.workers if w.proc is not None]
        }
        if self.model is not None:
            replicas["model"] = [{"pid": r["pid"], "start_time": r["start_time"]} for r in self.model.replicas()]
        self._snapshot = AGENT.publish_state(
            self.home, self._snapshot, host=self.spec.host, port=self.port, token=self.token, started=self.started,
            replicas=replicas,
        )  # fmt: skip

    # -- work --------------------------------------------------------------------------------
    def next_record(self) -> dict[str, Any] | None:
        if not self.queue and (self.spec.epochs == 0 or self.epoch < self.spec.epochs):
            self.epoch += 1
            self.queue.extend(self.records)
        return self.queue.popleft() if self.queue else None

    @property
    def done(self) -> bool:
        """Every record of every epoch ran (``--epochs N``, N > 0): nothing queued, nothing open."""
        return (
            self.spec.epochs > 0
            and self.epoch >= self.spec.epochs
            and not self.queue
            and not self.inflight
            and self.state == "running"
        )

    def check_done(self) -> None:
        if self.done and not self._done_logged:
            self._done_logged = True
            log.info("every record ran; the workers are idle (`areal agent stop` ends the service)",
                     sessions=self.finished + self.failed, finished=self.finished, failed=self.failed,
                     reward_mean=self.reward_mean)  # fmt: skip

    @property
    def reward_mean(self) -> float | None:
        return round(self.reward_sum / self.rewarded, 4) if self.rewarded else None

    def open_session(self, record: dict[str, Any], worker: int) -> Work | None:
        meta = {"record_id": str(record.get("id")), "worker": worker}
        if self.proxy is not None:
            aff = SessionAffinity(self.model.client)
            session = self.proxy.open_session(engine=aff, metadata=meta)
            return Work(record, worker, session.id, session.api_key, self.proxy.base_url, session, aff)
        status, body = self.remote("POST", "/sessions", {"metadata": meta}, self.spec.proxy_token, timeout=600)
        if status in (0, 503):
            # The staleness budget is full (the trainer catches up), or the run is not (yet, or any more) up:
            # the worker asks again; status shows why.
            self.error = body if status == 0 else None
            return None
        if status != 200:
            raise ArealError(f"the training run's proxy refused a session: {body}")
        self.error = None
        return Work(record, worker, body["session_id"], body["api_key"], body["base_url"])

    def remote(self, method: str, path: str, body: Any, key: str | None, timeout: float = 60) -> tuple[int, Any]:
        assert self.spec.proxy_url is not None
        req = urllib.request.Request(
            self.spec.proxy_url.rstrip("/") + path, method=method,
            data=json.dumps(body).encode() if body is not None else b"",
            headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                return e.code, json.loads(raw)
            except ValueError:
                return e.code, raw.decode(errors="replace")
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            return 0, f"the training run's proxy at {self.spec.proxy_url} does not answer: {e}"

    def finish(self, work: Work, reward: float | None, error: str | None) -> None:
        """Set the agent's reward (unless it set one through the reward API), end the session, log it."""
        rows: list[dict[str, Any]] = []
        summary: dict[str, Any]
        if work.session is not None:
            from areal_kernel.agent.sessions import export_json

            s = work.session
            if (
                reward is not None
                and error is None
                and s.reward is None
                and all(c.reward is None for c in s.completions)
            ):
                self.proxy.store.set_reward(s, reward)
            self.proxy.end_session(s)
            rows = export_json(s.export("trajectory"))
            summary = s.summary()
            self.proxy.forget(s)
        else:
            key = work.api_key
            _, summary = self.remote("GET", f"/sessions/{work.session_id}", None, key)
            summary = summary if isinstance(summary, dict) else {}
            unset = summary.get("reward") is None and all(
                c.get("reward") is None for c in summary.get("completions", [])
            )
            if reward is not None and error is None and unset:
                self.remote("POST", f"/sessions/{work.session_id}/reward", {"reward": reward}, key)
            _, exported = self.remote("GET", f"/sessions/{work.session_id}/export", None, key)
            rows = exported.get("rows", []) if isinstance(exported, dict) else []
            self.remote("POST", f"/sessions/{work.session_id}/end", None, key)
        final = rows[0]["reward"] if rows and rows[0].get("reward") is not None else None
        if final is None and reward is not None and error is None:
            final = reward
        out_tokens = sum(sum(r.get("loss_mask", [])) for r in rows)
        self.tokens += out_tokens
        if error is not None:
            self.failed += 1
        else:
            self.finished += 1
            if final is not None:
                self.rewarded += 1
                self.reward_sum += float(final)
        entry = {
            "session_id": work.session_id, "record_id": str(work.record.get("id")), "worker": work.worker,
            "reward": final, "error": error, "turns": len(summary.get("completions", [])),
            "output_tokens": out_tokens, "servers": work.affinity.servers if work.affinity else None,
            "started": work.started, "finished": time.time(), "rows": rows,
        }  # fmt: skip
        self._session_log.write(json.dumps(entry) + "\n")
        self._session_log.flush()
        log.info("session finished", session=work.session_id, record=entry["record_id"], worker=work.worker,
                 reward=final, turns=entry["turns"], output_tokens=out_tokens, seconds=round(time.time() - work.started, 1),
                 **({"error": error} if error else {}))  # fmt: skip

    def abandon(self, work: Work, why: str) -> None:
        """A worker died mid-session: end the session unrewarded (never trained on), hand the record out again."""
        try:
            if work.session is not None:
                self.proxy.end_session(work.session)
                self.proxy.forget(work.session)
            else:
                self.remote("POST", f"/sessions/{work.session_id}/end", None, work.api_key)
        except Exception as e:  # the record is handed out again either way
            log.warning("could not end an abandoned session", session=work.session_id, error=str(e))
        self.queue.appendleft(work.record)
        log.warning("worker died mid-session; its record is handed out again", worker=work.worker, why=why)

    # -- supervision --------------------------------------------------------------------------
    async def monitor(self) -> None:
        last_health = 0.0
        while not self.stop_event.is_set():
            for w in self.workers:
                if w.proc is None or w.proc.poll() is None:
                    continue
                rc = w.proc.returncode
                work = self.inflight.pop(w.index, None)
                if work is not None:
                    await self.run_in_pool(self.abandon, work, f"exit code {rc}")
                w.restarts += 1
                log.warning("worker exited; restarting it", worker=w.index, rc=rc, restarts=w.restarts)
                # A worker that dies at once again and again (its agent cannot start) is not restarted in a busy loop.
                await asyncio.sleep(min(5.0, 0.2 * w.restarts))
                if not self.stop_event.is_set():
                    self.spawn(w)
            if self.model is not None and time.monotonic() - last_health > 5.0:
                last_health = time.monotonic()
                await self.run_in_pool(self.model.check_health)
            self.write_state()
            try:
                await asyncio.wait_for(self.stop_event.wait(), 0.25)
            except asyncio.TimeoutError:
                pass

    def stop_workers(self) -> None:
        """SIGTERM each worker's process group, SIGKILL what is left after a grace period."""
        kill_groups([w.proc.pid for w in self.workers if w.proc is not None])
        for w in self.workers:
            if w.proc is not None:
                try:
                    w.proc.wait(timeout=1.0)  # reap it: its group is gone
                except subprocess.TimeoutExpired:
                    pass

    # -- status ---------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        now = time.time()
        elapsed = time.monotonic() - self.running_since if self.running_since else 0.0
        workers = []
        for w in self.workers:
            alive = w.proc is not None and w.proc.poll() is None
            cur = self.inflight.get(w.index)
            workers.append({
                "index": w.index, "pid": w.proc.pid if w.proc else None, "state": "running" if alive else "restarting",
                "restarts": w.restarts, "sessions": w.sessions, "session": cur.session_id if cur else None,
                "log": str(w.log_path),
            })  # fmt: skip
        return {
            "service": {
                "pid": os.getpid(), "url": self.url, "host": self.spec.host, "port": self.port, "state": self.state,
                "error": self.error, "mode": "online" if self.spec.proxy_url else "local",
                "proxy": self.spec.proxy_url or (self.proxy.url if self.proxy is not None else None),
                "agent": self.spec.agent, "model_name": self.spec.model_name, "backend": self.spec.backend,
                "started": self.started, "uptime_s": round(now - self.started, 1), "log": str(self.home / LOG_NAME),
                "session_log": str(self.home / SESSION_LOG),
            },
            "model": self.model.status() if self.model is not None else None,
            "workers": workers,
            "sessions": {"open": len(self.inflight), "finished": self.finished, "failed": self.failed,
                         "rewarded": self.rewarded},
            "records": {"total": len(self.records), "queued": len(self.queue), "epoch": self.epoch,
                        "epochs": self.spec.epochs, "done": self.done},
            "reward_mean": self.reward_sum / self.rewarded if self.rewarded else None,
            "tokens": self.tokens,
            "tokens_per_s": round(self.tokens / elapsed, 2) if elapsed > 0 else 0.0,
        }  # fmt: skip

    # -- HTTP ---------------------------------------------------------------------------------
    def app(self) -> Any:
        from aiohttp import web

        from areal_kernel.agent.openai_wire import error_body

        def refuse(status: int, message: str, code: str) -> web.Response:
            return web.json_response(error_body(message, code, None, status), status=status)

        @web.middleware
        async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
            auth = request.headers.get("Authorization", "")
            if request.path.startswith("/work") and not bearer_matches(auth, self.worker_token):
                return refuse(401, f"{request.path} is for this service's workers", "unauthorized")
            if request.path.startswith("/admin") and self.token and not bearer_matches(auth, self.token):
                return refuse(401, f"{request.path} needs 'Authorization: Bearer <admin token>' (the service "
                              f"listens beyond loopback; the token is in {self.home / STATE_NAME})", "unauthorized")  # fmt: skip
            try:
                return await handler(request)
            except web.HTTPException:
                raise
            except Exception as e:  # the service keeps serving; the caller sees why
                log.exception("request failed", path=request.path)
                return refuse(500, f"{type(e).__name__}: {e}", "internal_error")

        async def next_work(request: web.Request) -> web.Response:
            body = await request.json()
            index = int(body["worker"])
            if self.state != "running" or self.stop_event.is_set() or index in self.inflight:
                return web.Response(status=204)
            record = self.next_record()
            if record is None:
                return web.Response(status=204)  # every record is done; the worker waits
            try:
                work = await self.run_in_pool(self.open_session, record, index)
            except ArealError as e:
                self.error = str(e)  # shown by `areal agent status`; the worker asks again
                work = None
            if work is None:
                self.queue.appendleft(record)
                return web.Response(status=204)
            self.inflight[index] = work
            return web.json_response({"record": record, "session_id": work.session_id, "api_key": work.api_key,
                                      "base_url": work.base_url, "timeout_s": self.spec.session_timeout_s})  # fmt: skip

        async def done(request: web.Request) -> web.Response:
            body = await request.json()
            index = int(body["worker"])
            work = self.inflight.get(index)
            if work is None or work.session_id != body.get("session_id"):
                return refuse(409, f"worker {index} holds no session {body.get('session_id')!r}", "unknown_session")
            del self.inflight[index]
            reward = body.get("reward")
            await self.run_in_pool(self.finish, work, reward if isinstance(reward, (int, float)) else None,
                                   body.get("error"))  # fmt: skip
            self.workers[index].sessions += 1
            self.check_done()
            return web.json_response({"ok": True})

        async def agent_spec(_: web.Request) -> web.Response:
            return web.json_response({"agent": self.spec.agent, "agent_kwargs": self.spec.agent_kwargs})

        app = control_app(guard, 64 << 20, lambda: {"status": "ok", "state": self.state}, self.status, self.stop_event)
        app.router.add_get("/work/agent", agent_spec)
        app.router.add_post("/work/next", next_work)
        app.router.add_post("/work/done", done)
        return app


async def serve(home: Path, spec: AgentRunSpec, token: str | None) -> int:
    svc = AgentService(home, spec, token, secrets.token_urlsafe(24))
    try:
        svc.records = load_spec_records(spec)
    except ArealError as e:
        start_error(str(e))
        return 2
    runner = await AGENT.listen(svc.app(), spec.host, spec.port, f"--port {spec.port}: ")
    if runner is None:
        return EXIT_BIND_FAILED
    svc.port = int(runner.addresses[0][1])
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, svc.stop_event.set)
    svc.write_state()
    log.info("agent service listening", url=svc.url, admin_token_required=token is not None)
    rc = 0
    monitor: asyncio.Future | None = None
    try:
        start = asyncio.ensure_future(svc.run_in_pool(svc.start_backend))
        stopped = asyncio.ensure_future(svc.stop_event.wait())
        await asyncio.wait([start, stopped], return_when=asyncio.FIRST_COMPLETED)
        if start.done():
            start.result()  # a failed start raises here
            svc.workers = [Worker(i, home / "workers" / f"worker-{i}.log") for i in range(spec.workers)]
            for w in svc.workers:
                svc.spawn(w)
            svc.state, svc.running_since = "running", time.monotonic()
            log.info("agent workers started", workers=spec.workers, agent=spec.agent)
            monitor = asyncio.ensure_future(svc.monitor())
            await svc.stop_event.wait()
    except Exception as e:
        from areal_kernel.services.inf.gateway import one_line

        svc.state, svc.error = "failed", one_line(str(e))
        start_error(svc.error)
        rc = 2
    finally:
        svc.state = "stopping"
        svc.stop_event.set()
        if monitor is not None:
            await monitor
        await svc.run_in_pool(svc.stop_workers)
        if svc.proxy is not None:
            svc.proxy.stop()
        if svc.model is not None:
            if svc.model.client is not None:
                await svc.model.client.aclose(current_loop_only=True)
            await svc.run_in_pool(svc.model.stop)
        AGENT.remove_state(home, os.getpid())
        await runner.cleanup()
        svc.pool.shutdown(wait=False, cancel_futures=True)
        svc._session_log.close()
    log.info("agent service stopped")
    return rc


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    p = argparse.ArgumentParser(prog="python -m areal_kernel.services.agent.service")
    p.add_argument("--home", required=True, help="the service directory ($AREAL_HOME/agent)")
    args = p.parse_args(argv)
    home = Path(args.home)
    try:
        try:
            spec = AgentRunSpec.model_validate_json((home / SPEC_NAME).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ConfigError(f"{home / SPEC_NAME}: cannot read the run's settings: {e}") from None
        token = AGENT.admin_token(spec.host)
        from areal_kernel.plugins import get_plugin_manager

        get_plugin_manager().ensure_loaded()
    except ArealError as e:
        start_error(str(e))
        sys.exit(2)
    sys.exit(asyncio.run(serve(home, spec, token)))


if __name__ == "__main__":
    main()
