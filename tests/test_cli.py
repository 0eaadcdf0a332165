"""The ``kvpubd`` command line, run as ``python -m kvpubd`` against a real daemon."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any, cast

import pytest

from kvpubd import __version__
from kvpubd.client import Received
from kvpubd.protocol.endpoints import rank_endpoint
from kvpubd.protocol.wire import AllBlocksCleared, BlockStored
from tests.conftest import DaemonFactory
from tests.daemon import Daemon
from tests.streams import chain_hashes

# The command line, run as users run it: processes.
pytestmark = pytest.mark.process

BLOCK_SIZE = 16
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}


def kvpubd(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvpubd", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
    )


def kvpubd_all(
    *argvs: list[str], timeout: float = 30.0, env: dict[str, str] | None = None
) -> list[subprocess.CompletedProcess[str]]:
    """Run several independent commands at once (each one pays the interpreter start)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "kvpubd", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env or ENV,
        )
        for argv in argvs
    ]
    results = []
    try:
        for argv, proc in zip(argvs, procs, strict=True):
            out, err = proc.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(argv, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return results


def batches_until(daemon: Daemon, seq: int) -> list[Received]:
    """Every batch of rank 0 up to ``seq``, through replay."""
    with daemon.subscriber() as sub:
        deadline = time.monotonic() + 10.0
        seen = sub.catch_up()
        while not seen or seen[-1].seq < seq:
            assert time.monotonic() < deadline, f"batch {seq} never arrived"
            seen.extend(sub.receive(0.05))
    return seen


@pytest.fixture
def dead_endpoint() -> Iterator[str]:
    """An ipc control endpoint nobody listens on."""
    directory = tempfile.mkdtemp(prefix="kvpcli", dir="/tmp")
    yield f"ipc://{directory}/control"
    os.rmdir(directory)


HELP: dict[str, list[str]] = {
    "": ["serve", "reset", "stats", "ping", "subscribe"],
    "serve": ["--config", "--log-level", "--kv-events-config"],
    "reset": ["--control", "--rank", "--force", "--timeout"],
    "stats": ["--control", "--timeout"],
    "ping": ["--control", "--timeout"],
    "subscribe": [
        "--endpoint",
        "--replay",
        "--json",
        "--count",
        "--ranks",
        "--topic",
        "--snapshot",
    ],
}


def test_help_exits_0_and_names_options() -> None:
    """`kvpubd --help` and every `kvpubd COMMAND --help` exit 0 and list the commands / the
    command's options."""
    commands = list(HELP)
    results = kvpubd_all(*([c, "--help"] if c else ["--help"] for c in commands))
    for command, result in zip(commands, results, strict=True):
        assert result.returncode == 0, f"{command} --help: {result.stderr}"
        for word in HELP[command]:
            assert word in result.stdout, f"{word} missing from {command} --help:\n{result.stdout}"


def test_stats_prints_json_with_rank_seq(daemon: Daemon) -> None:
    """`stats` prints the daemon's counters as JSON, ranks[0].seq included."""
    with daemon.client() as client:
        client.store("s", list(range(2 * BLOCK_SIZE)))
        seq = client.snapshot().seq  # publishes the store
    result = kvpubd("stats", "--control", daemon.control_endpoint)
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)
    assert stats["epoch"] == daemon.epoch
    assert stats["ranks"][0]["seq"] == seq == stats["ranks"][0]["first_seq"] + 1
    assert stats["ranks"][0]["requests_open"] == 1


def test_ping_prints_version_and_epoch(daemon: Daemon) -> None:
    """`ping` prints one JSON line with the daemon's version and epoch."""
    result = kvpubd("ping", "--control", daemon.control_endpoint)
    assert result.returncode == 0, result.stderr
    (line,) = result.stdout.splitlines()
    reply = json.loads(line)
    assert reply["version"] == __version__
    assert reply["epoch"] == daemon.epoch


