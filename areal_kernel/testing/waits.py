"""Waiting on events instead of sleeping, for tests that race a server.

A test that pauses, kills or updates a server *while it generates* must know
that a generation is running: a fixed sleep guesses, and a faster CPU finishes
the whole generation inside the guess (an AVX-512 machine did, with 400 tokens
of a tiny model in under 0.3 s). These helpers poll what a server reports.
"""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Callable

from areal_kernel.errors import ArealError


def wait_until(
    predicate: Callable[[], bool], *, timeout_s: float = 60.0, what: str = "the condition", interval_s: float = 0.002
) -> None:
    """Return as soon as ``predicate()`` is true; raise naming ``what`` after ``timeout_s``.

    The interval is short on purpose: the caller usually acts right after the
    event (pause, kill), and every millisecond of polling lag is generation
    that a fast machine finishes before the action lands.
    """
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise ArealError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


def _get(url: str, timeout_s: float = 10.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return r.read()


def embedded_info(address: str) -> dict:
    """An embedded server's ``/info`` (running, queued, tokens_generated, ...)."""
    return json.loads(_get(f"http://{address}/info"))


def embedded_running(address: str) -> int:
    """Generations an embedded server is running now, queued ones excluded."""
    return int(embedded_info(address)["running"])


def embedded_tokens_generated(address: str) -> int:
    """Tokens an embedded server has sampled since it started."""
    return int(embedded_info(address)["tokens_generated"])


def wait_for_embedded_tokens(address: str, n: int, *, since: int | None = None, timeout_s: float = 60.0) -> None:
    """Until the server at ``address`` has sampled ``n`` tokens more than ``since``
    (default: its count now)."""
    base = embedded_tokens_generated(address) if since is None else since
    wait_until(
        lambda: embedded_tokens_generated(address) >= base + n,
        timeout_s=timeout_s,
        what=f"{n} tokens generated on {address}",
    )
