"""Which device each rank's pool lives on: ``cache.device`` ("cpu", "cuda:N", or "cuda": rank
r on GPU r where there is one per rank, else all on GPU 0) and ``cache.rank_devices`` (one
per rank). On a GPU host, a service of rank processes puts each rank's pool where the config
says, as pool_info tells a client that maps it."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from kvpubd.daemon.kernels import gpu_available
from kvpubd.daemon.pool import cuda_device_count
from kvpubd.daemon.settings import CacheConfig
from tests.daemon import Daemon


def config(**fields: Any) -> CacheConfig:
    return CacheConfig(**fields)


def test_cuda_puts_rank_r_on_gpu_r_where_there_is_one_per_rank() -> None:
    cache = config(device="cuda", data_parallel_size=4)
    assert [cache.device_of(r, 8) for r in cache.ranks] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert [cache.device_of(r, 3) for r in cache.ranks] == ["cuda:0"] * 4
    # An engine rank's own daemon (start rank 5) uses that rank's GPU.
    one = config(device="cuda", data_parallel_start_rank=5)
    assert one.device_of(5, 8) == "cuda:5" and one.device_of(5, 4) == "cuda:0"


def test_a_fixed_device_and_the_host_serve_every_rank() -> None:
    assert config(device="cuda:2", data_parallel_size=2).device_of(1, 8) == "cuda:2"
    host = config(data_parallel_size=2)
    assert host.device_of(1, 8) == "cpu" and host.on_host
    assert not config(device="cuda").on_host


def test_rank_devices_name_each_ranks_own() -> None:
    cache = config(
        data_parallel_size=2, data_parallel_start_rank=2, rank_devices=["cuda:1", "cuda:0"]
    )
    assert [cache.device_of(r, 0) for r in cache.ranks] == ["cuda:1", "cuda:0"]
    assert not cache.on_host


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"data_parallel_size": 2, "rank_devices": ["cuda:0"]}, "1 device(s) for 2 rank(s)"),
        ({"rank_devices": ["gpu0"]}, "'gpu0' is not a device"),
        ({"data_parallel_size": 2, "rank_devices": ["cpu", "cuda:0"]}, "not both"),
        ({"device": "cuda:x"}, "is not a device"),
    ],
)
def test_devices_that_cannot_be_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as refused:
        config(**fields)
    assert message in str(refused.value)


@pytest.mark.daemon_process
@pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a GPU")
@pytest.mark.parametrize("layout", ["cuda", "rank_devices"])
def test_each_rank_worker_puts_its_pool_on_its_device(layout: str) -> None:
    ranks = 2
    count = cuda_device_count()
    devices = (
        {"device": "cuda"}
        if layout == "cuda"
        else {"rank_devices": [f"cuda:{(ranks - 1 - r) % count}" for r in range(ranks)]}
    )
    expected = (
        [r if count >= ranks else 0 for r in range(ranks)]
        if layout == "cuda"
        else [(ranks - 1 - r) % count for r in range(ranks)]
    )
    daemon = Daemon(
        {
            "cache": {"data_parallel_size": ranks, **devices},
            "service": {"rank_processes": "on"},
        }
    ).start(timeout=120)
    try:
        with daemon.client() as client:
            infos = [client.pool_info(rank=r) for r in range(ranks)]
            assert [info.kind for info in infos] == ["cuda_ipc"] * ranks
            assert [info.device for info in infos] == expected
            stored = client.store("gpu", list(range(64)), rank=1)
            assert len(stored.block_ids) == 4
            client.release("gpu")
            assert client.reset().markers[1].rank == 1
    finally:
        if daemon.alive():
            daemon.stop()
        daemon.cleanup()
