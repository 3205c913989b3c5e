"""Reward worker process: ``python -m areal_kernel.reward._worker FD``.

Started by ``RewardPool`` with ``subprocess`` (fork-free: nothing of the
parent's threads or locks is inherited, and the parent's ``__main__`` is
never re-imported, unlike multiprocessing's spawn). It talks over one socket
wrapped as a ``multiprocessing.connection.Connection``:

parent -> worker: ``{"sys_path", "preload", "resolve", "parent_pid"}`` once
(``preload`` entries are modules to import or ``module:function`` warm-ups to
call; ``resolve`` names the reward functions the pool is for, imported before
``ready`` so that importing a reward's module never counts against a call's
timeout; one that cannot be imported is left for its calls to report), then
``(call_id, fn_path, (completion, answer), kwargs_json)`` per call (keyword
arguments as JSON text: the settings of a reward are plain data), ``None``
to stop.
worker -> parent: ``("ready", pid)`` or ``("startup_error", msg)`` once, then
``(call_id, status, payload)`` with status ``ok`` (a float), ``error``
(the function raised or returned a non-number) or ``config`` (``fn_path``
cannot be imported).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
import threading
import time
from typing import Any, Callable


def resolve_callable(fn_path: str) -> Callable[..., Any]:
    """``"pkg.mod:func"`` (or ``"pkg.mod.func"``) -> the function object."""
    if ":" in fn_path:
        module_name, _, attr_path = fn_path.partition(":")
    else:
        module_name, _, attr_path = fn_path.rpartition(".")
    if not module_name or not attr_path:
        raise ValueError(f"reward function {fn_path!r} must look like 'package.module:function'")
    obj: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"reward function {fn_path!r} resolves to a {type(obj).__name__}, which is not callable")
    return obj


def _watch_parent(parent_pid: int) -> None:
    """Exit when the parent is gone, even if a reward call hangs forever."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(3)


def _run(conn: Any) -> int:
    init = conn.recv()
    sys.path[:] = list(init["sys_path"])
    threading.Thread(target=_watch_parent, args=(init["parent_pid"],), daemon=True).start()
    try:
        for name in init["preload"]:
            # "module" is imported; "module:function" is also called (a warm-up).
            if ":" in name:
                resolve_callable(name)()
            else:
                importlib.import_module(name)
    except BaseException as exc:  # report, then exit: the parent raises it
        conn.send(("startup_error", f"preloading {name!r} failed: {type(exc).__name__}: {exc}"))
        return 1
    cache: dict[str, Callable[..., Any]] = {}
    for fn_path in init.get("resolve", ()):
        try:
            cache[fn_path] = resolve_callable(fn_path)
        except Exception:  # the call reports it, as a "config" answer naming the function
            pass
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return 0
        if msg is None:
            return 0
        call_id, fn_path, args, kwargs_json = msg
        kwargs = json.loads(kwargs_json)
        try:
            fn = cache.get(fn_path) or cache.setdefault(fn_path, resolve_callable(fn_path))
        except BaseException as exc:
            conn.send((call_id, "config", f"{type(exc).__name__}: {exc}"))
            continue
        try:
            value = fn(*args, **kwargs)
        except BaseException as exc:  # SystemExit from a reward is still just a failed call
            conn.send((call_id, "error", f"{type(exc).__name__}: {exc}"))
            continue
        try:
            score = float(value)
            if not math.isfinite(score):
                raise ValueError
        except (TypeError, ValueError):
            conn.send((call_id, "error", f"returned {value!r}, expected a finite number"))
            continue
        conn.send((call_id, "ok", score))


def main() -> int:
    # Rewards never need more than one thread; more only fights the trainer.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from multiprocessing.connection import Connection

    conn = Connection(int(sys.argv[1]))
    try:
        return _run(conn)
    finally:
        conn.close()


if __name__ == "__main__":
    sys.exit(main())
