"""Loopback port and address helpers."""

from __future__ import annotations

import socket


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (callers retry if it is taken by then)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


# Only these names count as private; any other address (even 127.0.0.2) is
# treated as reachable by others. The embedded server and the agent proxy
# both require a token to bind anything else.
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback name (``LOOPBACK_HOSTS``)."""
    return host in LOOPBACK_HOSTS
