"""The seq state file of ``seq_origin = "continue"`` when things go wrong, against a real
daemon: a corrupt or lost file starts a run at 0 (as a first run) and the daemon serves; a
directory it cannot use leaves it serving at 0 with a warning; a second daemon on the same
events endpoint (and so the same file) exits with one line and leaves the first's file as
it was."""

from __future__ import annotations

import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from kvpubd.daemon.seq_state import FILE_SIZE, MAGIC, state_path
from kvpubd.protocol.endpoints import rank_endpoint
from kvpubd.protocol.wire import MAX_SEQ
from kvpubd.tools.launcher import free_tcp_ports
from tests.conftest import DaemonFactory
from tests.daemon import Daemon, write_config
from tests.mirrors import store_released, unique_prompt

# Runs that end by a signal or kill -9, and the state file they leave: processes.
pytestmark = pytest.mark.daemon_process


def state_file(daemon: Daemon, rank: int = 0) -> Path:
    return state_path(daemon.dir, rank, rank_endpoint(daemon.events_endpoint, rank))


def run_some(daemon: Daemon) -> int:
    """Store a little; the last seq published."""
    with daemon.client() as client:
        store_released(client, unique_prompt(2))
        return client.snapshot().seq


def test_a_corrupt_file_starts_a_first_run(start_daemon: DaemonFactory) -> None:
    """Garbage in the file: the run starts at 0, says why, and writes a good file that the
    next run continues from."""
    daemon = start_daemon()
    run_some(daemon)
    daemon.stop(signal.SIGKILL)
    state_file(daemon).write_bytes(b"\x00" * FILE_SIZE)
    daemon.start()
    assert daemon.first_seq() == 0
    assert "is corrupt" in daemon.log()
    last = run_some(daemon)
    daemon.stop(signal.SIGKILL)
    daemon.start()
    assert daemon.first_seq() == last + 1


def test_the_end_of_the_seq_space_starts_again_at_zero(start_daemon: DaemonFactory) -> None:
    """A last seq of 2^64 - 2 (ff x 8 is the replay end marker, never a seq): the next run
    starts at 0, not past the 8-byte frame."""
    daemon = start_daemon()
    daemon.stop(signal.SIGKILL)
    last = MAX_SEQ
    state_file(daemon).write_bytes(MAGIC + struct.pack(">QQ", last, last ^ ((1 << 64) - 1)))
    daemon.start()
    assert daemon.first_seq() == 0


def test_a_lost_file_starts_a_first_run(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon()
    assert run_some(daemon) > 0
    daemon.stop(signal.SIGKILL)
    state_file(daemon).unlink()
    daemon.start()
    assert daemon.first_seq() == 0


def test_an_unusable_directory_leaves_the_daemon_serving(
    start_daemon: DaemonFactory, tmp_path: Path
) -> None:
    """seq_state_dir below a plain file (no directory can be made there, whoever runs it):
    one warning, seqs from 0, and the daemon publishes as ever."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    daemon = start_daemon(events={"seq_state_dir": str(blocker / "state")})
    assert daemon.first_seq() == 0
    assert run_some(daemon) > 0
    assert "seqs start at 0 and a restart will not continue them" in daemon.log()


def test_a_second_daemon_on_the_same_stream_leaves_the_file_alone(tmp_path: Path) -> None:
    """Two daemons configured with one events endpoint (tcp: the bind would fail only later)
    and one state directory: the second exits 1 naming the state file, before it writes it;
    the first's next run continues its seqs."""
    daemon = Daemon(transport="tcp")
    try:
        daemon.start()
        last = run_some(daemon)
        replay, control = free_tcp_ports(2)
        second = dict(daemon.settings)
        second["events"] = {
            **daemon.settings["events"],
            "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        }
        second["control"] = {"endpoint": f"tcp://127.0.0.1:{control}"}
        config = tmp_path / "second.toml"
        write_config(config, second)
        result = subprocess.run(
            [sys.executable, "-m", "kvpubd", "serve", "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert result.returncode == 1, result.stderr
        assert result.stderr.strip().splitlines()[-1] == (
            f"kvpubd: cannot start: seq state file {state_file(daemon)} is in use by another daemon"
        )
        last = run_some(daemon)
        daemon.stop(signal.SIGKILL)
        daemon.start()
        assert daemon.first_seq() == last + 1
    finally:
        daemon.cleanup()
