"""A port held for a listener that binds it later (``PortReservation``):
nobody else on the machine gets it in between, and torch's ``TCPStore`` (the
weight group's and the ranks' rendezvous store) still binds it."""

from __future__ import annotations

import datetime
import socket

import pytest

from areal_kernel.utils.network import PortReservation, find_free_port, port_is_free, reserve_port

HOST = "127.0.0.1"


def _store(port: int, *, master: bool):
    import torch.distributed as dist

    return dist.TCPStore(
        HOST, port, 2, is_master=master, timeout=datetime.timedelta(seconds=10), wait_for_workers=False
    )


def test_a_held_port_goes_to_no_one_else_and_the_store_binds_it():
    with reserve_port(HOST) as held:
        port = held.port
        # Another process's plain bind is refused...
        assert not port_is_free(port, HOST)
        # ...and the kernel hands it to no bind of port 0 (what every
        # find_free_port and ephemeral bind on the machine does).
        assert all(find_free_port(HOST) != port for _ in range(300))
        master = _store(port, master=True)  # rank 0's store, while the port is held
        client = _store(port, master=False)
        client.set("k", "v")
        assert master.get("k") == b"v"
    # Released: the store keeps listening; the reservation is gone.
    assert held._sock is None
    held.release()  # twice is fine


def test_a_port_only_looked_up_can_be_taken_before_the_store_binds_it():
    """The race the reservation closes (negative control): a port looked up
    and let go is taken by another listener first, and the store then fails."""
    port = find_free_port(HOST)
    squatter = socket.socket()
    try:
        squatter.bind((HOST, port))
        squatter.listen()
        with pytest.raises(Exception, match="EADDRINUSE|in use"):
            _store(port, master=True)
    finally:
        squatter.close()


def test_holding_a_port_someone_listens_on_is_refused():
    busy = socket.socket()
    try:
        busy.bind((HOST, 0))
        busy.listen()
        with pytest.raises(OSError):
            PortReservation(HOST, busy.getsockname()[1])
    finally:
        busy.close()
