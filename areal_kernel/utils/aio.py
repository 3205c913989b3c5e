"""Event loops that end clean, whatever user code left on them.

Agents run as coroutines on a loop the kernel owns (the rollout executor's
thread, an evaluation, an ``areal agent`` worker). An agent may leave things
behind: tasks it started and never awaited, or an HTTP client it never
closed (an ``openai.AsyncOpenAI`` left to the garbage collector). Such a
client's connections belong to the loop it ran on. Its own finalizer closes
them on whatever loop is running in the thread that happens to collect it,
which may be another loop, or one run after this loop closed; each then
fails with ``RuntimeError: Event loop is closed`` as a "Task exception was
never retrieved" traceback.

So the kernel ends what it can attribute and closes the rest before the
loop closes, instead of trusting every agent to do it:

- ``scope()`` around one piece of user code (an agent session): tasks
  started inside it that are still pending when it ends are cancelled and
  awaited;
- ``finish_loop()`` before a loop closes: pending tasks are cancelled, a
  garbage collection runs on the loop (so an abandoned client's finalizer
  closes it here, on its own loop, and that close is awaited), async
  generators are finalised, and every connection opened on the loop that is
  still open is aborted (a finaliser that runs later finds it closed and has
  nothing to do);
- ``KernelEventLoop`` is the loop that makes both possible: it remembers the
  tasks each scope starts and every connection opened on it (through the
  public ``create_connection``, which aiohttp, httpx and anyio use).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import weakref
from typing import Any, AsyncIterator, Coroutine, TypeVar

from areal_kernel.logging import get_logger

log = get_logger(__name__)
T = TypeVar("T")


class _Scope:
    def __init__(self, what: str) -> None:
        self.what = what
        self.tasks: weakref.WeakSet[asyncio.Task] = weakref.WeakSet()


_SCOPE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("areal_loop_scope", default=None)
_told = False


class KernelEventLoop(asyncio.SelectorEventLoop):
    """The default selector loop, plus: the tasks each ``scope`` starts and
    the connections opened on it are remembered (weakly), so that what user
    code leaves behind can be ended."""

    def __init__(self) -> None:
        super().__init__()
        self.connections: weakref.WeakSet[asyncio.BaseTransport] = weakref.WeakSet()
        self.set_task_factory(_task_factory)

    async def create_connection(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        transport, protocol = await super().create_connection(*args, **kwargs)
        self.connections.add(transport)
        return transport, protocol

    async def create_unix_connection(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        transport, protocol = await super().create_unix_connection(*args, **kwargs)
        self.connections.add(transport)
        return transport, protocol


def _task_factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task:
    task = asyncio.Task(coro, loop=loop, **kwargs)
    # Called in the creating task's context: the scope its creator runs in.
    scope = _SCOPE.get()
    if scope is not None:
        scope.tasks.add(task)
    return task


async def _cancel(tasks: set[asyncio.Task], what: str, timeout: float) -> None:
    tasks = {t for t in tasks if not t.done()}
    if not tasks:
        return
    for t in tasks:
        t.cancel()
    _, pending = await asyncio.wait(tasks, timeout=timeout)
    for t in tasks - pending:
        if not t.cancelled() and t.exception() is not None:
            log.debug("a task left running ended with an error", where=what, error=repr(t.exception()))
    global _told
    # Once at info (the agent's author may want to know), then quietly: one line per session would flood a run.
    (log.debug if _told else log.info)(
        "cancelled tasks left running (the kernel ends them; docs/agents.md)",
        where=what, tasks=len(tasks), still_pending=len(pending),
    )  # fmt: skip
    _told = True


@contextlib.asynccontextmanager
async def scope(what: str, timeout: float = 5.0) -> AsyncIterator[None]:
    """Tasks started inside (and by those tasks) that are still pending at
    the end are cancelled and awaited (up to ``timeout`` seconds). Only on a
    ``KernelEventLoop``; elsewhere it does nothing."""
    if not isinstance(asyncio.get_running_loop(), KernelEventLoop):
        yield
        return
    s = _Scope(what)
    token = _SCOPE.set(s)
    try:
        yield
    finally:
        _SCOPE.reset(token)
        await _cancel(set(s.tasks) - {asyncio.current_task()}, what, timeout)  # type: ignore[arg-type]


async def finish_loop(what: str = "event loop", timeout: float = 5.0) -> None:
    """Run on a loop just before it closes (see the module's docstring)."""
    loop = asyncio.get_running_loop()
    me = asyncio.current_task()
    await _cancel(asyncio.all_tasks() - {me}, what, timeout)  # type: ignore[arg-type]
    # Garbage with a finaliser that closes itself on the running loop (openai's
    # clients do) is collected here, where the running loop is the one its
    # connections belong to; the closes it schedules are awaited (and their
    # errors, for garbage from other loops, kept off the console).
    gc.collect()
    closing = asyncio.all_tasks() - {me}  # type: ignore[operator]
    if closing:
        _, pending = await asyncio.wait(closing, timeout=timeout)
        for t in pending:
            t.cancel()
        for t in closing - pending:
            if not t.cancelled() and t.exception() is not None:
                log.debug("closing an abandoned object failed", where=what, error=repr(t.exception()))
    await loop.shutdown_asyncgens()
    if isinstance(loop, KernelEventLoop):
        left = [c for c in list(loop.connections) if not c.is_closing()]
        for c in left:
            c.abort()  # type: ignore[attr-defined]
        if left:
            log.info("closed connections left open", where=what, connections=len(left))
        await asyncio.sleep(0)  # the transports' connection_lost callbacks run now, on their loop


def close_loop(loop: asyncio.AbstractEventLoop, what: str = "event loop") -> None:
    """``finish_loop`` on ``loop`` (not running), then close it. The default
    executor is not waited for (``loop.close`` shuts it down without waiting):
    a thread an agent left blocked must not hold up the end of a run."""
    try:
        loop.run_until_complete(finish_loop(what))
    except Exception as e:  # cleaning up must never be what fails a run
        log.warning("ending the event loop's leftovers failed", where=what, error=f"{type(e).__name__}: {e}")
    finally:
        loop.close()


def run(coro: Coroutine[Any, Any, T], what: str = "event loop") -> T:
    """``asyncio.run`` on a fresh ``KernelEventLoop`` that ends clean."""
    loop = KernelEventLoop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(coro)
    finally:
        try:
            close_loop(loop, what)
        finally:
            asyncio.set_event_loop(None)
