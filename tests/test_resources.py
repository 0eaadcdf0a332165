"""Resources strangers can use up: file descriptors (a flood of idle TCP connections) and
shared memory (a pool larger than /dev/shm). Real daemons, real limits."""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from kvpubd.daemon.pool import (
    INDEX_BYTES_PER_BLOCK,
    PoolDoesNotFit,
    check_shm_space,
    pool_segment_name,
    reserve_pages,
)
from kvpubd.daemon.settings import CacheConfig
from kvpubd.protocol.wire import AllBlocksCleared, decode_batch
from kvpubd.tools.launcher import free_tcp_ports
from tests.daemon import Daemon, wait_for, write_config
from tests.loop_turns import started_service, turns_until
from tests.streams import prompt
from tests.test_metrics import samples, scrape, value

DAEMON_FDS = 256  # the daemon's soft and hard limit: a raise cannot lift it
FLOOD = 2000


@pytest.fixture
def many_fds() -> Iterator[None]:
    """This test process holds FLOOD sockets at once: raise its own soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < FLOOD + 500:
        pytest.skip(f"hard fd limit {hard} is below the {FLOOD + 500} this test needs")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# A process that opens argv[2] connections to the Unix socket argv[1] (none greets; those
# refused fail at once) and holds them until killed.
_CONNECTER = """
import socket, sys
held = []
for _ in range(int(sys.argv[2])):
    conn = socket.socket(socket.AF_UNIX)
    conn.setblocking(False)
    conn.connect_ex(sys.argv[1])
    held.append(conn)
