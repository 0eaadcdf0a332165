"""The asyncio control client talks to the real daemon like the sync one."""

import pytest

from kvpubd.client import AsyncControlClient, ControlError, ControlTimeout
from tests.daemon import Daemon
from tests.streams import prompt, seq_of


async def test_async_client_round_trip(daemon: Daemon) -> None:
    async with AsyncControlClient(daemon.control_endpoint) as client:
        assert (await client.ping()).epoch == daemon.epoch
        stored = await client.store("a", prompt(1, 2, tail=1))
        assert len(stored.block_ids) == 3
        with pytest.raises(ControlError) as caught:
            await client.reset()
        assert caught.value.code == "busy"
        await client.release("a")
        (marker,) = (await client.reset()).markers
        assert marker.rank == 0 and seq_of(marker) >= 1
        assert (await client.snapshot()).events == []


async def test_async_client_times_out_without_a_daemon(tmp_path: object) -> None:
    client = AsyncControlClient(f"ipc://{tmp_path}/nobody", timeout=0.2)
    try:
        with pytest.raises(ControlTimeout):
            await client.ping()
    finally:
        client.close()
