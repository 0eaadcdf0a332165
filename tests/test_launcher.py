"""The test launcher's port picking: several ranks bind consecutive tcp ports, and a port
taken by another process between picking and binding costs a retry, never a failed start."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvpubd.protocol.endpoints import rank_endpoint, tcp_port
from kvpubd.tools.launcher import free_tcp_port_runs
from tests.daemon import Daemon, wait_for


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


TIED_CHILD = """
import multiprocessing, os, sys, time
from kvpubd.tools.launcher import tied


def wait_for_ever(path: str) -> None:
    with open(path + ".tmp", "w") as out:
        out.write(str(os.getpid()))
    os.rename(path + ".tmp", path)
    time.sleep(600)


if __name__ == "__main__":
    child = multiprocessing.get_context("spawn").Process(
        **tied(wait_for_ever, (sys.argv[1],)), daemon=True
    )
    child.start()
    time.sleep(600)
"""


def _running(pid: int) -> bool:
    """Alive and not a zombie (a child of a process killed is reaped by another, later)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.process
def test_a_tools_child_dies_with_the_tool_killed(tmp_path: Path) -> None:
    """A bench's helper processes (subscribers, loads, followers) waited on a daemon or a pipe
    for good once their tool was killed with SIGKILL: started through ``tied`` they get
    SIGTERM when it dies."""
    script = tmp_path / "tool.py"
    script.write_text(TIED_CHILD)
    pid_file = tmp_path / "child.pid"
    tool = subprocess.Popen([sys.executable, str(script), str(pid_file)])
    try:
        wait_for(pid_file.exists, 30, "the child")
        child = int(pid_file.read_text())
        assert _running(child)
    finally:
        tool.kill()
        tool.wait()
    wait_for(lambda: not _running(child), 10, "the child to die with its tool")
