"""A mirror not told of a daemon's host tier (``host_medium``) puts both tiers' blocks in one
map, where a chain can look broken; its error says what to pass."""

from __future__ import annotations

import pytest

from kvpubd.client import Mirror, MirrorError
from kvpubd.protocol.wire import BlockStored

BS = 4


def stored(block_hash: int, parent: int | None, medium: str) -> BlockStored:
    return BlockStored([block_hash], parent, list(range(BS)), BS, None, medium, None)


def test_a_broken_chain_across_two_media_says_to_pass_host_medium() -> None:
    mirror = Mirror()
    mirror.apply([stored(1, None, "GPU"), stored(7, None, "CPU")])
    with pytest.raises(MirrorError, match="media CPU, GPU: with a host tier, pass host_medium"):
        mirror.apply([stored(3, 2, "GPU")])


def test_a_broken_chain_on_one_medium_says_only_that() -> None:
    mirror = Mirror()
    mirror.apply([stored(1, None, "GPU")])
    with pytest.raises(MirrorError) as refused:
        mirror.apply([stored(3, 2, "GPU")])
    assert str(refused.value) == "BlockStored parent 2 is not live"