print("connected", flush=True)
sys.stdin.read()
"""


def connecting_process(path: str, count: int) -> subprocess.Popen[bytes]:
    """Another process (one peer) holding ``count`` connections to ``path``; kill it."""
    process = subprocess.Popen(
        [sys.executable, "-c", _CONNECTER, path, str(count)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert process.stdout is not None and process.stdout.readline() == b"connected\n"
    return process


def low_fd_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (DAEMON_FDS, DAEMON_FDS))


def start_capped(daemon: Daemon) -> tuple[Path, int, int]:
    """Start ``daemon`` limited to DAEMON_FDS fds; (its fd directory, its connection cap per
    listener, the fds it has open once started)."""
    daemon.start(preexec_fn=low_fd_limit)
    assert daemon.proc is not None
    # A limit this low is warned of: an ipc burst may outrun the reserve (libzmq aborts).
    assert f"the limit is {DAEMON_FDS}; below 1024" in daemon.log()
    fds = Path(f"/proc/{daemon.proc.pid}/fd")
    cap = int(re.search(r"at most (\d+) per listener", daemon.log()).group(1))  # type: ignore[union-attr]
    return fds, cap, len(os.listdir(fds))


def stop_alive(daemon: Daemon) -> None:
    """Stop a daemon that must have lived through the test (exit 0); fail if it died."""
    try:
        if daemon.alive():
            assert daemon.stop() == 0, daemon.log()
        else:
            pytest.fail(f"the daemon died:\n{daemon.log()[-3000:]}")
    finally:
        daemon.cleanup()


@pytest.mark.process
def test_idle_connection_flood_neither_stops_the_daemon_nor_holds_back_a_reset(
    many_fds: None,
) -> None:
    """2000 idle TCP connections over the PUB, replay and metrics ports of a daemon limited to
    256 fds. Before the caps, the next ipc control connection made libzmq abort ('Too many open
    files'). Now the daemon answers a reset from a new control client, and a subscriber that
    connected before the flood receives its marker."""
    events, replay, metrics = free_tcp_ports(3)
    daemon = Daemon(
        {
            "events": {
                "endpoint": f"tcp://127.0.0.1:{events}",
                "replay_endpoint": f"tcp://127.0.0.1:{replay}",
            },
            "metrics": {"port": metrics},
        }
    )
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.subscribe(b"")
    flood: list[socket.socket] = []
    try:
        daemon.start(preexec_fn=low_fd_limit)
        sub.connect(f"tcp://127.0.0.1:{events}")
        with daemon.client() as client:
            attempts = itertools.count(1)

            def live() -> bool:
                # A new prompt each time: a cached one publishes nothing.
                client.store("probe", prompt(next(attempts), 1))
                client.release("probe")
                return bool(sub.poll(100))

            wait_for(live, what="the subscriber to receive")
        while sub.poll(100):
            sub.recv_multipart()

        for i in range(FLOOD):
            conn = socket.socket()
            conn.setblocking(False)  # the kernel completes what it admits; no waiting here
            # From 16 loopback addresses: 16 peers, so that together they reach the caps
            # (one peer holds at most a quarter of a listener's).
            conn.bind((f"127.0.0.{2 + i % 16}", 0))
            conn.connect_ex(("127.0.0.1", (events, replay, metrics)[i % 3]))
            flood.append(conn)
        # The caps took effect (each listener logs when it stops admitting).
        wait_for(lambda: "the cap; refusing new ones" in daemon.log(), what="a connection cap")
        assert daemon.alive(), daemon.log()

        with daemon.client() as client:  # a new ipc connection, while the flood holds
            marker = client.reset(force=True).markers[0].seq
        assert sub.poll(10_000), "no marker reached the subscriber"
        _topic, seq, payload = sub.recv_multipart()
        assert int.from_bytes(seq, "big") == marker
        assert decode_batch(payload).events == [AllBlocksCleared()]
        assert daemon.alive()
    finally:
        for conn in flood:
            conn.close()
        sub.close()
        context.term()
        stop_alive(daemon)


async def test_a_daemon_stopped_in_the_turn_it_started_leaves_no_cap_callback(
    tmp_path: Path,
) -> None:
    """Each connection cap drains its monitor once on the next loop turn: a daemon stopped
    before that turn (as a test can) cancels it, or it raised on the closed monitor."""
    loop = asyncio.get_running_loop()
    failures: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, context: failures.append(context))
    async with started_service(tmp_path, events={"replay_endpoint": f"ipc://{tmp_path}/rp"}):
        pass  # no loop turn between start-up and shutdown
    turns = 0

    def counted() -> bool:
        nonlocal turns
        turns += 1
        return turns > 10

    await turns_until(counted)
    assert failures == []


@pytest.mark.process
def test_ipc_connection_flood_is_held_to_the_cap_and_the_daemon_lives(many_fds: None) -> None:
    """Connections to the ipc control socket of a daemon limited to 256 fds, none of them ever
    greeting (a client leaking connections, or a hostile one of the same user). libzmq
    accepted every one until an accept found no fd and aborted the daemon ('Too many open
    files'). Now, wave after wave, the daemon holds no more than its cap: the ones past it are
    hung up, and at the cap the socket file is renamed aside so that new ones fail at once.
    Once the flood is gone the listener takes connections again and answers a reset."""
    daemon = Daemon()
    flood: list[subprocess.Popen[bytes]] = []
    try:
        fds, cap, baseline = start_capped(daemon)
        path = daemon.control_endpoint.removeprefix("ipc://")
        wave = 2 * cap  # past the cap, well within the fds the daemon keeps in reserve
        for _ in range(FLOOD // wave):
            # From 8 processes: 8 peers, so that together they reach the cap (one process
            # holds at most a quarter of it).
            for _ in range(8):
                flood.append(connecting_process(path, wave // 8))
            wait_for(
                lambda: len(os.listdir(fds)) <= baseline + cap,
                what=f"the daemon to hold at most {cap} flood connections",
            )
        assert "the cap; refusing new ones" in daemon.log()
        assert daemon.alive(), daemon.log()[-3000:]
        for process in flood:
            process.kill()
            process.wait()
        wait_for(lambda: "accepting again" in daemon.log(), what="the cap to lift")
        with daemon.client() as client:
            client.reset(force=True)
        assert daemon.alive()
    finally:
        for process in flood:
            process.kill()
            process.wait()
        stop_alive(daemon)


@pytest.mark.process
def test_one_process_holding_connections_leaves_the_control_socket_to_others(
    many_fds: None,
) -> None:
    """This process opens as many connections to the control socket as the cap (a client
    leaking them, or one locking others out). They once filled the cap alone: the listener
    closed, and a reset from any other process failed until they went. Now one process holds
    a quarter of the cap, the rest are hung up, and another process's reset is answered
    while they are held."""
    daemon = Daemon()
    flood: list[socket.socket] = []
    try:
        fds, cap, baseline = start_capped(daemon)
        path = daemon.control_endpoint.removeprefix("ipc://")
        for _ in range(cap):
            conn = socket.socket(socket.AF_UNIX)
            conn.setblocking(False)
            conn.connect_ex(path)
            flood.append(conn)
        # Until it has taken its share and hung up on the rest (not a count of its fds over
        # the one at start: a client connection of the start's own ping, closed meanwhile,
        # left it short of that count in CI).
        wait_for(
            lambda: "its share; hung up" in daemon.log(),
            what="the daemon to accept the flood",
        )
        assert len(os.listdir(fds)) >= baseline - 2 + cap // 4  # the share is held
        # Within the handshake timeout (10 s), after which the daemon drops them all anyway.
        reset = subprocess.run(
            [sys.executable, "-m", "kvpubd", "reset", "--force", "--timeout", "6"],
            env={**os.environ, "KVPUBD_CONTROL__ENDPOINT": daemon.control_endpoint},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert reset.returncode == 0, reset.stderr
        assert "its share; hung up" in daemon.log()
        assert daemon.alive()
    finally:
        for conn in flood:
            conn.close()
        stop_alive(daemon)


@pytest.mark.process
def test_one_host_holding_metrics_connections_leaves_healthz_to_others(many_fds: None) -> None:
    """One host (127.0.0.2) opens more idle connections to the metrics port than its cap.
    They once filled it alone, and /healthz, a liveness probe, failed for everyone else
    until they timed out. Now one host holds a quarter of the cap, and /healthz from
    another is answered."""
    port = free_tcp_ports(1)[0]
    daemon = Daemon({"metrics": {"port": port}})
    flood: list[socket.socket] = []
    try:
        _, cap, _ = start_capped(daemon)
        url = f"http://127.0.0.1:{port}"
        for _ in range(cap + 1):
            flood.append(
                socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.2", 0))
            )

        def refused() -> float:  # scraped from 127.0.0.1: another host
            return value(
                samples(scrape(f"{url}/metrics")[1]), "kvpubd_metrics_connections_refused_total"
            )

        # All but a quarter of the cap refused (without the share: the cap full, and the scrape
        # itself refused).
        wait_for(lambda: refused() == cap + 1 - cap // 4, what="the flood's refusals")
        # Within the request timeout (5 s), after which the daemon drops them anyway.
        with urllib.request.urlopen(f"{url}/healthz", timeout=4) as health:
            assert health.status == 200
        assert daemon.alive()
    finally:
        for conn in flood:
            conn.close()
        stop_alive(daemon)


def serve(config: Path, prefix: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*(prefix or []), sys.executable, "-m", "kvpubd", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def one_error_line(stderr: str) -> str:
    """The daemon's start-up log may precede it; the error is one line, the last, and no
    traceback."""
    assert "Traceback" not in stderr and "Bus error" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("kvpubd: ")]
    assert len(errors) == 1 and stderr.strip().endswith(errors[0]), stderr
    return errors[0]


# Blocks of 4 MiB: more than /dev/shm holds takes few of them.
LARGE_BLOCKS = {"num_layers": 64, "num_kv_heads": 8, "head_dim": 128}


def serve_too_large(tmp_path: Path, cache: dict[str, int]) -> subprocess.CompletedProcess[str]:
    """``serve`` with ``cache`` (blocks of LARGE_BLOCKS) on private ipc endpoints."""
    config = tmp_path / "kvpubd.toml"
    write_config(
        config,
        {
            "control": {"endpoint": f"ipc://{tmp_path}/control"},
            "events": {
                "endpoint": f"ipc://{tmp_path}/ev",
                "replay_endpoint": f"ipc://{tmp_path}/replay",
            },
            "cache": {**cache, **LARGE_BLOCKS},
        },
    )
    return serve(config)


def blocks_past_dev_shm() -> int:
    """Blocks of LARGE_BLOCKS that do not fit in what /dev/shm has free."""
    stats = os.statvfs("/dev/shm")
    return stats.f_bavail * stats.f_frsize // CacheConfig(**LARGE_BLOCKS).block_bytes + 64


@pytest.mark.process
def test_pool_larger_than_dev_shm_exits_2_naming_the_sizes(tmp_path: Path) -> None:
    """Before: the daemon logged `ready` and died of SIGBUS under load. Now: exit 2, one line."""
    result = serve_too_large(tmp_path, {"num_blocks": blocks_past_dev_shm()})
    assert result.returncode == 2, result.stderr
    error = one_error_line(result.stderr)
    assert error.startswith("kvpubd: cannot start: pool (") and "MiB free" in error
    assert "does not fit in /dev/shm" in error
    # The rank's sockets were bound before its pool was refused: their files are gone too
    # (left behind, they looked like a running daemon to clients).
    sockets = [p.name for p in tmp_path.iterdir() if p.is_socket()]
    assert sockets == [], sockets


@pytest.mark.process
def test_host_tier_larger_than_dev_shm_exits_2_naming_it(tmp_path: Path) -> None:
    """The host tier is shared memory whatever the pool's device: refused like a pool."""
    result = serve_too_large(tmp_path, {"num_blocks": 16, "host_blocks": blocks_past_dev_shm()})
    assert result.returncode == 2, result.stderr
    error = one_error_line(result.stderr)
    assert "does not fit in /dev/shm" in error and "host tier(s) of" in error, error


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs (mounting needs root)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)])
    if done.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.process
