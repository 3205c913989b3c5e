"""The rollout fleet of a running job: servers join and leave while it trains.

One owner: the ``Fleet`` of a run's ``Rollout`` decides who is in the fleet;
the client (``RemoteInferenceEngine``) routes requests over whoever is, and
the weight transport brings newcomers to the current weights.

Who calls what, and on which thread:

- ``request_add`` / ``request_drain`` / ``status``: any thread (the run's
  control route, ``areal fleet``; the elastic policy). They check the
  request and queue it; nothing about the membership changes there except
  that a drained server gets no new requests at once.
- ``tick()``: the trainer's thread only, between weight updates (at every
  step start and while the trainer waits for rollouts), so a membership
  change never races a weight transfer:

  1. queued joins enter the client, held and ``stale``;
  2. held ``stale`` servers (joined, or restarted while weights travel by
     broadcast) get the current weights from the transport
     (``WeightTransport.admit``), which releases them; the weight-delivery
     check then runs over the fleet;
  3. a draining server whose requests have finished is released (its
     process stopped when the run started it, left running when it was
     added from outside); one still busy after ``rollout.drain_timeout_s``
     is told to abort: its requests resume on other servers from their
     partial output, like a failover.
- ``retire_dead``: the supervisor's thread, when a server the run started
  dies: in an elastic fleet above ``min`` it is dropped instead of restarted.
- ``observe_step``: the trainer, after each step: the elastic policy
  (``rollout.elastic``) grows the fleet through the scheduler when the
  trainer keeps waiting for rollouts, and shrinks it when finished rollouts
  keep being dropped as stale.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from areal_kernel.logging import get_logger

log = get_logger(__name__)

# Fields of an HF config.json that must agree for a server to take the run's
# weights (the text tower's, for a vision-language model).
IDENTITY_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model", "vocab.txt")


class FleetError(Exception):
    """A fleet request refused; ``status`` is the HTTP status the control route answers."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def model_identity(model_dir: str) -> dict[str, Any]:
    """What must match between the run's model and a server joining it: the
    architecture fields of ``config.json`` (``IDENTITY_FIELDS``) and a hash
    of the tokenizer's files. Read from files only (no torch)."""
    out: dict[str, Any] = {}
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        config = {}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for key in IDENTITY_FIELDS:
        value = config.get(key, text.get(key))
        if value is not None:
            out[key] = value
    digest = hashlib.sha256()
    found = False
    for name in _TOKENIZER_FILES:
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            found = True
            digest.update(name.encode())
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
    out["tokenizer"] = digest.hexdigest()[:16] if found else None
    return out


