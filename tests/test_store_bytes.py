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


@pytest.mark.parametrize(
    "tokens",
    [
        np.array([-1] * 16, dtype=np.int64),  # was token 4294967295
        np.array([2**32] * 16, dtype=np.int64),  # was token 0
        np.array([0.9] * 16),  # was token 0
        np.array([[1] * 16]),  # a batch of prompts, not one
    ],
    ids=["negative", "past-uint32", "float", "two-dimensional"],
)
def test_an_array_whose_ids_a_cast_would_change_is_refused(
    daemon: Daemon, tokens: np.ndarray
) -> None:
    """The client packed any NumPy array as uint32 without a look: -1, 2**32 and 0.9 became
    other token ids, and the prompt shared another prompt's blocks. As a list the same ids are
    refused by the daemon; as an array the client refuses them before sending."""
    with daemon.client() as client:
        with pytest.raises(ValueError, match="token_ids"):
            client.store("cast", tokens)
        assert client.stats().ranks[0].requests_open == 0
        as_uint16 = client.store("small", np.arange(16, dtype=np.uint16))
        assert len(as_uint16.block_ids) == 1
