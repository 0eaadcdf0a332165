"""``store`` takes token ids as packed little-endian uint32 bytes too (the fast form)."""

import numpy as np
import pytest

from kvpubd.client import ControlError
from kvpubd.protocol.wire import BlockStored
from tests.conftest import DaemonFactory
from tests.daemon import Daemon
from tests.streams import prompt


def test_bytes_tokens_equal_list_tokens(daemon: Daemon) -> None:
    tokens = prompt(5, 4, tail=3)
    with daemon.client() as client:
        as_list = client.store("list", tokens)
        client.release("list")
        as_array = client.store("array", np.asarray(tokens, dtype=np.int64))
        # The same prompt: every full block matched, and the same blocks handed out.
        assert as_array.num_cached_tokens == 4 * 16
        assert as_array.block_ids[:4] == as_list.block_ids[:4]
        client.release("array")
        snapshot = client.snapshot()
        stored = [e for e in snapshot.events if isinstance(e, BlockStored)]
        assert sum(len(e.token_ids) for e in stored) == 4 * 16


def test_bytes_tokens_with_a_partial_uint32_are_refused(daemon: Daemon) -> None:
    with daemon.client() as client:
        before = client.snapshot()
        with pytest.raises(ControlError) as caught:
            client._call("store", request_id="odd", token_ids=b"\x01\x00\x00\x00\x02")
        assert caught.value.code == "bad_request"
        assert "uint32" in caught.value.message
        after = client.snapshot()
        assert after.events == before.events and after.seq == before.seq
        assert client.stats().ranks[0].requests_open == 0


def test_bytes_tokens_count_against_the_token_limit(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon(control={"max_tokens_per_request": 32})
    with daemon.client() as client:
        client.store("ok", np.arange(32))
        with pytest.raises(ControlError) as caught:
            client.store("big", np.arange(33))
        assert caught.value.code == "too_large"
        assert client.stats().ranks[0].requests_open == 1
