"""Rank processes of a multi-process train engine, driven from the controller.

A distributed train engine (one object in the controller process, N rank
processes holding the model) needs the same plumbing whatever its parallelism:
start the ranks through the run's scheduler (``start_train_ranks``), connect
a private control channel to each, send every rank the same command (each
with its own arguments), collect the answers, and fail clearly when a rank
raises, dies or hangs. This module is that plumbing, once:

- controller side: ``RankGroup`` (``start`` / ``call`` / ``shutdown``);
- rank side: ``rank_main(make_engine)``, the body of ``python -m <your rank
  module>``: it joins the default process group on the platform's collective
  backend, then runs the engine object's methods as the controller asks.

Protocol: the controller sends ``(command, kwargs)`` (cloudpickled: loss
functions are closures); a rank answers ``("ok", result)`` or ``("err",
(exception or None, text, traceback))``. ``create`` builds the rank's engine
with ``make_engine(rank=..., world_size=..., **kwargs)``; every other command
calls the engine's method of that name; ``shutdown`` ends the loop.

Failure handling: a rank that raises reports its traceback; if the other
ranks also answer, the group stays usable and the error is re-raised (same
type for kernel errors, else ``RankError``). If a rank dies, or the others
still wait in a collective ``error_grace_s`` after one failed, every rank is
stopped and the group refuses further calls. A rank exits when its control
channel closes or its controller (parent) process is gone.
"""

from __future__ import annotations

import argparse
import multiprocessing.connection as mpc
import os
import pickle
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, cast

from areal_kernel.api.scheduler import PARENT_PID_ENV
from areal_kernel.errors import ArealError
from areal_kernel.utils.procs import ParentWatch, flush_std_streams
from areal_kernel.utils.procs import tail_file as log_tail  # the stable name of this module

CONTROL_ENV = "AREAL_RANK_CONTROL"
AUTHKEY_ENV = "AREAL_RANK_AUTHKEY"


class RankError(ArealError):
    """A rank process failed (its traceback or log tail is in the message)."""


