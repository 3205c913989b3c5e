"""The generic remote inference client, reused by every server backend.

- Connection pool: one aiohttp session per event loop (generation), plain
  HTTP from a thread pool for control calls made by the controller thread.
- Scheduling: least-loaded or round-robin over healthy servers; a request's
  continuation prefers the server that produced its prefix (affinity).
- Failover: a server that refuses or drops a connection is marked down; the
  request continues elsewhere with the tokens it already has (nothing is
  generated twice, nothing lost); a down server is probed again later, so a
  restarted one rejoins. A server being restarted by a supervisor is *held*
  (gets no requests, is not probed) until it carries the current weights
  (``resync_server``), then released.
- Interruption: while paused (weight update), aborted generations wait and
  then resume from their partial output; every token is stamped with the
  weight version that produced it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from areal_kernel.api.engine import InferenceEngine, WeightUpdateMeta
from areal_kernel.api.io import ModelRequest, ModelResponse, StopReason
from areal_kernel.errors import ServerError
from areal_kernel.inference.wire import HttpCall, ServerProtocol
from areal_kernel.logging import get_logger

log = get_logger(__name__)


class _Transient(Exception):
    """A failure worth retrying on another server (connection, 5xx, timeout)."""


class CannotResync(ServerError):
    """A restarted server cannot be given the current weights (no retry helps)."""


class _Unreachable(ServerError):
    """A control call that found no (ready) server: refused, reset, or 503 while loading."""


@dataclass
class _Server:
    address: str
    inflight: int = 0
    down_until: float = 0.0
    failures: int = 0
    completed: int = 0
    held: bool = False  # being restarted: no requests, no probes, until released

    def url(self, path: str) -> str:
        return f"http://{self.address}{path}"

    @property
    def up(self) -> bool:
        return not self.held and time.monotonic() >= self.down_until


class RemoteInferenceEngine(InferenceEngine):
    def __init__(
        self,
        addresses: list[str],
        protocol: ServerProtocol,
        *,
        request_timeout_s: float = 600.0,
        retries: int = 3,
        schedule_policy: str = "least_loaded",
        admin_token: str | None = None,
        control_timeout_s: float = 600.0,
        down_probe_s: float = 5.0,
    ) -> None:
        if not addresses:
            raise ServerError("no inference server addresses given")
        self.servers = [_Server(a) for a in addresses]
        self.protocol = protocol
        self.request_timeout_s = request_timeout_s
        self.retries = retries
        self.schedule_policy = schedule_policy
        self.control_timeout_s = control_timeout_s
        self.down_probe_s = down_probe_s
        self._headers = {"Content-Type": "application/json"}
        if admin_token:
            self._headers["Authorization"] = f"Bearer {admin_token}"
        self._version = 0
        self._running = threading.Event()
        self._running.set()
        self._rr = itertools.count()
        self._sessions: dict[int, Any] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(4, 2 * len(addresses)), thread_name_prefix="areal-ctl")
        self.stats = {"requests": 0, "interruptions": 0, "failovers": 0, "retries": 0, "resyncs": 0}
        # Restart support: the weights every server must carry (the last disk
        # update), serialised with updates so a restarted server never loads a
        # directory the transport is about to delete.
        self._weights_lock = threading.Lock()
        self._last_disk: tuple[str, int] | None = None
        self._weight_group = False  # joined a broadcast group: a fresh process cannot join it later
        self._fatal: BaseException | None = None
        # Set by a supervisor: a server that cannot be reached is being
        # restarted and will be brought up to date, so control calls that miss
        # it (even all of them) are not fatal.
        self.supervised = False

    # -- versions and pause ----------------------------------------------------
    def get_version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        self._version = version

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    def pause(self) -> None:
        """Abort running generations (they return partial output and wait here)."""
        self._running.clear()
        self._control_all(lambda s: self.protocol.pause("abort"))

    def resume(self) -> None:
        self._control_all(lambda s: self.protocol.resume())
        self._running.set()

    # -- weight updates ----------------------------------------------------------
    def update_weights(self, meta: WeightUpdateMeta) -> None:
        if meta.kind == "disk":
            if not meta.path:
                raise ServerError("disk weight update needs a path")
            with self._weights_lock:
                self._last_disk = (meta.path, meta.version)
                self._control_all(lambda s: self.protocol.update_weights_from_disk(meta.path, meta.version))
                self._version = meta.version
            return
        raise ServerError(f"update_weights: use the broadcast helpers for kind {meta.kind!r}")

    def init_weight_group_async(
        self, master_addr: str, master_port: int, group_name: str, backend: str
    ) -> list[concurrent.futures.Future]:
        """Ask every server to join the weight group as ranks 1..n (rank 0: the trainer).
        Returns futures that complete once the trainer joined too."""
        world = 1 + len(self.servers)
        self._weight_group = True
        return [
            self._pool.submit(
                self._control, s, self.protocol.init_weight_group(master_addr, master_port, world, i + 1, group_name, backend)
            )
            for i, s in enumerate(self.servers)
        ]

    def update_from_distributed_async(
        self, tensors: list[dict[str, Any]], version: int, bucket_bytes: int, group_name: str
    ) -> list[concurrent.futures.Future]:
        call = self.protocol.update_weights_from_distributed(tensors, version, bucket_bytes, group_name)
        return [self._pool.submit(self._control, s, call) for s in self.servers]

    # -- control plumbing (controller thread) -------------------------------------
    def _control(self, server: _Server, call: HttpCall) -> Any:
        body = json.dumps(call.json or {}).encode()
        req = urllib.request.Request(server.url(call.path), data=body if call.method == "POST" else None,
                                     headers=self._headers, method=call.method)
        try:
            with urllib.request.urlopen(req, timeout=call.timeout_s or self.control_timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            cls = _Unreachable if e.code == 503 else ServerError
            raise cls(f"{server.address}{call.path} answered HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as e:
            raise _Unreachable(f"{server.address}{call.path} failed: {e}") from None
        return json.loads(raw) if raw else {}

    def _control_all(self, make_call) -> list[Any]:
        futures = [self._pool.submit(self._control, s, make_call(s)) for s in self.servers]
        results, errors = [], []
        restarting = 0
        for s, f in zip(self.servers, futures):
            try:
                results.append(f.result())
            except ServerError as e:
                errors.append(str(e))
                # Under a supervisor an unreachable server is being restarted
                # and gets the current weights when it is back (resync_server).
                restarting += self.supervised and (s.held or isinstance(e, _Unreachable))
        if errors:
            # A control call that reached no server at all is fatal; a dead
            # server is tolerated here (failover handles its requests).
            if len(errors) == len(self.servers) and restarting < len(errors):
                raise ServerError("; ".join(errors))
            log.warning("control call failed on some servers", errors=errors)
        return results

    # -- restarts (called by a supervisor thread) -----------------------------------
    def _server(self, address: str) -> _Server:
        for s in self.servers:
            if s.address == address:
                return s
        raise ServerError(f"{address} is not one of this client's servers ({', '.join(x.address for x in self.servers)})")

    def hold(self, address: str) -> None:
        """Send nothing to ``address`` (it is being restarted) until ``release``."""
        self._server(address).held = True

    def release(self, address: str) -> None:
        """``address`` is back with the current weights: schedule on it again."""
        s = self._server(address)
        s.down_until = 0.0
        s.held = False

    def resync_server(self, address: str) -> int:
        """Bring a freshly (re)started server to the current weights and
        version; returns that version. A fresh process serves the base model
        at version 0, which is right only before the first update."""
        s = self._server(address)
        with self._weights_lock:
            if self._weight_group:
                raise CannotResync(
                    f"inference server {address} was restarted, but weights reach the servers by broadcast "
                    "(weight_update.mode) and a new process cannot join the existing weight group; "
                    "use weight_update.mode: disk to run with rollout.restart_servers"
                )
            if self._last_disk is None:
                return 0
            path, version = self._last_disk
            self._control(s, self.protocol.update_weights_from_disk(path, version))
            self.stats["resyncs"] += 1
            return version

    def fail(self, error: BaseException) -> None:
        """Make every generation from now on raise ``error`` (a server is lost for good)."""
        self._fatal = error

    # -- generation (rollout event loop) ------------------------------------------
    def _session(self) -> Any:
        import aiohttp

        loop = asyncio.get_running_loop()
        key = id(loop)
        sess = self._sessions.get(key)
        if sess is None or sess.closed:
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, force_close=False)
            sess = aiohttp.ClientSession(connector=connector, headers=self._headers)
            self._sessions[key] = sess
        return sess

    def _choose(self, preferred: _Server | None) -> _Server | None:
        if preferred is not None and preferred.up:
            return preferred
        up = [s for s in self.servers if s.up]
        if not up:
            return None
        if self.schedule_policy == "round_robin":
            return up[next(self._rr) % len(up)]
        return min(up, key=lambda s: (s.inflight, next(self._rr) % len(up)))

    async def _post(self, server: _Server, call: HttpCall) -> Any:
        import aiohttp

        try:
            async with self._session().request(
                call.method,
                server.url(call.path),
                json=call.json,
                timeout=aiohttp.ClientTimeout(total=call.timeout_s or self.request_timeout_s),
            ) as resp:
                text = await resp.text()
                if resp.status >= 500:
                    raise _Transient(f"HTTP {resp.status}: {text[:300]}")
                if resp.status >= 400:
                    raise ServerError(f"{server.address}{call.path} rejected the request (HTTP {resp.status}): {text[:500]}")
                return json.loads(text)
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, json.JSONDecodeError) as e:
            raise _Transient(f"{type(e).__name__}: {e}") from None

    async def _wait_running(self) -> None:
        while not self._running.is_set():
            await asyncio.sleep(0.02)

    async def _wait_for_server(self, preferred: _Server | None, deadline: float) -> _Server:
        while True:
            if self._fatal is not None:
                raise self._fatal
            s = self._choose(preferred)
            if s is not None:
                return s
            if time.monotonic() > deadline:
                raise ServerError("no inference server is reachable: " + ", ".join(x.address for x in self.servers))
            # Probe down servers: a restarted one rejoins.
            for x in self.servers:
                if not x.up and not x.held and await self._healthy(x):
                    x.down_until = 0.0
            await asyncio.sleep(0.2)

    async def _healthy(self, server: _Server) -> bool:
        try:
            await self._post(server, HttpCall("GET", self.protocol.health_path, timeout_s=2.0))
            return True
        except (_Transient, ServerError):
            return False

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        t0 = time.monotonic()
        deadline = t0 + self.request_timeout_s
        out_ids: list[int] = []
        out_lp: list[float] = []
        out_v: list[int] = []
        server: _Server | None = None
        failures = 0
        interruptions = 0
        stop = StopReason.LENGTH
        self.stats["requests"] += 1
        while True:
            await self._wait_running()
            remaining = req.gconfig.max_new_tokens - len(out_ids)
            if remaining <= 0:
                stop = StopReason.LENGTH
                break
            server = await self._wait_for_server(server, deadline)
            srv = server
            call = self.protocol.generate(req.rid, list(req.input_ids) + out_ids, req.gconfig, remaining)
            srv.inflight += 1
            try:
                data = await self._post(srv, call)
            except _Transient as e:
                failures += 1
                srv.failures += 1
                srv.down_until = time.monotonic() + self.down_probe_s
                self.stats["failovers"] += 1
                log.warning("inference server failed; continuing elsewhere", server=srv.address, error=str(e),
                            rid=req.rid, kept_tokens=len(out_ids))
                if failures > self.retries:
                    raise ServerError(f"request {req.rid} failed {failures} times; last error on {srv.address}: {e}") from None
                server = None
                await asyncio.sleep(min(2.0, 0.1 * 2**failures))
                continue
            finally:
                srv.inflight -= 1
            chunk = self.protocol.parse_generate(data)
            version = self._version if chunk.version is None else chunk.version
            out_ids.extend(chunk.output_ids)
            out_lp.extend(chunk.output_logprobs)
            out_v.extend([version] * len(chunk.output_ids))
            if chunk.stop_reason == StopReason.ABORT:
                interruptions += 1
                self.stats["interruptions"] += 1
                if self._running.is_set():
                    # Aborted without a pause of ours (e.g. someone paused the
                    # server directly): do not spin.
                    await asyncio.sleep(0.05)
                continue
            stop = chunk.stop_reason
            server.completed += 1
            break
        return ModelResponse(
            input_ids=list(req.input_ids),
            output_ids=out_ids,
            output_logprobs=out_lp,
            output_versions=out_v,
            stop_reason=stop,
            latency_s=time.monotonic() - t0,
            n_interruptions=interruptions,
            server=server.address if server else None,
        )

    async def aclose(self, current_loop_only: bool = False) -> None:
        """Close HTTP sessions (all of them, or only the running loop's)."""
        keys = [id(asyncio.get_running_loop())] if current_loop_only else list(self._sessions)
        for key in keys:
            sess = self._sessions.pop(key, None)
            if sess is not None and not sess.closed:
                await sess.close()

    def destroy(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
