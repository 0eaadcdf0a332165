"""A client that dies holding stores does not pin their blocks for ever: once it has had no
control connection for ``control.orphan_grace_ms`` its open requests are released (their blocks
stay cached, only unpinned), and a plain reset is no longer refused ``busy``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvpubd.client import ControlError
from tests.conftest import DaemonFactory
from tests.daemon import Daemon, wait_for

# Clients that die: processes.
pytestmark = pytest.mark.process

BLOCK_SIZE = 16
GRACE_MS = 200

# A client process: stores a prompt under the given request id, says so, and holds it (with
# its connection) until it is killed or its stdin closes.
HOLDER = """
import sys
from kvpubd.client import ControlClient
client = ControlClient(sys.argv[1])
first = 1 + 100_000 * len(sys.argv[2])  # prompts of distinct ids share no prefix
reply = client.store(sys.argv[2], list(range(first, first + int(sys.argv[3]))))
print(len(reply.block_ids), flush=True)
sys.stdin.read()
"""


@pytest.fixture
def holders() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait()


def hold(
    daemon: Daemon, holders: list[subprocess.Popen[str]], request_id: str, tokens: int
) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, daemon.control_endpoint, request_id, str(tokens)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ},
    )
    holders.append(proc)
    assert proc.stdout is not None
    assert int(proc.stdout.readline()) == tokens // BLOCK_SIZE
    return proc


def pinned(daemon: Daemon) -> tuple[int, int]:
    with daemon.client() as client:
        rank = client.stats().ranks[0]
        return rank.requests_open, rank.blocks_pinned


@pytest.mark.parametrize("death", [signal.SIGKILL, signal.SIGTERM])
def test_a_dead_clients_requests_are_released_and_the_live_ones_kept(
    start_daemon: DaemonFactory,
    holders: list[subprocess.Popen[str]],
    death: signal.Signals,
) -> None:
    daemon = start_daemon(control={"orphan_grace_ms": GRACE_MS}, cache={"num_blocks": 16})
    dying = hold(daemon, holders, "dead", 8 * BLOCK_SIZE)
    living = hold(daemon, holders, "alive", 4 * BLOCK_SIZE)
    assert pinned(daemon) == (2, 12)
    with daemon.client() as client, pytest.raises(ControlError) as refused:
        client.reset()
    assert refused.value.code == "busy"

    dying.send_signal(death)
    dying.wait()
    # Released after the grace; the living client's request stays open.
    assert wait_for(lambda: pinned(daemon) == (1, 4), what="the dead client's release")
    assert living.poll() is None
    with daemon.client() as client:
        # Its blocks are still cached, only unpinned: a prompt of 12 blocks fits again.
        reply = client.store("next", list(range(1, 12 * BLOCK_SIZE + 1)))
        assert len(reply.block_ids) == 12
        client.release("next")
        client.release("alive")
        client.reset()
