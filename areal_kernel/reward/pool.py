"""Run reward functions in worker processes with a per-call timeout.

Rewards are user code (sympy, regexes, code execution) that can hang or
crash. Each call runs in a separate process; a call that exceeds the timeout
gets its worker (and the worker's whole process group) killed and replaced,
and returns ``RewardResult(ok=False, error="timeout")``. The run never hangs.

Functions are named by import path (``"pkg.module:function"``) and keyword
arguments travel as JSON text, so nothing but strings crosses into a worker:
no object of the controller (a pydantic model, a tokenizer) can leak into
user code, and a reward sees the same values whichever process runs it.
Workers are started with ``subprocess`` (fork-free) in their own session.

Settings: ``RewardPool(settings={fn_path: {...}})`` binds keyword arguments
to a function; every call of that function gets them (keywords given to the
call win). The trainer binds the validated ``reward.<name>`` section of the
selected reward this way (``trainer.components.make_reward_pool``).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from areal_kernel.errors import ArealError, ConfigError

# Short names for the built-in rewards; anything else is an import path.
BUILTIN_REWARDS = {
    "math": "areal_kernel.reward.math:math_verify_reward",
    "math_verify": "areal_kernel.reward.math:math_verify_reward",
    "exact_match": "areal_kernel.reward.exact_match:exact_match_reward",
}


@dataclass
class RewardResult:
    """Outcome of one reward call. ``score`` is 0.0 whenever ``ok`` is False."""

    score: float
    ok: bool = True
    error: str | None = None  # "timeout", "worker crashed ...", "ValueError: ..."
    elapsed_s: float = 0.0


def to_json_kwargs(kwargs: Mapping[str, Any], what: str) -> str:
    """``kwargs`` as JSON text; anything that is not plain JSON data is a
    ``ConfigError`` naming ``what`` (the reward) and the offending key."""
    for key, value in kwargs.items():
        if not isinstance(key, str):
            raise ConfigError(f"keyword arguments of reward {what!r} need string names, got {key!r}")
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"keyword argument {key!r} of reward {what!r} is not plain JSON data "
                f"({type(value).__name__}: {exc}); rewards run in worker processes and receive JSON values only"
            ) from None
    return json.dumps(dict(kwargs), allow_nan=False)


def resolve_reward_path(fn_path: str) -> str:
    """Built-in short name -> import path; checks the ``module:function`` shape."""
    path = BUILTIN_REWARDS.get(fn_path, fn_path)
    if not isinstance(path, str) or not (":" in path or "." in path) or path.startswith((":", ".")):
        raise ConfigError(
            f"reward function {fn_path!r} must be 'package.module:function' or one of {sorted(BUILTIN_REWARDS)}"
        )
    return path


class _Worker:
    """One worker slot: a process and its connection, restartable in place."""

    def __init__(self, preload: Sequence[str], resolve: Sequence[str] = ()) -> None:
        self._preload = tuple(preload)
        self._resolve = tuple(resolve)
        self._start()

    def _start(self) -> None:
        from multiprocessing.connection import Connection

        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        # The worker must import areal_kernel even when it is not pip-installed.
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "areal_kernel.reward._worker", str(child_sock.fileno())],
                pass_fds=(child_sock.fileno(),),
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # so a timeout kills the worker's children too
            )
        finally:
            child_sock.close()
        self.conn = Connection(parent_sock.detach())
        self.ready = False
        self.conn.send(
            {
                "sys_path": list(sys.path),
                "preload": list(self._preload),
                "resolve": list(self._resolve),
                "parent_pid": os.getpid(),
            }
        )

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout: float) -> None:
        if self.ready:
            return
        try:
            if not self.conn.poll(timeout):
                raise ArealError(f"reward worker (pid {self.proc.pid}) did not start within {timeout:.0f} s")
            kind, payload = self.conn.recv()
        except (EOFError, OSError):
            raise ArealError(
                f"reward worker (pid {self.proc.pid}) exited during startup (code {self.proc.wait()})"
            ) from None
        if kind != "ready":
            raise ConfigError(f"reward worker could not start: {payload}")
        self.ready = True

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the worker leads its own session
        except (ProcessLookupError, PermissionError):
            self.proc.kill()
        self.proc.wait()
        self.conn.close()

    def restart(self) -> None:
        self.kill()
        self._start()

    def stop(self, timeout: float = 2.0) -> None:
        try:
            self.conn.send(None)
            self.proc.wait(timeout)
        except (OSError, subprocess.TimeoutExpired):
            pass
        if self.alive:
            self.kill()
        else:
            self.conn.close()


class RewardPool:
    """A pool of reward worker processes.

    ``score``/``ascore`` block (or await) until a worker is free, then give
    the call ``timeout_s`` seconds. Worker startup (Python, ``preload``
    imports and the modules of the rewards in ``settings``) never counts
    against a call's timeout. ``settings`` maps a
    reward (short name or import path) to keyword arguments sent with each of
    its calls; they must be plain JSON data.
    """

    def __init__(
        self,
        n_workers: int | None = None,
        timeout_s: float = 15.0,
        *,
        preload: Sequence[str] = ("areal_kernel.reward.math:warmup",),
        startup_timeout_s: float = 120.0,
        settings: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        if n_workers is None:
            n_workers = max(1, min(4, os.cpu_count() or 1))
        if n_workers < 1:
            raise ConfigError(f"reward pool n_workers must be >= 1, got {n_workers}")
        if not timeout_s > 0:
            raise ConfigError(f"reward timeout_s must be > 0, got {timeout_s}")
        self.n_workers = n_workers
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = float(startup_timeout_s)
        self._preload = tuple(preload)
        # Checked (and frozen as JSON text) now, so a bad value fails at start-up, not per call.
        self._settings: dict[str, dict[str, Any]] = {}
        for fn_path, values in (settings or {}).items():
            path = resolve_reward_path(fn_path)
            self._settings[path] = json.loads(to_json_kwargs(values, fn_path))
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._closed = False
        self._stats = {"calls": 0, "ok": 0, "failures": 0, "timeouts": 0, "crashes": 0, "restarts": 0}
        # One thread per worker: ascore never waits behind unrelated executor work.
        self._executor = ThreadPoolExecutor(n_workers, thread_name_prefix="areal-reward")
        # The bound rewards are imported at worker start-up (a replacement's
        # included): a module that takes seconds to import under load must not
        # time out the first call a fresh worker takes.
        self._workers = [_Worker(self._preload, tuple(self._settings)) for _ in range(n_workers)]
        for w in self._workers:
            self._idle.put(w)

    # -- public API ------------------------------------------------------------

    def score(self, fn_path: str, completion: str, answer: str, **kw: Any) -> RewardResult:
        """Run ``fn_path(completion, answer, **settings, **kw)`` in a worker
        (blocking); ``settings`` are the keywords bound to ``fn_path``."""
        path = resolve_reward_path(fn_path)
        kwargs_json = to_json_kwargs({**self._settings.get(path, {}), **kw}, fn_path)
        for _ in range(2):  # a worker found dead before the call gets one retry
            worker = self._acquire()
            try:
                return self._call(worker, path, (completion, answer), kwargs_json)
            except _Retry:
                continue
            finally:
                self._release(worker)
        raise ArealError("reward workers keep dying before accepting a call; see their stderr")

    async def ascore(self, fn_path: str, completion: str, answer: str, **kw: Any) -> RewardResult:
        """``score`` without blocking the event loop."""
        self._check_open()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor, functools.partial(self.score, fn_path, completion, answer, **kw)
        )

    def stats(self) -> dict[str, int]:
        """Counters: calls, ok, failures (any ok=False), timeouts, crashes, restarts."""
        with self._lock:
            return dict(self._stats)

    def worker_pids(self) -> list[int]:
        """Current worker process ids (they change when a worker is replaced)."""
        return sorted(w.proc.pid for w in self._workers)

    def close(self) -> None:
        """Stop every worker. Calls still running are killed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for w in self._workers:
            w.stop()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:  # best effort; close() is the real API
        if getattr(self, "_workers", None) is not None:
            try:
                self.close()
            except Exception:
                pass

    # -- internals -------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ArealError("RewardPool is closed")

    def _restart(self, worker: _Worker) -> None:
        """Kill ``worker`` and start a fresh process in its slot (not after close)."""
        if self._closed:
            worker.kill()
            return
        worker.restart()
        with self._lock:
            self._stats["restarts"] += 1

    def _acquire(self) -> _Worker:
        while True:
            self._check_open()
            try:
                worker = self._idle.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                if not worker.alive:  # died while idle (e.g. killed from outside)
                    self._restart(worker)
                worker.wait_ready(self.startup_timeout_s)
            except ArealError:
                self._restart(worker)
                self._release(worker)
                raise
            return worker

    def _release(self, worker: _Worker) -> None:
        if not self._closed:
            self._idle.put(worker)

    def settings(self, fn_path: str) -> dict[str, Any]:
        """The keyword arguments bound to ``fn_path`` (a copy)."""
        return dict(self._settings.get(resolve_reward_path(fn_path), {}))

    def _call(self, worker: _Worker, path: str, args: tuple[str, str], kwargs_json: str) -> RewardResult:
        call_id = next(self._ids)
        try:
            # Only strings are sent: nothing can fail to pickle half-way.
            worker.conn.send((call_id, path, args, kwargs_json))
        except OSError as exc:  # the worker died before taking the call
            self._restart(worker)
            raise _Retry from exc
        start = time.monotonic()
        status = "timeout"
        payload: Any = None  # the score (ok), or what the worker sent about its failure
        try:
            if worker.conn.poll(self.timeout_s):
                got_id, status, payload = worker.conn.recv()
                if got_id != call_id:
                    raise RuntimeError(f"reward worker answered call {got_id}, expected {call_id}")
        except (EOFError, OSError):
            status = "crash"
        elapsed = time.monotonic() - start
        if status == "ok":
            self._count(ok=True)
            return RewardResult(score=payload, ok=True, elapsed_s=elapsed)
        if status == "config":
            self._count(ok=False)
            raise ConfigError(f"reward function {path!r} cannot be loaded in the reward worker: {payload}")
        if status == "timeout":
            self._restart(worker)
            self._count(ok=False, key="timeouts")
            return RewardResult(score=0.0, ok=False, error="timeout", elapsed_s=elapsed)
        if status == "crash":
            code = worker.proc.wait()
            self._restart(worker)
            self._count(ok=False, key="crashes")
            return RewardResult(score=0.0, ok=False, error=f"worker crashed (exit code {code})", elapsed_s=elapsed)
        self._count(ok=False)
        return RewardResult(score=0.0, ok=False, error=str(payload), elapsed_s=elapsed)

    def _count(self, ok: bool, key: str | None = None) -> None:
        with self._lock:
            self._stats["calls"] += 1
            self._stats["ok" if ok else "failures"] += 1
            if key:
                self._stats[key] += 1


class _Retry(Exception):
    """The worker died before it took the call; run it on a fresh worker."""
