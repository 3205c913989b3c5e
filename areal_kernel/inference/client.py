"""The generic remote inference client, reused by every server backend.

- Connection pool: one aiohttp session per event loop (generation), plain
  HTTP from a thread pool for control calls made by the controller thread.
  Pooled connections are kept ``keepalive_s`` (shorter than the servers'
  own keep-alive). A request that fails on a pooled connection before any
  reply (the server had closed it while it sat idle) is sent again at once
  on a fresh connection: that is not a server failure (no failover, no
  health probe, no wait); ``stats["stale_connection_retries"]`` counts them.
- Scheduling: least-loaded or round-robin over healthy servers; a request's
  continuation prefers the server that produced its prefix (affinity). A
  caller pins a request to a server (while it is up) with
  ``ModelRequest.metadata["server"] = <address>`` (e.g. a conversation's
  turns on the replica that holds its prefix in cache).
- Failover: a server that refuses or drops a connection is marked down; the
  request continues elsewhere with the tokens it already has (nothing is
  generated twice, nothing lost); a down server is probed again later, so a
  restarted one rejoins. A server being restarted by a supervisor is *held*
  (gets no requests, is not probed) until it carries the current weights
  (``resync_server``), then released.
- Interruption: while paused (weight update), aborted generations wait and
  then resume from their partial output; every token is stamped with the
  weight version that produced it.

Backends extend it through their ``ServerProtocol`` (see ``wire``): control
operations are ``HttpCall`` sequences, run on one server with ``control``,
on all of them with ``control_all`` (or ``control_async`` for collectives).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import json
import threading
import time
import http.client
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable, Union

from areal_kernel.api.engine import InferenceEngine, WeightUpdateMeta
from areal_kernel.api.io import ModelRequest, ModelResponse, StopReason
from areal_kernel.errors import ServerError
from areal_kernel.inference.wire import ControlOp, HttpCall, ServerProtocol, control_calls
from areal_kernel.logging import get_logger

log = get_logger(__name__)


class _Transient(Exception):
    """A failure worth retrying on another server (connection, 5xx, timeout)."""


class CannotResync(ServerError):
    """A restarted server cannot be given the current weights (no retry helps)."""


class ServerUnreachable(ServerError):
    """A control call that found no (ready) server: refused, reset, or 503 while loading."""


# The operation to run on every server: one for all, or built per server address.
OpForServer = Union[ControlOp, Callable[[str], ControlOp]]

# Directories per adapter the client remembers for the weight-delivery check
# (a server left several updates behind still maps to its version).
ADAPTER_DIRS_KEPT = 16

DEFAULT_KEEPALIVE_S = 4.0  # below the 5 s of uvicorn (vLLM, SGLang) and aiohttp's 75 s (embedded)


def client_options(rollout: Any) -> dict[str, Any]:
    """The ``RemoteInferenceEngine`` keywords a ``rollout`` config section sets
    (timeouts, retries, scheduling, keep-alive), for a backend's ``make_client``."""
    return {
        "request_timeout_s": rollout.request_timeout_s,
        "retries": rollout.request_retries,
        "schedule_policy": rollout.schedule_policy,
        "keepalive_s": getattr(rollout, "client_keepalive_s", DEFAULT_KEEPALIVE_S),
    }


