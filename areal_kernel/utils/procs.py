"""Helpers for the processes the kernel starts (servers, train ranks,
scheduler-placed processes): one definition each, used by every launcher."""

from __future__ import annotations

import os
import select
import sys
import time
from collections import deque

__all__ = [
    "ParentWatch",
    "flush_std_streams",
    "group_running",
    "is_gone_state",
    "stat_fields",
    "tail_file",
    "wait_group_gone",
]


def tail_file(path: str, n: int = 30) -> str:
    """The last ``n`` lines of a text file such as a process log (a note
    saying why instead, when it cannot be read: an error message that quotes a
    log must not fail because the log is missing)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=n))
    except OSError as e:
        return f"(no log: {e})"


def stat_fields(pid: int | str) -> list[str] | None:
    """Fields 3 onwards of ``/proc/<pid>/stat`` (state, ppid, pgrp, ...), or
    ``None`` when the process is gone or there is no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses; everything
    # after its closing parenthesis is space-separated.
    return stat[stat.rfind(")") + 2 :].split()


def is_gone_state(state: str) -> bool:
    """Whether a ``/proc`` state letter means the process no longer runs: a
    zombie (``Z``, waiting only for its reaper, holding no memory) or dead (``X``)."""
    return state in ("Z", "X")


def group_running(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs. Zombies count as gone
    (they hold no memory and wait only for their reaper). Read from ``/proc``;
    without one, the kernel's answer to ``killpg(pgid, 0)``, which counts
    zombies too."""
    if not os.path.isdir("/proc"):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = stat_fields(entry)
            if fields is not None and len(fields) > 2 and fields[2] == str(pgid) and not is_gone_state(fields[0]):
                return True
    return False


def wait_group_gone(pgid: int, timeout_s: float) -> bool:
    """Wait until no process of group ``pgid`` runs; False if one still does
    after ``timeout_s``. After a SIGKILL of a big process (a vLLM engine
    holding GBs) this takes a moment: the kernel frees its memory first."""
    deadline = time.monotonic() + timeout_s
    while group_running(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


class ParentWatch:
    """Whether the process that keeps this one alive is gone.

    Started directly by it, this process watches its own parent: once that
    dies, ``os.getppid()`` changes, which no pid reuse can fake. Started
    through an intermediary (a prefork server's keeper, a scheduler's agent)
    it watches ``pid`` itself, through a pidfd opened now (Linux 5.3+), which
    also stays true to the one process; else by signal 0."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.direct = os.getppid() == pid
        self._fd: int | None = None
        self._gone_at_start = False
        if not self.direct:
            try:
                self._fd = os.pidfd_open(pid)
            except ProcessLookupError:
                self._gone_at_start = True
            except (AttributeError, OSError):  # no pidfd here: signal 0
                self._fd = None

    def gone(self) -> bool:
        if self.direct:
            return os.getppid() != self.pid
        if self._gone_at_start:
            return True
        if self._fd is not None:
            readable, _, _ = select.select([self._fd], [], [], 0)
            return bool(readable)
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


def flush_std_streams() -> None:
    """Flush stdout and stderr before an ``os._exit`` (which skips the
    interpreter's own flushing); a closed or broken stream is passed over,
    so it cannot keep a process from ending."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