def identity_mismatch(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """``field: ours != theirs`` for every field both sides report and that differs."""
    return [
        f"{k}: {theirs[k]!r} (the run's model: {ours[k]!r})"
        for k in ours
        if k in theirs and ours[k] is not None and theirs[k] is not None and ours[k] != theirs[k]
    ]


def valid_address(address: Any) -> str:
    """``host:port`` or a ``FleetError`` (400) saying what is valid."""
    if not isinstance(address, str) or ":" not in address:
        raise FleetError(400, f"address {address!r}: expected host:port, e.g. 127.0.0.1:8001")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise FleetError(400, f"address {address!r}: expected host:port with a port in 1..65535")
    return address


@dataclass
class _Elastic:
    """The elastic policy's memory between steps."""

    wait_streak: int = 0
    stale_streak: int = 0
    last_change_step: int = -(10**9)
    starting: int = 0  # servers the scheduler is starting right now
    stale_seen: int = 0  # the executor's stale-dropped count at the last step
    errors: list[str] = field(default_factory=list)


class Fleet:
    """The membership of a run's inference servers (see the module docstring).

    ``client``: the run's ``RemoteInferenceEngine``; ``launcher``: the
    backend's ``SubprocessLauncher`` when the run started the servers (None
    otherwise: then servers can be added and drained but the fleet cannot
    start any); ``model_dir``: the run's model, whose identity a joining
    server must share; ``rollout_cfg``: the ``rollout`` section
    (``elastic``, ``drain_timeout_s``)."""

    def __init__(self, client: Any, launcher: Any, model_dir: str, rollout_cfg: Any) -> None:
        self.client = client
        self.launcher = launcher
        self.elastic = getattr(rollout_cfg, "elastic", None)
        self.min = self.elastic.min if self.elastic is not None else 1
        self.max: int | None = self.elastic.max if self.elastic is not None else None
        self.drain_timeout_s = float(getattr(rollout_cfg, "drain_timeout_s", 30.0))
        self.identity = model_identity(model_dir)
        self._lock = threading.Lock()
        self._joins: list[tuple[str, bool]] = []  # (address, started by the run) waiting for a tick
        self._drains: dict[str, float] = {}  # address -> when its requests are moved (monotonic)
        self._aborted: set[str] = set()
        self._external: set[str] = set()  # added from outside: never stopped by the run
        self._policy = _Elastic()
        self.stats = {"joins": 0, "drains": 0, "lost": 0, "grows": 0, "shrinks": 0}
        # The last admit's metrics (its transport's, e.g. weights/reform_s, and
        # weights/admit_s), reported with the next step's metrics.
        self.last_admit: dict[str, float] = {}
        self.events: list[dict[str, Any]] = []  # what happened, newest last (status shows the tail)
        # Set by ``attach`` once the trainer has a weight transport.
        self.transport: Any = None
        self._version: Callable[[], int] = lambda: 0
        self._check: Callable[[int], Any] | None = None
        self._step = 0

    # -- wiring ---------------------------------------------------------------------
    def attach(self, transport: Any, version: Callable[[], int], check: Callable[[int], Any] | None = None) -> None:
        """The trainer's weight ``transport``, its current ``version`` and the
        weight-delivery check run after newcomers got the weights."""
        self.transport = transport
        self._version = version
        self._check = check
        # A server restarted under an in-memory weight group now waits for the
        # transport instead of ending the run, where the transport can admit it.
        self.client.restart_via_transport = self.can_admit() is None

    def can_admit(self) -> str | None:
        """Why no server can join now (None: one can)."""
        from areal_kernel.api.weight_transport import WeightTransport

        if self.transport is None:
            return "the run is still starting (no weight transport yet)"
        admit = getattr(type(self.transport), "admit", None)
        if admit is None or admit is WeightTransport.admit:
            return (
                f"weight transport {getattr(self.transport, 'name', type(self.transport).__name__)!r} cannot bring "
                "a new server to the current weights (it has no admit())"
            )
        return None

    # -- requests (any thread) --------------------------------------------------------
    def _states(self) -> dict[str, str]:
        now = time.monotonic()
        out = {}
        for s in self.client.servers:
            if s.draining:
                out[s.address] = "draining"
            elif s.held:
                out[s.address] = "joining" if s.stale else "restarting"
            elif s.down_until > now:
                out[s.address] = "down"
            else:
                out[s.address] = "active"
        for a, _ in self._joins:
            out.setdefault(a, "joining")
        return out

    def request_add(self, address: str, *, owned: bool = False) -> dict[str, Any]:
        """Queue ``address`` to join at the next tick, after checking that it
        answers, serves the run's model and fits under ``max``. ``owned``:
        the run started it (the elastic policy), so the run stops it when it
        leaves. Raises ``FleetError`` naming what is wrong."""
        address = valid_address(address)
        why = self.can_admit()
        if why is not None:
            raise FleetError(409, f"cannot add {address}: {why}")
        with self._lock:
            states = self._states()
            if address in states:
                raise FleetError(409, f"{address} is already in the fleet ({states[address]})")
            if self.max is not None and len(states) + self._policy.starting >= self.max + (1 if owned else 0):
                raise FleetError(
                    409, f"cannot add {address}: the fleet has {len(states)} server(s), rollout.elastic.max={self.max}"
                )
        if not owned:
            self._check_server(address)
        with self._lock:
            if address in self._states():  # a second add raced this one
                raise FleetError(409, f"{address} is already in the fleet")
            self._joins.append((address, owned))
            if not owned:
                self._external.add(address)
        self._event("join requested", address)
        return {"ok": True, "address": address, "state": "joining"}

    def _check_server(self, address: str) -> None:
        """The server answers its health route and serves the run's model."""
        from areal_kernel.inference.wire import HttpCall

        protocol = self.client.protocol
        try:
            self.client.control_at(address, HttpCall("GET", protocol.health_path, timeout_s=5.0))
        except Exception as e:
            raise FleetError(400, f"cannot add {address}: it does not answer ({e})") from None
        try:
            op = protocol.server_info()
        except NotImplementedError:
            log.info("this backend cannot report its model; the first weight load checks names and shapes",
                     server=address)  # fmt: skip
            return
        try:
            info = self.client.control_at(address, op)
        except Exception as e:
            raise FleetError(400, f"cannot add {address}: its model could not be read ({e})") from None
        theirs = info.get("identity") if isinstance(info, dict) else None
        if not isinstance(theirs, dict):
            return
        diff = identity_mismatch(self.identity, theirs)
        if diff:
            raise FleetError(400, f"cannot add {address}: it serves another model or tokenizer: " + "; ".join(diff))

    def request_drain(self, address: str, *, why: str = "requested") -> dict[str, Any]:
        """Stop admitting to ``address`` now; the next ticks release it once
        its requests finished (or moved them after ``drain_timeout_s``)."""
        address = valid_address(address)
        with self._lock:
            states = self._states()
            state = states.get(address)
            if state is None:
                raise FleetError(404, f"{address} is not in the fleet ({', '.join(states) or 'no servers'})")
            if state == "draining":
                raise FleetError(409, f"{address} is already draining")
            if state == "joining":
                raise FleetError(409, f"{address} is still joining; drain it once it is active")
            serving = [a for a, st in states.items() if st not in ("draining", "joining")]
            left = len([a for a in serving if a != address])
            if left < self.min:
                raise FleetError(
                    409,
                    f"cannot drain {address}: {left} server(s) would be left, fewer than the minimum {self.min}"
                    + (" (rollout.elastic.min)" if self.elastic is not None else " (a run keeps one server)"),
                )
            self.client.drain(address)
            self._drains[address] = time.monotonic() + self.drain_timeout_s
        self._event(f"drain {why}", address)
        return {"ok": True, "address": address, "state": "draining"}

    def status(self) -> dict[str, Any]:
        """Every server with its state, load and weight version, and the counters."""
        states = self._states()
        servers = []
        by_address = {s.address: s for s in self.client.servers}
        pids = {}
        if self.launcher is not None:
            pids = {info.address: info.pid for info in self.launcher.servers}
        for address, state in states.items():
            s = by_address.get(address)
            version = None
            if s is not None and state in ("active", "draining"):
                version = self._served_version(address)
            servers.append(
                {
                    "address": address,
                    "state": state,
                    "owner": "added" if address in self._external else "run",
                    # The process the run started (None for one added from outside).
                    "pid": None if address in self._external else pids.get(address),
                    "weight_version": version,
                    "inflight": s.inflight if s is not None else 0,
                    "completed": s.completed if s is not None else 0,
                    "failures": s.failures if s is not None else 0,
                }
            )
        return {
            "version": self._version(),
            "min": self.min,
            "max": self.max,
            "elastic": self.elastic is not None,
            "servers": servers,
            "stats": dict(self.stats),
            "events": self.events[-20:],
        }

    def _served_version(self, address: str) -> int | None:
        try:
            info = self.client.control_at(address, self.client.protocol.server_info())
        except Exception:  # NotImplementedError, unreachable: the column stays empty
            return None
        v = info.get("weight_version") if isinstance(info, dict) else None
        return int(v) if isinstance(v, int) else None

    # -- the trainer's thread ---------------------------------------------------------
    def tick(self) -> None:
        """Apply what was queued (see the module docstring). Trainer thread only."""
        with self._lock:
            joins, self._joins = self._joins, []
        for address, owned in joins:
            try:
                self.client.add_server(address, stale=True)
            except Exception as e:  # added twice by a race: say so, go on
                self._event(f"join failed: {e}", address)
                continue
            self.stats["joins"] += 1
            self._event("joined (waiting for the weights)", address)
        stale = [s.address for s in self.client.servers if s.held and s.stale]
        if stale and self.can_admit() is None:
            version = self._version()
            t0 = time.monotonic()
            out = self.transport.admit(stale, version) or {}
            self.last_admit = {**{k: float(v) for k, v in out.items()}, "weights/admit_s": time.monotonic() - t0}
            for a in stale:
                self._event(f"has the weights of version {version}", a)
            if self._check is not None:
                self._check(version)
        self._drop_lost()
        self._finish_drains()

    def _drop_lost(self) -> None:
        """A server added from outside that the client holds (it stopped
        answering): the run cannot restart it, so it leaves the fleet."""
        for s in list(self.client.servers):
            if s.address in self._external and s.held and not s.stale:
                self.client.remove_server(s.address)
                self._external.discard(s.address)
                self.stats["lost"] += 1
                self._event("lost (added from outside; not restarted)", s.address)

    def _finish_drains(self) -> None:
        now = time.monotonic()
        for address, deadline in list(self._drains.items()):
            try:
                s = self.client.endpoint(address)
            except Exception:
                self._drains.pop(address, None)
                continue
            if s.inflight == 0:
                self._release(address)
            elif now >= deadline and address not in self._aborted:
                # Its requests come back with their partial output and resume elsewhere.
                self._aborted.add(address)
                try:
                    self.client.control(address, self.client.protocol.pause("abort"))
                    self._event(f"moving {s.inflight} request(s) elsewhere", address)
                except Exception as e:
                    self._event(f"abort failed ({e}); waiting for its requests", address)

    def _release(self, address: str) -> None:
        self._drains.pop(address, None)
        self.client.remove_server(address)
        external = address in self._external
        self._external.discard(address)
        if address in self._aborted:
            self._aborted.discard(address)
            if external:  # handed back usable to whoever runs it
                try:
                    self.client.control_at(address, self.client.protocol.resume())
                except Exception:
                    pass
        index = self.launcher.index_of(address) if (self.launcher is not None and not external) else None
        if index is not None:
            self.launcher.retire(index)
        self.stats["drains"] += 1
        self._event("released" + (" (process stopped)" if index is not None else ""), address)

    def retire_dead(self, index: int, address: str) -> bool:
        """Supervisor thread: a server the run started died. In an elastic
        fleet above ``min`` it leaves the fleet (True); else it is restarted."""
        if self.elastic is None:
            return False
        with self._lock:
            others = [s for s in self.client.servers if s.address != address and not s.draining]
            if len(others) < self.min:
                return False
            self._drains.pop(address, None)
        self.client.remove_server(address)
        self.launcher.retire(index)
        self.stats["lost"] += 1
        self._event("died; not restarted (the fleet is above rollout.elastic.min)", address)
        return True

    # -- the elastic policy (trainer thread, after each step) ---------------------------
    def observe_step(self, step: int, wait_s: float, step_s: float, stale_dropped_total: int) -> None:
        """Grow or shrink by one server (see ``rollout.elastic``);
        ``stale_dropped_total``: finished rollouts dropped as too stale so far."""
        self._step = step
        p = self._policy
        stale_dropped = stale_dropped_total - p.stale_seen
        p.stale_seen = stale_dropped_total
        e = self.elastic
        if e is None or self.launcher is None:
            return
        p.wait_streak = p.wait_streak + 1 if step_s > 0 and wait_s / step_s > e.grow_wait_fraction else 0
        p.stale_streak = p.stale_streak + 1 if stale_dropped >= e.shrink_stale_dropped else 0
        if step - p.last_change_step <= e.cooldown_steps or p.starting:
            return
        n = len(self._states())
        if p.wait_streak >= e.patience and n < e.max:
            p.last_change_step = step
            p.wait_streak = 0
            self._grow(step)
        elif p.stale_streak >= e.patience and n > e.min:
            ours = [
                s.address
                for s in self.client.servers
                if s.address not in self._external and not s.draining and not s.held
            ]
            if len(ours) > 0:
                p.last_change_step = step
                p.stale_streak = 0
                self.stats["shrinks"] += 1
                try:
                    self.request_drain(ours[-1], why=f"by the elastic policy after step {step} (stale rollouts)")
                except FleetError as err:
                    self._event(f"shrink refused: {err}", ours[-1])

    def _grow(self, step: int) -> None:
        """Start one server through the scheduler, in the background (it takes
        seconds); it joins at the first tick after it is healthy."""
        self._policy.starting += 1
        self.stats["grows"] += 1
        self._event(f"growing after step {step}: the trainer waited for rollouts", "-")

        def start() -> None:
            try:
                info = self.launcher.add_server()
                self.request_add(info.address, owned=True)
            except Exception as err:  # the run goes on with the fleet it has
                self._policy.errors.append(str(err))
                self._event(f"could not start a server: {str(err).splitlines()[0][:300]}", "-")
                log.warning("elastic fleet: could not start a server", error=str(err)[:500])
            finally:
                self._policy.starting -= 1

        threading.Thread(target=start, name="areal-fleet-grow", daemon=True).start()

    # -- reporting --------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        states = self._states()
        out = {
            "rollout/servers": float(sum(1 for st in states.values() if st == "active")),
            "rollout/joins": float(self.stats["joins"]),
            "rollout/drains": float(self.stats["drains"]),
            "rollout/servers_lost": float(self.stats["lost"]),
        }
        if self.elastic is not None:
            out["rollout/grows"] = float(self.stats["grows"])
            out["rollout/shrinks"] = float(self.stats["shrinks"])
        # A step's own update may re-form the group too; the admit's re-form is
        # reported under its own key so neither hides the other.
        admit = self.last_admit
        self.last_admit = {}
        out.update({("weights/admit_reform_s" if k == "weights/reform_s" else k): v for k, v in admit.items()})
        return out

    def _event(self, what: str, address: str) -> None:
        entry = {"t": round(time.time(), 3), "step": self._step, "server": address, "event": what}
        with self._lock:
            self.events.append(entry)
            del self.events[:-200]
        log.info("fleet: " + what, server=address)
