"""The replay ring is bounded in bytes as well as in batches: a batch is bounded in blocks, and
in upstream mode the engine names its own block size (one block of 200 000 tokens stored and
removed over and over grew the daemon by about 1.7 MB a pair, up to buffer_steps batches)."""

from __future__ import annotations

from kvpubd.daemon.history import History
from kvpubd.protocol.wire import BlockStored

TOKENS = 50_000  # one block's: about 100 KB of payload


def fat_store(number: int) -> BlockStored:
    return BlockStored(
        block_hashes=[number],
        parent_block_hash=None,
        token_ids=[7] * TOKENS,
        block_size=TOKENS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def history(buffer_steps: int, buffer_bytes: int) -> History:
    made = History(buffer_steps=buffer_steps, buffer_bytes=buffer_bytes)
    made.send = lambda seq_frame, payload: None  # no transport: the ring is what is tested
    return made


def test_the_ring_keeps_no_more_bytes_than_buffer_bytes() -> None:
    ring = history(10_000, 1 << 20)
    sizes = []
    for number in range(60):
        ring.publish([fat_store(number)])
        start, batches = ring.read(0, 10_000)
        sizes.append(sum(len(payload) for _, payload in batches))
    assert max(sizes) <= 1 << 20
    start, batches = ring.read(0, 10_000)
    kept = len(list(batches))
    assert start == 60 - kept and 10 <= kept < 30  # the newest, about 1 MiB of them
    # A small batch is kept as long as buffer_steps allows.
    ring = history(100, 1 << 20)
    for _ in range(150):
        ring.publish([])
    assert ring.read(0, 10_000)[0] == 50
