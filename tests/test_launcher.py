"""The test launcher's port picking: several ranks bind consecutive tcp ports, and a port
taken by another process between picking and binding costs a retry, never a failed start."""

from __future__ import annotations

import socket

import pytest

from kvpubd.protocol.endpoints import rank_endpoint, tcp_port
from kvpubd.tools.launcher import free_tcp_port_runs
from tests.daemon import Daemon


def test_port_runs_are_free_and_disjoint() -> None:
    widths = [4, 4, 1]
    bases = free_tcp_port_runs(widths)
    ports = [
        base + offset for base, width in zip(bases, widths, strict=True) for offset in range(width)
    ]
    assert len(set(ports)) == len(ports)
    held = []
    try:
        for port in ports:  # every one binds: none was in use when picked
            sock = socket.socket()
            held.append(sock)
            sock.bind(("127.0.0.1", port))
    finally:
        for sock in held:
            sock.close()


@pytest.mark.process
def test_a_taken_port_gets_fresh_ones_on_first_start() -> None:
    daemon = Daemon({"cache": {"data_parallel_size": 2}}, transport="tcp")
    taken_endpoint = rank_endpoint(daemon.events_endpoint, 1)
    squatter = socket.socket()
    try:
        squatter.bind(("127.0.0.1", tcp_port(taken_endpoint) or 0))
        squatter.listen()
        daemon.start()
        assert rank_endpoint(daemon.events_endpoint, 1) != taken_endpoint
        with daemon.client() as client:
            assert len(client.stats().ranks) == 2
    finally:
        squatter.close()
        daemon.cleanup()
