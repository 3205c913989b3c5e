"""Loopback port helpers."""

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