def test_pages_are_reserved_or_refused_on_a_small_tmpfs(small_tmpfs: Path) -> None:
    """The start-up check and the reservation against a real 4 MiB tmpfs: what fits is
    allocated at once (no page left to fail on first touch), what does not is refused."""
    check_shm_space(3 << 20, "pool", small_tmpfs)
    with pytest.raises(PoolDoesNotFit, match=r"pool does not fit in .*: 4\.0 MiB free of 4\.0"):
        check_shm_space(5 << 20, "pool", small_tmpfs)
    fd = os.open(small_tmpfs / "segment", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        reserve_pages(fd, 3 << 20, "pool", small_tmpfs)
        assert os.fstat(fd).st_blocks * 512 >= 3 << 20  # allocated, not a sparse promise
        other = os.open(small_tmpfs / "other", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            # The check passed for 2 MiB a moment ago; now only 1 MiB is left.
            with pytest.raises(PoolDoesNotFit, match="No space left on device"):
                reserve_pages(other, 2 << 20, "pool", small_tmpfs)
        finally:
            os.close(other)
    finally:
        os.close(fd)


@pytest.mark.process
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_daemon_in_a_small_dev_shm_exits_2(tmp_path: Path) -> None:
    """A real daemon whose /dev/shm is a 64 MiB tmpfs (Docker's default), with a 256 MiB pool
    (4096 blocks at the default geometry): exit 2, one line, nothing left in that /dev/shm."""
    config = tmp_path / "kvpubd.toml"
    write_config(
        config,
        {
            "control": {"endpoint": f"ipc://{tmp_path}/control"},
            "events": {"endpoint": f"ipc://{tmp_path}/ev", "replay_endpoint": ""},
            "cache": {"num_blocks": 4096, "num_layers": 32},
        },
    )
    script = (
        'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"; echo "mount failed" >&2; exit 99'
    )
    result = serve(config, ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh"])
    if result.returncode == 99 or "unshare failed" in result.stderr:
        pytest.skip(f"cannot mount a private /dev/shm here: {result.stderr.strip()}")
    assert result.returncode == 2, result.stderr
    error = one_error_line(result.stderr)
    assert "does not fit in /dev/shm" in error and "64.0 MiB free of 64.0 MiB" in error


@pytest.mark.daemon_process
def test_a_dead_runs_segment_does_not_count_against_the_new_pool(tmp_path: Path) -> None:
    """A run killed with its resource tracker leaves its pool segment in a 64 MiB /dev/shm;
    the next start on the same config replaces it. The space check once ran before the
    replacement, counted the dead segment as used, and refused every later start (exit 2)."""
    control = f"ipc://{tmp_path}/control"
    config = tmp_path / "kvpubd.toml"
    block_bytes = CacheConfig().block_bytes
    blocks = (40 << 20) // block_bytes  # 40 MiB: it fits only once the dead 40 MiB are gone
    write_config(
        config,
        {
            "control": {"endpoint": control},
            "events": {"endpoint": f"ipc://{tmp_path}/ev", "replay_endpoint": ""},
            "cache": {"num_blocks": blocks},
        },
    )
    stale = f"/dev/shm/{pool_segment_name(control, 0)}"
    script = (
        "mount -t tmpfs -o size=64m tmpfs /dev/shm || exit 99; "
        f'head -c {40 << 20} /dev/zero > {stale} && exec timeout -s TERM 3 "$@"'
    )
    result = serve(config, ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh"])
    if result.returncode == 99 or "unshare failed" in result.stderr:
        pytest.skip(f"cannot mount a private /dev/shm here: {result.stderr.strip()}")
    assert "removed stale shared memory segment" in result.stderr, result.stderr
    assert "ready:" in result.stderr and "stopped" in result.stderr, result.stderr


@pytest.mark.process
def test_an_fd_limit_too_low_to_serve_is_refused_at_start(tmp_path: Path) -> None:
    """At 64 fds the reserve left the listeners nothing: the daemon started, and a hundred
    local subscribers later libzmq aborted it. Now it does not start: one line, exit 1,
    nothing left behind."""
    config = tmp_path / "kvpubd.toml"
    write_config(
        config,
        {
            "control": {"endpoint": f"ipc://{tmp_path}/control"},
            "events": {"endpoint": f"ipc://{tmp_path}/ev", "replay_endpoint": ""},
        },
    )
    result = serve(config, ["prlimit", "--nofile=64:64"])
    assert result.returncode == 1, result.stderr
    error = one_error_line(result.stderr)
    assert "file descriptor limit is 64" in error and "at least 128" in error, error
    assert [p.name for p in tmp_path.iterdir() if p.is_socket()] == []


@pytest.mark.process
def test_a_cache_larger_than_memory_is_refused_before_it_is_allocated(tmp_path: Path) -> None:
    """Blocks whose index would need twice the memory available: exit 2 naming the sizes,
    before anything is allocated (the index's lists were a MemoryError traceback, or with
    overcommit the OOM killer under load)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    available = (int(fields["MemAvailable"].split()[0]) + int(fields["SwapFree"].split()[0])) << 10
    blocks = 2 * available // INDEX_BYTES_PER_BLOCK
    geometry = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "dtype": "uint8"}
    pool = blocks * CacheConfig(**geometry).block_bytes
    stats = os.statvfs("/dev/shm")
    if blocks >= 1 << 31 or pool > stats.f_bavail * stats.f_frsize:
        pytest.skip("the pool of such a cache would not fit in cache.num_blocks or /dev/shm")
    config = tmp_path / "kvpubd.toml"
    write_config(
        config,
        {
            "control": {"endpoint": f"ipc://{tmp_path}/control"},
            "events": {"endpoint": f"ipc://{tmp_path}/ev", "replay_endpoint": ""},
            "cache": {"num_blocks": blocks, **geometry},
        },
    )
    result = serve(config)
    assert result.returncode == 2, result.stderr
    error = one_error_line(result.stderr)
    assert f"of {blocks} blocks) needs about" in error and "is available" in error, error
