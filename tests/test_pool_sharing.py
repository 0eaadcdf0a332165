"""Another process maps the daemon's block pool (shared memory on CPU, CUDA IPC on GPU), writes
KV data into the blocks it was handed, and the daemon's checksums agree; scrubs zero freed
blocks; nothing is left behind in /dev/shm."""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpubd.client import ControlError, map_pool
from kvpubd.daemon.kernels import gpu_available, numpy_checksum
from kvpubd.daemon.pool import pool_segment_name
from tests.conftest import DaemonFactory
from tests.daemon import Daemon, wait_for
from tests.streams import prompt

DEVICES = [
    "cpu",
    pytest.param(
        "cuda:0",
        marks=[
            pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a GPU"),
            # CUDA opens no IPC handle in the process that made it: the daemon is another one.
            pytest.mark.daemon_process,
        ],
    ),
]
# block_bytes = 2 * 1 * 1 * 12 * 16 * 2 = 768: not a power of two, a multiple of 16.
GEOMETRY = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 12, "dtype": "float16"}


def host_copy(array: Any) -> np.ndarray:
    return array.get() if hasattr(array, "get") else np.array(array)


def write_pattern(array: Any, block_ids: list[int], seed: int) -> np.ndarray:
    """Write random bytes into ``block_ids`` of the mapped pool; return what was written."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(len(block_ids), array.shape[1]), dtype=np.uint8)
    if hasattr(array, "get"):  # CuPy
        import cupy

        array[cupy.asarray(block_ids)] = cupy.asarray(data)
        cupy.cuda.runtime.deviceSynchronize()
    else:
        array[block_ids] = data
    return data


@pytest.mark.parametrize("device", DEVICES)
def test_mapped_writes_match_daemon_checksums(start_daemon: DaemonFactory, device: str) -> None:
    daemon = start_daemon(cache={"device": device, "num_blocks": 64, **GEOMETRY})
    with daemon.client() as client:
        info = client.pool_info()
        assert info.shape == (64, 768) and info.block_bytes == 768
        assert info.kind == ("shm" if device == "cpu" else "cuda_ipc")
        reply = client.store("req", prompt(1, 5, tail=3))
        block_ids = reply.block_ids
        assert len(block_ids) == 6
        with map_pool(client) as pool:
            written = write_pattern(pool.array, block_ids, seed=7)
            expected = numpy_checksum(written, list(range(len(block_ids)))).tolist()
            assert client.checksum(block_ids).checksums == expected
            # Blocks nobody wrote still read as zeros, and their checksums say so.
            untouched = [b for b in range(64) if b not in block_ids][:4]
            zeros = numpy_checksum(np.zeros((1, 768), np.uint8), [0] * len(untouched)).tolist()
            assert client.checksum(untouched).checksums == zeros
            # What the daemon sees is what the mapping sees.
            assert np.array_equal(host_copy(pool.array)[block_ids], written)


@pytest.mark.parametrize("device", DEVICES)
def test_reset_scrubs_freed_blocks(start_daemon: DaemonFactory, device: str) -> None:
    daemon = start_daemon(cache={"device": device, "num_blocks": 64, **GEOMETRY})
    with daemon.client() as client, map_pool(client) as pool:
        block_ids = client.store("req", prompt(2, 4)).block_ids
        write_pattern(pool.array, block_ids, seed=3)
        assert host_copy(pool.array)[block_ids].any()
        client.release("req")
        client.reset()
        zeros = numpy_checksum(np.zeros((1, 768), np.uint8), [0] * len(block_ids)).tolist()
        assert client.checksum(block_ids).checksums == zeros
        assert not host_copy(pool.array)[block_ids].any()


@pytest.mark.parametrize("device", DEVICES)
def test_evicted_blocks_are_scrubbed_before_reuse(start_daemon: DaemonFactory, device: str) -> None:
    """With a full pool, a store evicts old blocks and is handed them back zeroed."""
    daemon = start_daemon(cache={"device": device, "num_blocks": 8, **GEOMETRY})
    with daemon.client() as client, map_pool(client) as pool:
        first = client.store("a", prompt(3, 8)).block_ids
        write_pattern(pool.array, first, seed=5)
        client.release("a")
        second = client.store("b", prompt(4, 8)).block_ids
        assert sorted(second) == sorted(first)  # every block was evicted and reused
        assert not host_copy(pool.array)[second].any()


def test_checksum_refuses_bad_block_ids(daemon: Any) -> None:
    with daemon.client() as client:
        for bad in ([256], [-1], ["x"], [1.5]):
            with pytest.raises(ControlError) as caught:
                client.checksum(bad)
            assert caught.value.code == "bad_request"
        assert client.checksum([]).checksums == []


def shm_path(name: str | None) -> Path:
    assert name is not None, "the pool is not in shared memory"
    return Path("/dev/shm") / name.lstrip("/")


@pytest.mark.daemon_process
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_segment_is_owner_only_and_removed_on_stop(start_daemon: DaemonFactory, sig: int) -> None:
    daemon = start_daemon()
    with daemon.client() as client:
        path = shm_path(client.pool_info().name)
    mode = stat.S_IMODE(path.stat().st_mode)
    assert mode == 0o600, oct(mode)
    assert path.stat().st_uid == os.getuid()
    assert daemon.stop(sig) == 0
    assert not path.exists()


@pytest.mark.daemon_process
def test_segment_is_removed_after_kill(start_daemon: DaemonFactory) -> None:
    """Even SIGKILL leaves no segment: the resource tracker unlinks what the daemon held."""
    daemon = start_daemon()
    with daemon.client() as client:
        path = shm_path(client.pool_info().name)
    assert path.exists()
    daemon.stop(signal.SIGKILL)
    wait_for(lambda: not path.exists(), timeout=20, what="the segment to be unlinked")


@pytest.mark.process
def test_mapping_client_exit_does_not_unlink_the_segment(daemon: Any) -> None:
    """A client that maps and unmaps the pool leaves the daemon's segment in place."""
    import subprocess
    import sys

    script = (
        "from kvpubd.client import ControlClient, map_pool\n"
        f"c = ControlClient({daemon.control_endpoint!r})\n"
        "with map_pool(c) as pool: pool.array[0, 0] = 7\n"
        "c.close()\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    with daemon.client() as client:
        info = client.pool_info()
        assert shm_path(info.name).exists()
        written = np.zeros((1, info.block_bytes), np.uint8)
        written[0, 0] = 7
        assert client.checksum([0]).checksums == numpy_checksum(written, [0]).tolist()


def children_of(pid: int) -> list[int]:
    found = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat_file.parent.name))
    return found


