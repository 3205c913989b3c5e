"""The process table, read from ``/proc``, for tests that must show a
process was started where expected, restarted, or left nothing behind.

Linux only (so are the tests that use it). Zombies count as gone: a killed
child stays in the table until its parent reaps it, and a test asking "is
anything of mine still running" means running.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from areal_kernel.utils.procs import is_gone_state, stat_fields

__all__ = ["ProcInfo", "is_alive", "live_processes", "wait_gone"]


@dataclass(frozen=True)
class ProcInfo:
    """One live process: ids, state letter and command line."""

    pid: int
    ppid: int
    pgid: int
    state: str
    argv: tuple[str, ...]

    def runs(self, text: str) -> bool:
        """Whether one of the command line's words is (or contains) ``text``."""
        return any(text in a for a in self.argv)

    def arg_after(self, flag: str) -> str | None:
        """The word after ``flag`` on the command line, or ``None``."""
        if flag in self.argv[:-1]:
            return self.argv[self.argv.index(flag) + 1]
        return None

    def environ_has(self, text: str) -> bool:
        """Whether the process environment contains ``text`` (False when unreadable or gone)."""
        try:
            with open(f"/proc/{self.pid}/environ", "rb") as f:
                return text.encode() in f.read()
        except OSError:
            return False


def is_alive(pid: int) -> bool:
    """Whether ``pid`` runs (present and not a zombie)."""
    fields = stat_fields(pid)
    return fields is not None and not is_gone_state(fields[0])


def live_processes(where: Callable[[ProcInfo], bool] | None = None) -> list[ProcInfo]:
    """Every live process (zombies left out), or those for which ``where`` holds."""
    return [p for p in _scan() if where is None or where(p)]


def _scan() -> Iterator[ProcInfo]:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = stat_fields(entry)
        if fields is None or is_gone_state(fields[0]):
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        argv = tuple(a.decode(errors="replace") for a in raw.split(b"\0") if a)
        yield ProcInfo(pid=int(entry), ppid=int(fields[1]), pgid=int(fields[2]), state=fields[0], argv=argv)


def wait_gone(pid: int, timeout_s: float = 30.0) -> bool:
    """Wait until ``pid`` no longer runs; False if it still does after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while is_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