@dataclass
class ServerEndpoint:
    """One server as the client tracks it."""

    address: str
    inflight: int = 0
    down_until: float = 0.0
    failures: int = 0
    completed: int = 0
    held: bool = False  # being restarted or joining: no requests, no probes, until released
    # Leaving the fleet (``areal fleet drain``): no new requests; the ones in
    # flight finish here (or are moved by an abort and resume elsewhere).
    draining: bool = False
    # Running but not carrying the run's current weights: joined, or
    # restarted while weights travel by broadcast (a new process is not in
    # the weight group). Held until a weight transport delivers them
    # (``WeightTransport.admit`` or the next ``update``).
    stale: bool = False

    def url(self, path: str) -> str:
        return f"http://{self.address}{path}"

    @property
    def up(self) -> bool:
        return not self.held and not self.draining and time.monotonic() >= self.down_until


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
        keepalive_s: float = DEFAULT_KEEPALIVE_S,
    ) -> None:
        if not addresses:
            raise ServerError("no inference server addresses given")
        if keepalive_s <= 0:
            raise ServerError(f"keepalive_s must be > 0, got {keepalive_s}")
        self.servers = [ServerEndpoint(a) for a in addresses]
        self.protocol = protocol
        self.request_timeout_s = request_timeout_s
        self.retries = retries
        self.schedule_policy = schedule_policy
        self.control_timeout_s = control_timeout_s
        self.down_probe_s = down_probe_s
        self.keepalive_s = keepalive_s
        self._headers = {"Content-Type": "application/json"}
        if admin_token:
            self._headers["Authorization"] = f"Bearer {admin_token}"
        self._version = 0
        self._running = threading.Event()
        self._running.set()
        self._rr = itertools.count()
        self._sessions: dict[int, Any] = {}
        self._fresh_sessions: dict[int, Any] = {}  # no pooling: for a retry after a stale pooled connection
        # Sized for a fleet that may grow (``add_server``); threads start only when used.
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(16, 2 * len(addresses)), thread_name_prefix="areal-ctl"
        )
        # Membership changes replace ``self.servers`` with a new list (never
        # mutate it in place), so a reader iterating a snapshot needs no lock.
        self._members_lock = threading.Lock()
        self.stats = {
            "requests": 0,
            "interruptions": 0,
            "failovers": 0,
            "retries": 0,
            "resyncs": 0,
            "stale_connection_retries": 0,
        }
        # Restart support: the weights every server must carry (the last disk
        # update), serialised with updates so a restarted server never loads a
        # directory the transport is about to delete.
        self._weights_lock = threading.Lock()
        self._last_disk: tuple[str, int] | None = None
        # LoRA adapters the servers serve: name -> (peft directory, version)
        # of its last disk load (None after an in-memory one); replayed on a restarted server.
        self._adapters: dict[str, tuple[str, int] | None] = {}
        # The directories each adapter was loaded from lately, path -> version
        # (the last ADAPTER_DIRS_KEPT): the weight-delivery check passes them
        # to a protocol whose servers report only the directory they serve
        # (SGLang), which maps it back to a version.
        self._adapter_dirs: dict[str, dict[str, int]] = {}
        # The adapter requests use when their gconfig names none (the trainer
        # sets it to the adapter it trains).
        self.default_adapter: str | None = None
        self._weight_group = False  # joined a broadcast group: a fresh process cannot join it later
        self._fatal: BaseException | None = None
        # Set by a supervisor: a server that cannot be reached is being
        # restarted and will be brought up to date, so control calls that miss
        # it (even all of them) are not fatal.
        self.supervised = False
        # Set by a run's fleet whose weight transport can bring a new process
        # to the weights (``WeightTransport.admit``): then a server restarted
        # under an in-memory weight group waits for it instead of being lost.
        self.restart_via_transport = False

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
        self.control_all(lambda a: self.protocol.pause("abort"))

    def resume(self) -> None:
        self.control_all(lambda a: self.protocol.resume())
        self._running.set()

    # -- weight updates ----------------------------------------------------------
    def update_weights(self, meta: WeightUpdateMeta) -> None:
        if meta.kind == "disk":
            path = meta.path
            if not path:
                raise ServerError("disk weight update needs a path (WeightUpdateMeta.path)")
            if meta.adapter is not None:
                self.load_adapter(meta.adapter, path, meta.version)
                return
            with self._weights_lock:
                self._last_disk = (path, meta.version)
                self.control_all(lambda a: self.protocol.update_weights_from_disk(path, meta.version))
                self._version = meta.version
            return
        raise ServerError(f"update_weights: use the broadcast helpers for kind {meta.kind!r}")

    def load_adapter(self, name: str, path: str, version: int) -> None:
        """Every server serves the peft adapter directory ``path`` under
        ``name`` (replacing what it served under that name) as ``version``."""
        with self._weights_lock:
            replace = name in self._adapters
            self._record_adapter(name, path, version)
            self.control_all(lambda a: self.protocol.load_adapter(name, path, version, replace))
            if replace and self.paused:
                # A request that reached a server while it was paused (sent
                # just before the pause) waits there holding the adapter as the
                # server resolved it on arrival, the replaced one: vLLM's worker
                # would load the old directory again for it after the resume.
                # Cut those too; they come back and resume on the new adapter.
                self.control_all(lambda a: self.protocol.pause("abort"))
            if name == self.default_adapter or self.default_adapter is None:
                self._version = version

    def _record_adapter(self, name: str, path: str, version: int) -> None:
        """Record that the servers are told to serve ``path`` as ``version`` of
        adapter ``name`` (before the calls: a server the load misses is then
        found by the weight-delivery check, not taken as the reference)."""
        self._adapters[name] = (path, version)
        dirs = self._adapter_dirs.setdefault(name, {})
        dirs.pop(path, None)
        dirs[path] = version
        while len(dirs) > ADAPTER_DIRS_KEPT:
            dirs.pop(next(iter(dirs)))

    def unload_adapter(self, name: str) -> None:
        with self._weights_lock:
            self._adapters.pop(name, None)
            self._adapter_dirs.pop(name, None)
            self.control_all(lambda a: self.protocol.unload_adapter(name))

    def update_adapter_from_distributed_async(
        self,
        name: str,
        config: dict[str, Any],
        tensors: list[dict[str, Any]],
        version: int,
        bucket_bytes: int,
        group_name: str,
        addresses: list[str] | None = None,
    ) -> list[concurrent.futures.Future]:
        """Start an in-memory adapter update on every server (``protocol.adapter_broadcast``),
        or on ``addresses`` alone (the members of the current weight group)."""
        self._adapters[name] = None
        self._adapter_dirs.pop(name, None)
        return self.control_async(
            self.protocol.update_adapter_from_distributed(name, config, tensors, version, bucket_bytes, group_name),
            addresses=addresses,
        )

    def group_members(self) -> list[str]:
        """The servers an in-memory weight group is formed with now: every
        server that runs, in fleet order (a draining one too, until it is
        released), but not one that is dead and being restarted (held and
        not ``stale``): it could not join."""
        return [s.address for s in self.servers if not s.held or s.stale]

    @property
    def weight_group_world_size(self) -> int:
        """Ranks of an in-memory weight group over every group member: the
        trainer (rank 0) plus ``protocol.ranks_per_server`` per server."""
        return self.weight_group_world_size_for(len(self.group_members()))

    def weight_group_world_size_for(self, n_servers: int) -> int:
        return 1 + max(1, int(self.protocol.ranks_per_server)) * n_servers

    def init_weight_group_async(
        self,
        master_addr: str,
        master_port: int,
        group_name: str,
        backend: str,
        addresses: list[str] | None = None,
    ) -> list[concurrent.futures.Future]:
        """Ask the servers at ``addresses`` (default: ``group_members()``) to
        join the weight group (the k-th: ranks ``1 + k*ranks_per_server``
        on; rank 0 is the trainer). Returns futures that complete once the
        trainer joined too. A server that joins a new group leaves its old
        one. From now on a restarted server is brought up to date by the
        weight transport (``WeightTransport.admit``), not by ``resync_server``."""
        members = self.group_members() if addresses is None else list(addresses)
        world = self.weight_group_world_size_for(len(members))
        per = max(1, int(self.protocol.ranks_per_server))
        self._weight_group = True
        return [
            self._pool.submit(
                self.control, a,
                self.protocol.init_weight_group(master_addr, master_port, world, 1 + k * per, group_name, backend),
            )
            for k, a in enumerate(members)
        ]  # fmt: skip

    def update_from_distributed_async(
        self,
        tensors: list[dict[str, Any]],
        version: int,
        bucket_bytes: int,
        group_name: str,
        addresses: list[str] | None = None,
    ) -> list[concurrent.futures.Future]:
        return self.control_async(
            self.protocol.update_weights_from_distributed(tensors, version, bucket_bytes, group_name),
            addresses=addresses,
        )

    def weight_fingerprints(self, spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
        """Every server's ``protocol.weight_fingerprint`` reply: ``(replies by
        address, errors by address)``. A held server (being restarted) is left
        out: its resync replays the update. ``NotImplementedError`` when the
        protocol has no such route, or when every server answered 404 (an
        older server).

        For an adapter loaded from a directory, the client adds to ``spec``
        ``"adapter_dirs"``: ``{path: version}`` of the directories it told
        the servers to load for that adapter lately (newest last), for a
        protocol whose servers can report only the directory they serve."""
        servers = [s for s in self.servers if not s.held]
        dirs = self._adapter_dirs.get(spec.get("adapter") or "")
        if dirs:
            spec = {**spec, "adapter_dirs": dict(dirs)}
        # One operation per server: a protocol may keep per-call state in it
        # (SGLang assembles the fingerprint from several replies).
        futures = [self._pool.submit(self.control, s.address, self.protocol.weight_fingerprint(spec)) for s in servers]
        replies: dict[str, Any] = {}
        errors: dict[str, str] = {}
        for s, f in zip(servers, futures):
            try:
                replies[s.address] = f.result()
            except ServerError as e:
                errors[s.address] = str(e)
        if errors and not replies and all("HTTP 404" in e for e in errors.values()):
            raise NotImplementedError(f"the servers have no weight fingerprint route ({next(iter(errors.values()))})")
        return replies, errors

    # -- control operations (controller thread; public extension points) --------------
    def control(self, address: str, op: ControlOp) -> Any:
        """Run a control operation (one ``HttpCall`` or a sequence, in order)
        on the server at ``address``; returns the last call's parsed reply.
        Raises ``ServerUnreachable`` when the server refused/dropped the
        connection or answered 503 (loading), ``ServerError`` for any other
        error status. Blocking; call it from the controller thread."""
        server = self._server(address)
        out: Any = None
        for call in control_calls(op):
            out = self._send_control(server, call)
        return out

    def control_at(self, address: str, op: ControlOp) -> Any:
        """``control`` on ``address`` whether or not it is one of this
        client's servers (one asking to join the fleet, one just released)."""
        try:
            server = self._server(address)
        except ServerError:
            server = ServerEndpoint(address)
        out: Any = None
        for call in control_calls(op):
            out = self._send_control(server, call)
        return out

    def control_all(self, op: OpForServer, *, require_all: bool = False) -> list[Any]:
        """Run ``op`` (or ``op(address)``) on every server in parallel; the
        replies in server order. By default a server that fails is logged and
        skipped (its requests fail over; under a supervisor it gets the
        current state when it is back), and only a failure on every server
        raises. ``require_all``: any failure raises (collective operations
        that cannot leave one server behind)."""
        ops = [op(s.address) if callable(op) else op for s in self.servers]
        futures = [self._pool.submit(self.control, s.address, o) for s, o in zip(self.servers, ops)]
        results, errors = [], []
        restarting = 0
        for s, f in zip(self.servers, futures):
            try:
                results.append(f.result())
            except ServerError as e:
                errors.append(str(e))
                # Under a supervisor an unreachable server is being restarted
                # and gets the current weights when it is back (resync_server).
                restarting += self.supervised and (s.held or isinstance(e, ServerUnreachable))
        if errors:
            if require_all:
                raise ServerError("; ".join(errors))
            # A control call that reached no server at all is fatal; a dead
            # server is tolerated here (failover handles its requests).
            if len(errors) == len(self.servers) and restarting < len(errors):
                raise ServerError("; ".join(errors))
            log.warning("control call failed on some servers", errors=errors)
        return results

    def control_async(self, op: OpForServer, addresses: list[str] | None = None) -> list[concurrent.futures.Future]:
        """Start ``op`` (or ``op(address)``) on every server (or on
        ``addresses``) at once and return one future per server, in that
        order (for collectives: the HTTP calls must be in flight while the
        trainer sends)."""
        targets = [s.address for s in self.servers] if addresses is None else list(addresses)
        return [self._pool.submit(self.control, a, op(a) if callable(op) else op) for a in targets]

    def _send_control(self, server: ServerEndpoint, call: HttpCall) -> Any:
        body = json.dumps(call.json).encode() if call.json is not None else b""
        data = body if call.method != "GET" else None
        req = urllib.request.Request(server.url(call.path), data=data, headers=self._headers, method=call.method)
        try:
            with urllib.request.urlopen(req, timeout=call.timeout_s or self.control_timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            cls = ServerUnreachable if e.code == 503 else ServerError
            raise cls(f"{server.address}{call.path} answered HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            raise ServerUnreachable(f"{server.address}{call.path} failed: {e}") from None
        try:
            return call.parse_reply(raw)
        except ValueError as e:
            raise ServerError(f"{server.address}{call.path} answered an unreadable body ({e}): {raw[:300]!r}") from None

    # -- restarts (called by a supervisor thread) -----------------------------------
    def _server(self, address: str) -> ServerEndpoint:
        for s in self.servers:
            if s.address == address:
                return s
        raise ServerError(
            f"{address} is not one of this client's servers ({', '.join(x.address for x in self.servers)})"
        )

    def add_server(self, address: str, *, stale: bool = True) -> ServerEndpoint:
        """Track one more server, held (no requests) until ``release``;
        ``stale``: it does not carry the run's current weights yet."""
        with self._members_lock:
            if any(s.address == address for s in self.servers):
                raise ServerError(f"{address} is already one of this client's servers")
            endpoint = ServerEndpoint(address, held=True, stale=stale)
            self.servers = [*self.servers, endpoint]
        return endpoint

    def remove_server(self, address: str) -> None:
        """Stop tracking ``address`` (released from the fleet). Requests in
        flight there finish or fail over; none is sent there again."""
        with self._members_lock:
            self._server(address)
            self.servers = [s for s in self.servers if s.address != address]

    def endpoint(self, address: str) -> ServerEndpoint:
        """The tracked server at ``address`` (its state: ``inflight``,
        ``draining``, ``held``...); ``ServerError`` if it is not one."""
        return self._server(address)

    def drain(self, address: str) -> None:
        """Send no new requests to ``address``; the running ones finish there
        (the fleet releases it once none is left)."""
        self._server(address).draining = True

    def hold(self, address: str) -> None:
        """Send nothing to ``address`` (it is being restarted) until ``release``."""
        self._server(address).held = True

    def release(self, address: str) -> None:
        """``address`` is back with the current weights: schedule on it again."""
        s = self._server(address)
        s.down_until = 0.0
        s.stale = False
        s.held = False

    def resync_server(self, address: str) -> int | None:
        """Bring a freshly (re)started server to the current weights and
        version; returns that version. A fresh process serves the weights of
        its model directory at version 0, which is right only before the first
        update; after one, the last disk update is replayed to this server
        alone (the backend's own ``update_weights_from_disk`` operation).

        Where weights travel through an in-memory group, a new process is not
        in it: when the run's fleet set ``restart_via_transport`` (its
        transport can ``admit``), the server is marked ``stale`` and stays
        held, and ``None`` is returned; the weight transport delivers the
        weights to it (``WeightTransport.admit``, or the next ``update``,
        which re-forms the group with it) and then releases it. Otherwise
        ``CannotResync``."""
        server = self._server(address)
        with self._weights_lock:
            if self._weight_group:
                if not self.restart_via_transport:
                    raise CannotResync(
                        f"inference server {address} was restarted, but weights reach the servers through an "
                        "in-memory weight group this run's weight transport cannot re-form (it has no admit()); "
                        "use weight_update.mode: disk to run with rollout.restart_servers"
                    )
                server.stale = True
                server.held = True
                return None
            return self._replay(address)

    def replay_disk(self, address: str) -> int:
        """Load the last disk update and the adapters' last directories into
        the server at ``address`` alone (what ``resync_server`` does where
        weights travel by disk); returns the version it now serves."""
        self._server(address)
        with self._weights_lock:
            return self._replay(address)

    def _replay(self, address: str) -> int:
        """``replay_disk``'s work; the caller holds ``_weights_lock``."""
        version = 0
        if self._last_disk is not None:
            path, version = self._last_disk
            self.control(address, self.protocol.update_weights_from_disk(path, version))
        for name, last in self._adapters.items():
            if last is None:
                raise CannotResync(f"inference server {address} was restarted; adapter {name!r} came in memory")
            self.control(address, self.protocol.load_adapter(name, last[0], last[1], False))
            if name == self.default_adapter:
                version = last[1]
        if self._last_disk is not None or self._adapters:
            self.stats["resyncs"] += 1
        return version

    def fail(self, error: BaseException) -> None:
        """Make every generation from now on raise ``error`` (a server is lost for good)."""
        self._fatal = error

    # -- generation (rollout event loop) ------------------------------------------
    def _session(self, fresh: bool = False) -> Any:
        import aiohttp

        key = id(asyncio.get_running_loop())
        sessions = self._fresh_sessions if fresh else self._sessions
        sess = sessions.get(key)
        if sess is None or sess.closed:
            if fresh:
                connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, force_close=True)
            else:
                # Pooled connections are dropped before a server would close
                # them (rollout.client_keepalive_s < the server's keep-alive).
                connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=self.keepalive_s)
            trace = aiohttp.TraceConfig()
            trace.on_connection_reuseconn.append(_mark_reused)
            sess = aiohttp.ClientSession(connector=connector, headers=self._headers, trace_configs=[trace])
            sessions[key] = sess
        return sess

    def _choose(self, preferred: ServerEndpoint | None) -> ServerEndpoint | None:
        if preferred is not None and preferred.up:
            return preferred
        # Runs once per request over every server: plain attribute reads and
        # builtins only (a key function per server cost ~1 ms a request at 512).
        now = time.monotonic()
        up = [s for s in self.servers if not s.held and not s.draining and s.down_until <= now]
        if not up:
            return None
        start = next(self._rr) % len(up)
        if self.schedule_policy == "round_robin":
            return up[start]
        # Least loaded; among equally loaded servers the first from a rotating
        # start, so ties spread instead of piling onto the first server.
        loads = [s.inflight for s in up]
        least = min(loads)
        try:
            return up[loads.index(least, start)]
        except ValueError:
            return up[loads.index(least)]

    async def _post(self, server: ServerEndpoint, call: HttpCall) -> Any:
        import aiohttp

        fresh = False
        while True:
            ctx: dict[str, bool] = {}
            try:
                async with self._session(fresh).request(
                    call.method,
                    server.url(call.path),
                    json=call.json,
                    timeout=aiohttp.ClientTimeout(total=call.timeout_s or self.request_timeout_s),
                    trace_request_ctx=ctx,
                ) as resp:
                    ctx["answered"] = True
                    raw = await resp.read()
                    if resp.status >= 500:
                        raise _Transient(f"HTTP {resp.status}: {raw[:300].decode(errors='replace')}")
                    if resp.status >= 400:
                        raise ServerError(
                            f"{server.address}{call.path} rejected the request (HTTP {resp.status}): "
                            f"{raw[:500].decode(errors='replace')}"
                        )
                    return call.parse_reply(raw)
            except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, ValueError) as e:
                if not fresh and _stale_connection(e, ctx):
                    # The server closed this pooled connection while it sat
                    # idle; the request never reached it. Not a server failure.
                    self.stats["stale_connection_retries"] += 1
                    fresh = True
                    continue
                raise _Transient(f"{type(e).__name__}: {e}") from None

    async def _wait_running(self) -> None:
        while not self._running.is_set():
            await asyncio.sleep(0.02)

    async def _wait_for_server(self, preferred: ServerEndpoint | None, deadline: float) -> ServerEndpoint:
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
                if not x.up and not x.held and not x.draining and await self._healthy(x):
                    x.down_until = 0.0
            await asyncio.sleep(0.2)

    async def _healthy(self, server: ServerEndpoint) -> bool:
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
        server: ServerEndpoint | None = None
        wanted = req.metadata.get("server") if req.metadata else None
        if wanted:
            server = next((s for s in self.servers if s.address == wanted), None)
        failures = 0
        interruptions = 0
        stop = StopReason.LENGTH
        matched_stop: str | None = None
        self.stats["requests"] += 1
        gconfig = req.gconfig
        if gconfig.adapter is None and self.default_adapter is not None:
            gconfig = dataclasses.replace(gconfig, adapter=self.default_adapter)
        while True:
            await self._wait_running()
            remaining = req.gconfig.max_new_tokens - len(out_ids)
            if remaining <= 0:
                stop = StopReason.LENGTH
                break
            server = await self._wait_for_server(server, deadline)
            srv = server
            call = self.protocol.generate(req.rid, list(req.input_ids) + out_ids, gconfig, remaining)
            if req.images is not None:
                # With every call, resumed ones included: the prompt's image
                # placeholders need their pixels again on whichever server continues.
                call = self.protocol.add_images(call, req.images)
            srv.inflight += 1
            try:
                data = await self._post(srv, call)
            except _Transient as e:
                failures += 1
                srv.failures += 1
                srv.down_until = time.monotonic() + self.down_probe_s
                self.stats["failovers"] += 1
                log.warning(
                    "inference server failed; continuing elsewhere",
                    server=srv.address,
                    error=str(e),
                    rid=req.rid,
                    kept_tokens=len(out_ids),
                )
                if failures > self.retries:
                    raise ServerError(
                        f"request {req.rid} failed {failures} times; last error on {srv.address}: {e}"
                    ) from None
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
            matched_stop = chunk.matched_stop if stop == StopReason.STOP else None
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
            matched_stop=matched_stop,
            images=req.images,
        )

    async def aclose(self, current_loop_only: bool = False) -> None:
        """Close HTTP sessions (all of them, or only the running loop's)."""
        keys = (
            [id(asyncio.get_running_loop())] if current_loop_only else list(self._sessions) + list(self._fresh_sessions)
        )
        for key in keys:
            for sessions in (self._sessions, self._fresh_sessions):
                sess = sessions.pop(key, None)
                if sess is not None and not sess.closed:
                    await sess.close()

    def destroy(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


async def _mark_reused(session: Any, trace_ctx: Any, params: Any) -> None:
    ctx = trace_ctx.trace_request_ctx
    if isinstance(ctx, dict):
        ctx["reused"] = True


def _stale_connection(error: BaseException, ctx: dict[str, bool]) -> bool:
    """A request that went out on a pooled connection and failed before any
    reply: the connection was reset or closed under it (writing the request,
    or waiting for the status line). A refused connect, a timeout or an
    error after the reply began are the server's."""
    import aiohttp

    if not ctx.get("reused") or ctx.get("answered"):
        return False
    if isinstance(error, aiohttp.ClientConnectorError):
        return False
    return isinstance(error, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, ConnectionError))
