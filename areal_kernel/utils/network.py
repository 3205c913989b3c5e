"""Loopback port helpers, and which bind addresses count as private."""

from __future__ import annotations

import hmac
import socket


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (callers retry if it is taken by then)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(port: int, host: str = "127.0.0.1", *, reuse_addr: bool = False) -> bool:
    """Whether ``host:port`` can be bound now. ``reuse_addr``: probe the way
    servers that set SO_REUSEADDR bind (aiohttp, uvicorn), so connections of
    a server that just stopped (TIME_WAIT) do not count; a listener does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        if reuse_addr:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


# Only these names count as private; any other address (even 127.0.0.2 or
# 0.0.0.0) is treated as reachable by others, so control routes bound there
# need an admin token (embedded servers, the ``areal inf`` gateway, the agent
# proxy).
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a server private to this machine."""
    return host in LOOPBACK_HOSTS


def bearer_matches(authorization: str, token: str) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <token>``
    (compared in constant time, so the token cannot be guessed byte by byte)."""
    return hmac.compare_digest(authorization.encode(), f"Bearer {token}".encode())
