"""Peers in another PID namespace (another container of the pod, sharing the ipc socket's
directory) all have pid 0 in the credentials the kernel gives: the daemon must not take them
for one process and hold them all to one process's share of its replay slots, snapshot
places or connections (see zmq_loop.peer_address, conn_cap). Seen for real: the listener in a
PID namespace of its own (unprivileged ``unshare``), its clients in this one."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

LISTENER = """
import socket, sys, zmq
from kvpubd.daemon.conn_cap import IpcListener
from kvpubd.daemon.zmq_loop import peer_address

where = sys.argv[1]
router = zmq.Context().socket(zmq.ROUTER)
router.bind(f"ipc://{where}/zmq")
raw = socket.socket(socket.AF_UNIX)
raw.bind(f"{where}/raw")
raw.listen()
print("ready", flush=True)
frames = router.recv_multipart(copy=False)
print(repr(frames[1].get("Peer-Address")), flush=True)
print(repr(peer_address(frames[1])), flush=True)
conn, _ = raw.accept()
print(repr(IpcListener(f"ipc://{where}/raw").peer(conn.fileno())), flush=True)
"""


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare here")
    argv = [unshare, "--user", "--pid", "--fork", sys.executable, "-c", LISTENER, str(tmp_path)]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        if process.stdout.readline().strip() != "ready":
            process.wait(timeout=30)
            assert process.stderr is not None
            pytest.skip(f"no PID namespace for this user here: {process.stderr.read().strip()}")
        yield process
    finally:
        process.kill()
        process.wait(timeout=30)


@pytest.mark.process
def test_peers_in_another_pid_namespace_are_not_one_process(
    listener: subprocess.Popen[str], tmp_path: Path
) -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        dealer = context.socket(zmq.DEALER)
        dealer.connect(f"ipc://{tmp_path}/zmq")
        dealer.send(b"hello")
        with socket.socket(socket.AF_UNIX) as raw:
            raw.connect(f"{tmp_path}/raw")
            out, err = listener.communicate(timeout=30)
    finally:
        context.destroy(linger=0)
    told, address, peer = out.splitlines()
    assert told.endswith(":0'"), (told, err)  # what the kernel says of such a peer
    assert address == "''"  # no share: not the one process all such peers would be
    assert peer == "None"