class RankGroup:
    """The controller's handle on ``world_size`` rank processes running
    ``python -m <module>`` (whose ``main`` calls ``rank_main``).

    ``scheduler``: an object with ``start_train_ranks(argv, log_dir, env)``
    (the run's scheduler, or one the engine made; ``owns_scheduler``: stop it
    with the ranks). ``name`` appears in messages (``"fsdp"``, ``"megatron"``).
    """

    def __init__(
        self,
        name: str,
        module: str,
        world_size: int,
        scheduler: Any,
        log_dir: str | None = None,
        *,
        owns_scheduler: bool = False,
        startup_timeout_s: float = 300.0,
        dist_timeout_s: float = 1800.0,
        error_grace_s: float = 20.0,
        pythonpath: list[str] | None = None,
    ) -> None:
        self.name = name
        self.module = module
        self.world_size = int(world_size)
        self.scheduler = scheduler
        self.owns_scheduler = owns_scheduler
        self.log_dir = log_dir
        # A log directory this group made itself (no log_dir given) is removed
        # on a clean ``shutdown``; kept when anything failed, for its logs.
        self._own_log_dir = False
        self._failed = False
        self.startup_timeout_s = startup_timeout_s
        self.dist_timeout_s = dist_timeout_s
        self.error_grace_s = error_grace_s
        self.pythonpath = list(pythonpath or [])
        self.procs: list[Any] = []
        self._conns: list[mpc.Connection] = []
        self.broken: str | None = None
        self._lock = threading.Lock()

    @property
    def started(self) -> bool:
        return bool(self._conns)

    def start(self) -> None:
        """Start the ranks and wait until each has connected (``RankError``
        with the log tail when one exits or none connects in time)."""
        authkey = secrets.token_bytes(16)
        # Ranks on other nodes dial the controller where the scheduler says it
        # is reachable (loopback for the local scheduler).
        controller_host = getattr(self.scheduler, "controller_host", None)
        listener = mpc.Listener((controller_host() if controller_host else "127.0.0.1", 0), authkey=authkey)
        host, port = listener.address
        if not self.log_dir:
            self.log_dir = tempfile.mkdtemp(prefix=f"areal-{self.name}-")
            self._own_log_dir = True
        env = {
            CONTROL_ENV: f"{host}:{port}",
            AUTHKEY_ENV: authkey.hex(),  # environment, not argv: argv is world-readable
            "PYTHONPATH": os.pathsep.join(p for p in (*self.pythonpath, os.environ.get("PYTHONPATH", "")) if p),
        }
        argv = [
            sys.executable, "-m", self.module,
            "--parent-pid", str(os.getpid()),
            "--dist-timeout-s", str(self.dist_timeout_s),
        ]  # fmt: skip
        self.procs = self.scheduler.start_train_ranks(argv, self.log_dir, env)
        if len(self.procs) != self.world_size:
            self.stop()
            raise ArealError(f"the scheduler started {len(self.procs)} ranks, expected {self.world_size}")
        conns: dict[int, mpc.Connection] = {}
        accepted: list[mpc.Connection] = []

        def accept() -> None:
            try:
                for _ in range(self.world_size):
                    accepted.append(listener.accept())
            except Exception:  # noqa: BLE001 - the listener is closed on timeout
                pass

        threading.Thread(target=accept, daemon=True).start()
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            while len(conns) < self.world_size:
                while accepted:
                    c = accepted.pop()
                    if c.poll(5):
                        _tag, rank, _pid = pickle.loads(c.recv_bytes())
                        conns[int(rank)] = c
                self.check_alive("while starting")
                if time.monotonic() > deadline:
                    raise RankError(
                        f"{self.name} ranks did not connect within {self.startup_timeout_s:.0f}s; logs in {self.log_dir}"
                    )
                time.sleep(0.05)
        except BaseException:
            self._failed = True
            listener.close()
            self.stop()
            raise
        listener.close()
        self._conns = [conns[r] for r in range(self.world_size)]

    def check_alive(self, when: str) -> None:
        """``RankError`` (after stopping every rank) when a rank has exited."""
        for r, p in enumerate(self.procs):
            rc = p.poll()
            if rc is not None:
                self._failed = True
                log_path = os.path.join(self.log_dir or ".", f"rank-{r}.log")
                self.stop()
                self.broken = f"rank {r} exited with code {rc}"
                raise RankError(
                    f"{self.name} rank {r} exited with code {rc} {when}; log {log_path}:\n{log_tail(log_path)}"
                )

    def call(self, cmd: str, kwargs: dict[str, Any] | list[dict[str, Any]] | None = None) -> list[Any]:
        """Run ``cmd`` on every rank (``kwargs`` per rank when a list) and
        return the answers in rank order."""
        import cloudpickle

        if self.broken:
            raise ArealError(f"the {self.name} engine is unusable ({self.broken}); create a new one")
        if not self._conns:
            raise ArealError(f"the {self.name} ranks are not started: call initialize(model_path, total_train_steps)")
        per_rank = kwargs if isinstance(kwargs, list) else [kwargs or {}] * self.world_size
        with self._lock:
            payload = None if isinstance(kwargs, list) else cloudpickle.dumps((cmd, kwargs or {}))
            for c, kw in zip(self._conns, per_rank):
                c.send_bytes(payload if payload is not None else cloudpickle.dumps((cmd, kw)))
            return self._collect(cmd)

    def _collect(self, cmd: str) -> list[Any]:
        results: list[Any] = [None] * self.world_size
        pending = {c: r for r, c in enumerate(self._conns)}
        errors: list[tuple[int, Any]] = []
        first_error_at: float | None = None
        while pending:
            # wait() returns a subset of what it was given: connections only here.
            ready = cast("list[mpc.Connection]", mpc.wait(list(pending), timeout=1.0))
            for c in ready:
                r = pending.pop(c)
                try:
                    status, payload = pickle.loads(c.recv_bytes())
                except (EOFError, OSError):
                    self._failed = True
                    self.check_alive(f"during {cmd!r}")
                    self.stop()
                    self.broken = f"rank {r} closed its channel"
                    raise RankError(f"{self.name} rank {r} closed its control channel during {cmd!r}") from None
                if status == "ok":
                    results[r] = payload
                else:
                    self._failed = True
                    errors.append((r, payload))
                    first_error_at = first_error_at or time.monotonic()
            if not ready:
                self.check_alive(f"during {cmd!r}")
            if pending and first_error_at is not None and time.monotonic() - first_error_at > self.error_grace_s:
                # The ranks still running wait in a collective for the failed one.
                self.stop()
                self.broken = f"rank {errors[0][0]} failed during {cmd!r}"
                break
        if errors:
            r, (exc, text, tb) = errors[0]
            if isinstance(exc, ArealError):
                raise exc
            raise RankError(f"{self.name} rank {r} failed during {cmd!r}: {text}\n{tb}")
        return results

    def stop(self) -> None:
        """Close the channels and stop the ranks (their process groups)."""
        for c in self._conns:
            try:
                c.close()
            except OSError:
                pass
        self._conns = []
        if self.owns_scheduler:
            self.scheduler.stop()
        else:
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        self.procs = []

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask the ranks to exit, wait up to ``timeout_s``, then ``stop``; then
        remove the log directory if this group made it and nothing failed.
        Never raises."""
        if self._conns and not self.broken:
            try:
                import cloudpickle

                for c in self._conns:
                    c.send_bytes(cloudpickle.dumps(("shutdown", {})))
                deadline = time.monotonic() + timeout_s
                for p in self.procs:
                    p.wait(max(0.1, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - the kill below handles stragglers
                pass
        try:
            self.stop()
        except Exception:  # noqa: BLE001
            pass
        if self._own_log_dir and not self._failed and not self.broken and self.log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)
            self._own_log_dir = False


# ------------------------------------------------------------------ rank side
def _watch_parent(parent_pid: int, name: str) -> None:
    parent = ParentWatch(parent_pid)
    while True:
        if parent.gone():
            print(f"{name} rank: controller process is gone; exiting", file=sys.stderr, flush=True)
            _exit_now(3)
        time.sleep(0.5)


def join_process_group(timeout_s: float) -> Any:
    """Bind this rank to its device and join the default process group on the
    platform's collective backend (gloo on cpu, nccl on cuda, hccl on npu);
    returns the platform."""
    import datetime

    import torch.distributed as dist

    from areal_kernel.platforms import current_platform

    plat = current_platform()
    # The scheduler made exactly this rank's device visible (a no-op on host cores).
    plat.set_device(0)
    dist.init_process_group(backend=plat.dist_backend, timeout=datetime.timedelta(seconds=timeout_s))
    return plat


def serve(conn: Any, rank: int, world_size: int, make_engine: Callable[..., Any], name: str = "engine") -> None:
    """The rank's command loop (see the module docstring)."""
    import cloudpickle

    engine: Any = None
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            return  # the controller closed the channel (or died)
        cmd, kwargs = cloudpickle.loads(msg)
        try:
            if cmd == "shutdown":
                conn.send_bytes(pickle.dumps(("ok", None)))
                return
            if cmd == "create":
                engine = make_engine(rank=rank, world_size=world_size, **kwargs)
                result: Any = None
            else:
                if engine is None:
                    raise ArealError(f"{name} rank: engine not created")
                result = getattr(engine, cmd)(**kwargs)
            reply = ("ok", result)
        except BaseException as e:  # noqa: BLE001 - everything goes back to the controller
            tb = traceback.format_exc()
            try:
                pickle.dumps(e)
                exc: Any = e
            except Exception:  # noqa: BLE001
                exc = None
            reply = ("err", (exc, f"{type(e).__name__}: {e}", tb))
            print(tb, file=sys.stderr, flush=True)
        conn.send_bytes(pickle.dumps(reply))