def test_ping_prints_each_rank_s_snapshot_endpoint_and_publisher_id_in_hex(
    start_daemon: DaemonFactory,
) -> None:
    daemon = start_daemon(events={"snapshot_endpoint": True})
    with daemon.client() as client:
        publisher_id = client.stats().ranks[0].publisher_id
    result = kvpubd("ping", "--control", daemon.control_endpoint)
    assert result.returncode == 0, result.stderr
    (endpoints,) = json.loads(result.stdout)["endpoints"]
    assert endpoints["publisher_id"] == publisher_id.hex() and len(publisher_id) == 16
    assert endpoints["snapshot"] == rank_endpoint(daemon.snapshot_endpoint, 0)


def test_reset_prints_marker_seq(daemon: Daemon) -> None:
    """`reset` prints "rank 0: marker seq N", and batch N on the wire is the AllBlocksCleared
    marker, after the store captured before it."""
    tokens = list(range(3 * BLOCK_SIZE))
    with daemon.client() as client:
        client.store("r", tokens)
        client.release("r")
    result = kvpubd("reset", "--control", daemon.control_endpoint)
    assert result.returncode == 0, result.stderr
    (line,) = result.stdout.splitlines()
    prefix = "rank 0: marker seq "
    assert line.startswith(prefix), line
    seq = int(line.removeprefix(prefix))
    seen = batches_until(daemon, seq)
    events = [e for b in seen if b.seq <= seq for e in b.batch.events]
    assert isinstance(events[-1], AllBlocksCleared)
    assert [e.block_hashes for e in events if isinstance(e, BlockStored)] == [chain_hashes(tokens)]
    with daemon.client() as client:
        assert client.stats().ranks[0].blocks_cached == 0


def test_reset_with_open_requests_fails_then_force_succeeds(daemon: Daemon) -> None:
    """With requests open, `reset` fails with one clear line on stderr and exit 1, changing
    nothing; `reset --force` then succeeds."""
    with daemon.client() as client:
        client.store("open", list(range(2 * BLOCK_SIZE)))
        client.snapshot()  # publish the store, so that stats stay still
        before = client.stats().ranks[0]
    result = kvpubd("reset", "--control", daemon.control_endpoint)
    assert result.returncode == 1
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "busy" in line and "force" in line, line
    with daemon.client() as client:
        assert client.stats().ranks[0] == before

    result = kvpubd("reset", "--force", "--control", daemon.control_endpoint)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("rank 0: marker seq ")
    with daemon.client() as client:
        after = client.stats().ranks[0]
    assert after.requests_open == 0 and after.blocks_cached == 0
    assert after.resets == before.resets + 1


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_subscribe_json_count(daemon: Daemon) -> None:
    """`subscribe --json --count N` prints exactly N JSON events with rank/seq/type, then
    exits 0."""
    with daemon.client() as client:
        for i in range(3):
            client.store(f"c{i}", [i + 1] * BLOCK_SIZE)
        last = client.snapshot().seq
        first_seq = client.stats().ranks[0].first_seq
    assert last >= first_seq + 1
    result = kvpubd(
        "subscribe",
        "--endpoint",
        daemon.events_endpoint,
        "--replay",
        daemon.replay_endpoint,
        "--json",
        "--count",
        "2",
    )
    assert result.returncode == 0, result.stderr
    lines = json_lines(result.stdout)
    assert len(lines) == 2
    for line in lines:
        assert line["rank"] == 0 and isinstance(line["seq"], int) and "type" in line
    assert lines[0]["seq"] == first_seq and lines[0]["type"] == "AllBlocksCleared"
    assert lines[1]["type"] == "BlockStored"


