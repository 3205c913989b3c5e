"""Free TCP ports for servers and rendezvous stores (no torch)."""
from __future__ import annotations

import socket


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bind to 0, read it, close).

    Another process can take it before the caller binds, so whoever uses it
    must handle a clash (the launcher retries on ``PORT_IN_USE_EXIT``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