def rank_main(make_engine: Callable[..., Any], name: str, argv: list[str] | None = None) -> int:
    """Body of a rank module's ``main``: parse the arguments ``RankGroup``
    passes, watch the parent, connect the control channel, join the process
    group and serve commands until shutdown. Then the process exits (code 0)
    at once, skipping the interpreter's shutdown (see the end of the body)."""
    p = argparse.ArgumentParser(description=f"one rank of the {name} train engine")
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--dist-timeout-s", type=float, default=1800.0)
    args = p.parse_args(argv)
    # The scheduler's agent that started this rank on its node, else the controller.
    parent_pid = int(os.environ.get(PARENT_PID_ENV) or args.parent_pid)
    threading.Thread(target=_watch_parent, args=(parent_pid, name), daemon=True).start()

    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, _, port = os.environ[CONTROL_ENV].rpartition(":")
    conn = mpc.Client((host, int(port)), authkey=bytes.fromhex(os.environ.pop(AUTHKEY_ENV)))
    conn.send_bytes(pickle.dumps(("hello", rank, os.getpid())))
    join_process_group(args.dist_timeout_s)
    try:
        serve(conn, rank, world_size, make_engine, name)
    finally:
        # Bounded: tearing the group down must not keep an ended rank alive.
        threading.Thread(target=_exit_after, args=(_TEARDOWN_S, 4), daemon=True).start()
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    # The rank ends here, without the interpreter's shutdown: atexit handlers
    # and non-daemon threads of the libraries an engine loads (seen with
    # megatron-core) can block it forever, and by then the parent watchdog no
    # longer runs, so the rank would outlive its run as an orphan.
    _exit_now(0)
    return 0  # not reached; keeps the documented ``int`` result for callers


_TEARDOWN_S = 30.0


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children first), read from /proc;
    empty where there is no /proc."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for d in entries:
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        children.setdefault(int(stat[stat.rfind(")") + 2 :].split()[1]), []).append(int(d))
    out: list[int] = []
    stack = [pid]
    while stack:
        for c in children.get(stack.pop(), []):
            out.append(c)
            stack.append(c)
    return out


def _exit_now(code: int) -> None:
    # Processes the engine's libraries started (megatron-core's checkpoint
    # workers, for one) would outlive the rank as orphans: they go with it.
    for pid in _descendants(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    flush_std_streams()
    os._exit(code)


def _exit_after(seconds: float, code: int) -> None:
    time.sleep(seconds)
    _exit_now(code)
