"""Helpers for the processes the kernel starts (servers, train ranks,
scheduler-placed processes): one definition each, used by every launcher."""

from __future__ import annotations

from collections import deque

__all__ = ["tail_file"]


def tail_file(path: str, n: int = 30) -> str:
    """The last ``n`` lines of a text file such as a process log (a note
    saying why instead, when it cannot be read: an error message that quotes a
    log must not fail because the log is missing)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=n))
    except OSError as e:
        return f"(no log: {e})"