def test_subscribe_sees_live_stores(daemon: Daemon) -> None:
    """While stores happen, `subscribe --json` prints BlockStored lines whose block_hashes are
    exactly the blocks the daemon's snapshot reports (and the hash chain predicts)."""
    prompts = [[7] * (2 * BLOCK_SIZE), [7] * (3 * BLOCK_SIZE + 5), [9] * BLOCK_SIZE]
    # Events: the start marker, then one BlockStored per prompt (the second extends the first).
    count = 1 + len(prompts)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvpubd",
            "subscribe",
            "--endpoint",
            daemon.events_endpoint,
            "--replay",
            daemon.replay_endpoint,
            "--json",
            "--count",
            str(count),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())  # the subscriber is up and caught up
        with daemon.client() as client:
            first_seq = client.stats().ranks[0].first_seq
            assert first == {"rank": 0, "seq": first_seq, "type": "AllBlocksCleared"}
            for i, tokens in enumerate(prompts):
                client.store(f"live-{i}", tokens)
            snapshot = client.snapshot()
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    lines = json_lines(out)
    assert len(lines) == count - 1
    assert all(line["type"] == "BlockStored" and line["rank"] == 0 for line in lines)
    printed = [h for line in lines for h in line["block_hashes"]]
    snapshot_hashes = [e.block_hashes[0] for e in snapshot.events if isinstance(e, BlockStored)]
    assert sorted(printed) == sorted(snapshot_hashes)
    chain = chain_hashes(prompts[1]) + chain_hashes(prompts[2])
    assert sorted(printed) == sorted(chain)
    # The second prompt's run extends the first prompt's blocks.
    assert lines[1]["parent_block_hash"] == chain_hashes(prompts[0])[-1]
    assert lines[1]["block_hashes"] == chain_hashes(prompts[1])[2:]


def test_subscribe_bootstraps_from_the_snapshot_endpoint(start_daemon: DaemonFactory) -> None:
    """`subscribe --snapshot` bootstraps each rank from its snapshot (said on stderr), so what
    was stored before it started is not printed, and then prints what is stored live."""
    daemon = start_daemon(events={"snapshot_endpoint": True})
    with daemon.client() as client:
        client.store("before", [5] * (2 * BLOCK_SIZE))
    proc = subprocess.Popen(
        [
            *[sys.executable, "-m", "kvpubd", "subscribe", "--json", "--count", "1"],
            *["--endpoint", daemon.events_endpoint, "--snapshot", daemon.snapshot_endpoint],
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        assert proc.stderr is not None
        note = proc.stderr.readline()
        assert note.startswith("# rank 0: bootstrapped from its snapshot at seq "), note
        live = [6] * BLOCK_SIZE
        with daemon.client() as client:
            client.store("live", live)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    (line,) = json_lines(out)
    assert (line["type"], line["block_hashes"]) == ("BlockStored", chain_hashes(live))


def test_subscribe_refuses_snapshot_with_control(daemon: Daemon) -> None:
    result = kvpubd(
        "subscribe", "--snapshot", "tcp://127.0.0.1:5559", "--control", daemon.control_endpoint
    )
    assert result.returncode == 2 and "--snapshot replaces --control" in result.stderr


def test_cli_without_daemon_fails_clearly(dead_endpoint: str) -> None:
    """Against a daemon that is not running, stats/ping/reset print one clear line mentioning
    the daemon and exit 1, without a traceback."""
    commands = ["stats", "ping", "reset"]
    results = kvpubd_all(*([c, "--control", dead_endpoint, "--timeout", "0.3"] for c in commands))
    for command, result in zip(commands, results, strict=True):
        assert result.returncode == 1, command
        assert "Traceback" not in result.stderr, result.stderr
        assert result.stdout == "", command
        (line,) = result.stderr.strip().splitlines()
        assert "daemon" in line, line


def test_version() -> None:
    """`kvpubd --version` prints the package version."""
    result = kvpubd("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == __version__


@pytest.fixture
def bytes_daemon() -> Iterator[Daemon]:
    daemon = Daemon({"events": {"hash_format": "bytes"}})
    try:
        yield daemon.start()
    finally:
        daemon.cleanup()


def test_subscribe_json_bytes_hashes(bytes_daemon: Daemon) -> None:
    """With hash_format "bytes", `subscribe --json` prints hashes as hex strings."""
    tokens = [3] * (2 * BLOCK_SIZE)
    with bytes_daemon.client() as client:
        client.store("b", tokens)
        client.snapshot()
    result = kvpubd(
        "subscribe",
        "--endpoint",
        bytes_daemon.events_endpoint,
        "--replay",
        bytes_daemon.replay_endpoint,
        "--json",
        "--count",
        "2",
    )
    assert result.returncode == 0, result.stderr
    stored = json_lines(result.stdout)[1]
    digests = chain_hashes(tokens, hash_format="bytes")
    assert stored["block_hashes"] == [cast(bytes, d).hex() for d in digests]
    assert stored["parent_block_hash"] is None
