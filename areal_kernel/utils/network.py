"""Loopback port helpers, and which bind addresses count as private."""

from __future__ import annotations

import hmac
import socket


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (callers retry if it is taken by then)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class PortReservation:
    """Holds a TCP port for a listener that another call (often another
    process) is about to open, so nothing else takes it in between.

    ``find_free_port`` answers a port that was free when it asked; whoever
    binds it next gets it. A port handed to a process that binds it seconds
    later (a rank's rendezvous store, after its imports) can meanwhile be
    taken by any other bind of port 0 or outgoing connection on the machine,
    and the listener then fails with "address already in use".

    How it holds the port (Linux): the socket is bound with ``SO_REUSEADDR``
    but never listens. While it is bound the kernel gives the port to no
    bind of port 0 and no outgoing connection, and a bind without
    ``SO_REUSEADDR`` fails; a listener that sets ``SO_REUSEADDR`` itself
    binds it all the same, because sockets that all set it may share a port
    as long as none of them listens yet. torch's ``TCPStore`` sets it
    (``tests/weights/test_port_reservation.py`` checks both sides). Once the
    listener is up the reservation has done its work; release it then or
    later (``release``, or leave the ``with`` block).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        """Hold ``port`` on ``host`` (0: a free one); raises ``OSError`` when
        ``port`` is already bound by someone else."""
        self.host = host
        self._sock: socket.socket | None = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
        except OSError:
            self._sock.close()
            raise
        self.port: int = int(self._sock.getsockname()[1])

    def release(self) -> None:
        """Let the port go (safe to call twice)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> "PortReservation":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def reserve_port(host: str = "127.0.0.1") -> PortReservation:
    """A free port on ``host``, held until released (``PortReservation``)."""
    return PortReservation(host)


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