@pytest.mark.daemon_process
def test_restart_replaces_a_segment_left_by_a_killed_process_group(
    start_daemon: DaemonFactory,
) -> None:
    """When the daemon and its resource tracker die together (a watchdog kill of the whole
    group), the segment stays behind; the next start on the same endpoint replaces it."""
    daemon = start_daemon()
    with daemon.client() as client:
        path = shm_path(client.pool_info().name)
        client.store("a", prompt(6, 2))
    assert daemon.proc is not None
    for child in children_of(daemon.proc.pid):  # the resource tracker
        os.kill(child, signal.SIGKILL)
    daemon.stop(signal.SIGKILL)
    assert path.exists()
    daemon.start()
    with daemon.client() as client:
        assert shm_path(client.pool_info().name) == path
        assert client.stats().ranks[0].blocks_used == 0
    assert "removed stale shared memory segment" in daemon.log()
    assert daemon.stop() == 0
    assert not path.exists()


@pytest.mark.process
def test_an_empty_stale_segment_of_ours_is_replaced() -> None:
    """A segment of ours left empty (a run killed while creating it) under the pool's name:
    the start replaces it (mapping it would fail) and the pool keeps its name."""
    daemon = Daemon()
    try:
        name = pool_segment_name(daemon.control_endpoint, 0)
        shm_path(name).touch()
        daemon.start()
        with daemon.client() as client:
            assert client.pool_info().name == name
        assert shm_path(name).stat().st_size > 0
        assert "removed stale shared memory segment" in daemon.log()
        assert daemon.stop() == 0
        assert not shm_path(name).exists()
    finally:
        daemon.cleanup()
        shm_path(pool_segment_name(daemon.control_endpoint, 0)).unlink(missing_ok=True)


@pytest.mark.process
@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_another_users_segment_under_the_pools_name_does_not_stop_the_start() -> None:
    """Segment names are predictable and /dev/shm is shared: another user who takes the name
    first gets nothing from it. The daemon leaves that segment alone, says so, and puts its
    pool under a fresh name, which pool_info reports."""
    daemon = Daemon()
    name = pool_segment_name(daemon.control_endpoint, 0)
    squatted = shm_path(name)
    try:
        squatted.write_bytes(b"theirs")
        os.chown(squatted, 65534, 65534)
        daemon.start()
        with daemon.client() as client:
            fresh = client.pool_info().name
            assert fresh != name and shm_path(fresh).exists()
            client.store("a", prompt(4, 1))
        assert f"shared memory segment {name} belongs to uid 65534" in daemon.log()
        assert squatted.read_bytes() == b"theirs" and squatted.stat().st_uid == 65534
        assert daemon.stop() == 0
        assert not shm_path(fresh).exists()
    finally:
        daemon.cleanup()
        squatted.unlink(missing_ok=True)
