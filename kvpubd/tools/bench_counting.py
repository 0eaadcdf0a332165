"""The counting subscriber of ``kvpubd bench throughput``: one process per rank that receives
every batch of its rank's stream, decodes it and counts BlockStored blocks and seq gaps.

It decodes with vLLM's own ``KVEventBatch`` (msgspec, from vLLM's kv_events.py: a batch
vLLM's consumers could not read fails the count) when that file is available, else with plain
msgpack."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

from kvpubd.tools.vllm_source import kv_events_path

# A subscriber stops this long after its stop seq arrived without it (never in a sound run).
STOP_GRACE_S = 30.0


def vllm_decoder_path() -> str | None:
    """vLLM's kv_events.py if it is there and loads, else None (the counters use msgpack)."""
    from kvpubd.tools.vllm_source import load_kv_events

    path = kv_events_path()
    if not path.is_file():
        return None
    load_kv_events(path)  # a file that does not load is an error, not a silent fallback
    return str(path)


def _stored_blocks_counter(kv_path: str | None) -> Callable[[bytes], int]:
    """A function decoding one payload; returns its BlockStored blocks."""
    if kv_path is None:

        def plain(payload: bytes) -> int:
            return sum(
                len(event["block_hashes"])
                for event in msgpack.unpackb(payload)[1]
                if event["type"] == "BlockStored"
            )

        return plain
    import msgspec

    from kvpubd.tools.vllm_source import load_kv_events

    kv = load_kv_events(Path(kv_path))
    decode = msgspec.msgpack.Decoder(kv.KVEventBatch).decode
    stored = kv.BlockStored

    def with_vllms_types(payload: bytes) -> int:
        return sum(len(e.block_hashes) for e in decode(payload).events if type(e) is stored)

    return with_vllms_types


def count_stored(endpoint: str, kv_path: str | None, pipe: Any) -> None:
    """Subscriber process: live once a batch arrives (the bench sends resets until then: it
    gets "live"); then counts until it has the seq the bench sends last, and answers blocks,
    gaps, batches that did not decode, the first and last time a block arrived, and the CPU
    seconds spent decoding."""
    from kvpubd.tools.launcher import live_subscriber

    count = _stored_blocks_counter(kv_path)
    ctx, sub = live_subscriber(endpoint, poll_ms=50)
    pipe.send("live")
    stop_seq: int | None = None
    stop_deadline = float("inf")
    blocks = gaps = undecodable = 0
    last_seq: int | None = None
    last_time = first_time = decoding = 0.0
    while stop_seq is None or last_seq is None or last_seq < stop_seq:
        if stop_seq is None and pipe.poll(0):
            stop_seq = pipe.recv()
            stop_deadline = time.monotonic() + STOP_GRACE_S
        if time.monotonic() > stop_deadline:
            break
        if not sub.poll(100):
            continue
        _, seq_frame, payload = sub.recv_multipart()
        seq = int.from_bytes(seq_frame, "big")
        if last_seq is not None and seq != last_seq + 1:
            gaps += 1
        last_seq = seq
        started = time.thread_time()
        try:
            stored = count(payload)
        except Exception:  # a batch vLLM's types refuse: counted, never hidden
            stored, undecodable = 0, undecodable + 1
        decoding += time.thread_time() - started
        if stored:
            if not blocks:
                first_time = time.monotonic()
            blocks += stored
        last_time = time.monotonic()
    pipe.send(
        {
            "blocks": blocks,
            "gaps": gaps,
            "undecodable": undecodable,
            "complete": last_seq is not None and stop_seq is not None and last_seq >= stop_seq,
            "first": first_time,
            "last": last_time,
            "decoding_s": decoding,
        }
    )
    sub.close(linger=0)
    ctx.term()
