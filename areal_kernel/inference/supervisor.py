"""Restart inference servers that die during a run.

A background thread watches the launcher's server processes. When one exits
without being asked to (crash, OOM kill, ``kill -9``) the supervisor

1. holds the server in the client (no request is sent there, it is not
   probed), so its in-flight requests fail over to the other servers or wait
   for it, keeping the tokens they already have;
2. starts it again on the same address (``launcher.restart(i)``);
3. brings it to the current weights and version (``client.resync_server``:
   the last weight update is replayed to that one server), so a restarted
   server never stamps base-model tokens with a newer version or the reverse;
4. releases it: requests flow to it again.

Where weights travel through an in-memory group (``weight_update.mode:
broadcast``) the new process is not in the group: ``resync_server`` marks it
``stale`` and it stays held until the fleet's next tick (or the next weight
update) re-forms the group with it and sends it the current weights
(``areal_kernel.inference.fleet``); then it is released.

In an elastic fleet (``rollout.elastic``) a server that dies while the fleet
is above ``min`` is not restarted: ``retire`` (given by the fleet) drops it,
and its requests fail over as before.

Each server may be restarted ``max_restarts`` times; past that (or when a
restart itself fails) the run gets one clear error naming the server, its
exit code, its log file and tail, and the last recovery checkpoint to resume
from, raised by every later generation.

Every backend whose launcher is a ``SubprocessLauncher`` (embedded, vLLM,
SGLang, third parties built on it) is supervised; the weights reach the new
process through the backend's own ``update_weights_from_disk`` operation.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from areal_kernel.errors import ServerError
from areal_kernel.inference.client import CannotResync
from areal_kernel.inference.launcher import SubprocessLauncher
from areal_kernel.logging import get_logger

log = get_logger(__name__)


def supports_restart(launcher: Any) -> bool:
    return isinstance(launcher, SubprocessLauncher)


class ServerGaveUp(ServerError):
    """A server past its restart budget. The checkpoint line names the newest
    recovery checkpoint when the error is shown, not when the server was
    given up: the trainer finishes the step it is in first and may write a
    newer checkpoint, which (``checkpoint.keep_last``) can remove the one
    that was newest at give-up time."""

    def __init__(self, head: str, recovery_hint: Callable[[], str | None] | None, tail: str) -> None:
        self._head, self._hint, self._tail = head, recovery_hint, tail
        super().__init__(self._render())

    def _render(self) -> str:
        checkpoint = None
        if self._hint is not None:
            try:
                checkpoint = self._hint()
            except Exception as e:  # the hint must never hide the real error
                checkpoint = f"(unknown: {type(e).__name__}: {e})"
        resume = " (areal train with the same config and run_dir resumes from it)" if checkpoint else ""
        return f"{self._head}\n  last recovery checkpoint: {checkpoint or 'none'}{resume}\n{self._tail}"

    def __str__(self) -> str:
        return self._render()


class ServerSupervisor:
    """``client`` is the ``RemoteInferenceEngine`` of the same servers.
    ``resync(address)`` (default ``client.resync_server``) brings a restarted
    server to the current weights; ``on_restart(address, version)`` is called
    after each successful restart (metrics, tests); ``recovery_hint()``
    names the checkpoint a run could resume from (quoted when giving up)."""

    def __init__(
        self,
        launcher: Any,
        client: Any,
        *,
        max_restarts: int = 3,
        poll_s: float = 0.25,
        resync: Callable[[str], int | None] | None = None,
        on_restart: Callable[[str, int | None], None] | None = None,
        recovery_hint: Callable[[], str | None] | None = None,
        retire: Callable[[int, str], bool] | None = None,
    ) -> None:
        if not supports_restart(launcher):
            raise ServerError(
                f"{type(launcher).__name__} cannot restart servers (it is not a "
                "areal_kernel.inference.launcher.SubprocessLauncher)"
            )
        self.launcher = launcher
        self.client = client
        self.max_restarts = max_restarts
        self.poll_s = poll_s
        self.resync = resync or client.resync_server
        self.on_restart = on_restart
        self.recovery_hint = recovery_hint
        # retire(index, address) -> True when the fleet dropped the dead
        # server instead of having it restarted (an elastic fleet above min).
        self.retire = retire
        self.restarts: dict[str, int] = {}
        self.error: ServerError | None = None
        self._given_up: set[int] = set()
        self._busy: set[int] = set()  # servers being restarted right now (each in its own thread)
        self._lock = threading.Lock()
        self._last_failure: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def total_restarts(self) -> int:
        with self._lock:
            return sum(self.restarts.values())

    def start(self) -> "ServerSupervisor":
        # The client now tolerates control calls that miss a restarting server.
        self.client.supervised = True
        self._thread = threading.Thread(target=self._run, name="areal-server-supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        # Restart threads still waiting for a server see the launcher stop
        # (it kills what they started) and end on their own.
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def check(self) -> None:
        """Raise the supervisor's error, if it gave up on a server."""
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                dead = {i: rc for i, rc in self.launcher.exited().items() if i not in self._given_up}
            except Exception as e:  # never let the watcher die silently
                log.warning("server supervisor could not poll servers", error=f"{type(e).__name__}: {e}")
                dead = {}
            for i, rc in dead.items():
                if self._stop.is_set():
                    return
                with self._lock:
                    if i in self._busy:
                        continue
                    self._busy.add(i)
                # One thread per dead server: a restart takes seconds, and a
                # second server dying meanwhile must be held (and restarted)
                # at once, not after the first one is back.
                threading.Thread(
                    target=self._handle_then_free, args=(i, rc), daemon=True, name=f"areal-restart-{i}"
                ).start()
            self._stop.wait(self.poll_s)

    def _handle_then_free(self, i: int, rc: int) -> None:
        try:
            self._handle(i, rc)
        except Exception as e:  # a bug here must not leave the server held silently
            if self._stop.is_set():
                return
            self._give_up(i, self.launcher.servers[i].address, f"could not be restarted: {type(e).__name__}: {e}")
        finally:
            with self._lock:
                self._busy.discard(i)

    def _give_up(self, i: int, address: str, why: str) -> None:
        servers = self.launcher.servers
        log_path = servers[i].log_path if i < len(servers) else None
        self.error = ServerGaveUp(
            f"inference server {address} {why}\n  log: {log_path or '(none)'}",
            self.recovery_hint,
            f"--- last lines of its log ---\n{self.launcher.log_tail(i)}",
        )
        self._given_up.add(i)
        log.error("giving up on inference server", server=address, reason=why)
        self.client.fail(self.error)

    def _handle(self, i: int, rc: int) -> None:
        address = self.launcher.servers[i].address
        self.client.hold(address)
        if self.retire is not None and self.retire(i, address):
            with self._lock:
                self._given_up.add(i)  # retired: not watched any more
            log.warning("inference server died; the fleet is above its minimum, so it is not restarted",
                        server=address, exit_code=rc)  # fmt: skip
            return
        used = self.restarts.get(address, 0)
        if used >= self.max_restarts:
            last = self._last_failure.get(address)
            self._give_up(
                i, address,
                f"exited with code {rc} and was already restarted {used} time(s), the budget "
                f"(rollout.max_server_restarts={self.max_restarts})"
                + (f"; the last restart attempt failed: {last}" if last else ""),
            )  # fmt: skip
            return
        with self._lock:
            self.restarts[address] = used + 1  # a failed attempt uses the budget too
        log.warning("inference server died; restarting it", server=address, exit_code=rc, restart=used + 1)
        try:
            self.launcher.restart(i)
            version = self.resync(address)
        except CannotResync as e:
            self._give_up(i, address, f"exited with code {rc} and cannot be brought back: {e}")
            return
        except ServerError as e:
            if self._stop.is_set():
                return
            self._last_failure[address] = str(e)[:2000]
            log.warning("restart attempt failed", server=address, error=str(e)[:500])
            return  # still dead: the next poll tries again (within the budget)
        if version is None:
            # Weights travel by broadcast: the fleet re-forms the weight group
            # with this server and sends it the current weights, then releases it.
            log.info("inference server restarted; it gets the current weights through the weight group",
                     server=address)  # fmt: skip
        else:
            self.client.release(address)
            log.info("inference server restarted", server=address, weight_version=version)
        if self.on_restart is not None:
            self.on_restart(address, version)


def start_supervisor(
    backend: Any, client: Any, rollout_cfg: Any, recovery_hint: Callable[[], str | None] | None = None
) -> ServerSupervisor | None:
    """A running supervisor for ``backend``'s servers, or None when restarts
    are switched off (``rollout.restart_servers``) or the backend's launcher
    cannot restart servers (then a dead server's requests only fail over)."""
    if not getattr(rollout_cfg, "restart_servers", True):
        return None
    launcher = getattr(backend, "launcher", None)
    if not supports_restart(launcher):
        log.info(
            "this inference backend cannot restart dead servers; their requests fail over to the others",
            backend=type(backend).__name__,
        )
        return None
    return ServerSupervisor(
        launcher, client, max_restarts=getattr(rollout_cfg, "max_server_restarts", 3), recovery_hint=recovery_hint
    ).start()
