"""Shared helpers for tests that read a daemon's event streams.

``Tap`` wraps a ``Subscriber`` and keeps every batch it delivered. ``Tap.go_live`` proves each
rank's SUB socket is subscribed (a batch arrived live, not through replay) and ``Tap.settle``
waits until the subscriber holds every batch the daemon reports as published. Every wait polls
with a deadline; nothing sleeps in place of synchronisation."""

from __future__ import annotations

import functools
import hashlib
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgpack
import numpy as np
import xxhash

from kvpubd.client import ControlClient, Marker, Received, StoreReply, Subscriber
from kvpubd.protocol.wire import (
    END_SEQ,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
)

BLOCK_SIZE = 16  # the test daemon's default block_size
LIVE_SEED = 400_000  # prompt seeds from here on are reserved for go_live's probes


def prompt(seed: int, blocks: int, tail: int = 0) -> list[int]:
    """Token ids of ``blocks`` full blocks plus ``tail`` tokens; the first block (so every
    block hash) differs for each ``seed`` in 0..429_000."""
    count = blocks * BLOCK_SIZE + tail
    assert count < 10_000
    base = seed * 10_000
    return list(range(base, base + count))


def packed_prompt(blocks: int, seed: int) -> bytes:
    """Random token ids of ``blocks`` full blocks, packed as ``store`` takes them fastest
    (little-endian uint32): for prompts too long for ``prompt``."""
    rng = np.random.default_rng(seed)
    return rng.integers(1, 60_000, blocks * BLOCK_SIZE, dtype="<u4").tobytes()


def independent_digest(data: bytes, algorithm: str = "sha256") -> bytes:
    """One link of the chain: sha256, or xxh3_128 for ``cache.hash_algorithm = "xxhash"``."""
    if algorithm == "xxhash":
        return xxhash.xxh3_128(data).digest()
    return hashlib.sha256(data).digest()


def independent_root_key(
    lora_id: int | None, cache_salt: str | None, algorithm: str = "sha256"
) -> bytes:
    """The chain's root: the digest of the msgpack array ["kvpubd-root-v1", lora_id,
    cache_salt]."""
    return independent_digest(msgpack.packb(["kvpubd-root-v1", lora_id, cache_salt]), algorithm)


def chain_hashes(
    tokens: list[int],
    *,
    lora_id: int | None = None,
    cache_salt: str | None = None,
    hash_format: str = "u64",
    block_size: int = BLOCK_SIZE,
    algorithm: str = "sha256",
) -> list[BlockHash]:
    """The published hashes of the full blocks of ``tokens``, computed independently of
    kvpubd.protocol.hashing: ``digest_i = H(digest_{i-1} or root || block i's token ids as
    little-endian uint32)``; u64 is the digest's last 8 bytes read big-endian, i64 its first
    8 bytes signed, bytes the digest itself."""
    prev = independent_root_key(lora_id, cache_salt, algorithm)
    hashes: list[BlockHash] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = struct.pack(f"<{block_size}I", *tokens[start : start + block_size])
        prev = independent_digest(prev + block, algorithm)
        if hash_format == "u64":
            hashes.append(int.from_bytes(prev[-8:], "big"))
        elif hash_format == "i64":
            hashes.append(int.from_bytes(prev[:8], "big", signed=True))
        elif hash_format == "bytes":
            hashes.append(prev)
        else:
            raise ValueError(f"unknown hash format {hash_format!r}")
    return hashes


def reference_chain(
    tokens: list[int], lora_id: int | None = None, salt: str | None = None
) -> list[BlockHash]:
    """The u64 wire hashes of the full blocks of ``tokens`` (``chain_hashes``, positional)."""
    return chain_hashes(tokens, lora_id=lora_id, cache_salt=salt)


def vllm_extra_keys(
    first: int, count: int, lora_name: str | None = None, salt: str | None = None
) -> list[tuple[Any, ...] | None] | None:
    """``extra_keys`` of blocks ``first .. first+count-1`` of one prompt as vLLM 0.33 publishes
    them (``generate_block_hash_extra_keys`` then ``to_event_extra_keys``): per block, the LoRA
    name, then the salt on the prompt's first block only; None where a block has none."""
    lora = () if lora_name is None else (lora_name,)
    keys = [
        ((*lora, salt) if i == 0 and salt is not None else lora) or None
        for i in range(first, first + count)
    ]
    return keys if any(k is not None for k in keys) else None


def is_marker(event: Event) -> bool:
    return isinstance(event, AllBlocksCleared)


def seq_of(marker: Marker) -> int:
    """The seq of the batch that carried a reset's marker (None only with flush_on_reset off)."""
    assert marker.seq is not None, f"rank {marker.rank}: the reset's marker was held back"
    return marker.seq


def flat_events(batches: list[Received]) -> list[tuple[int, Event]]:
    """(seq, event) for every event of ``batches``, in order."""
    return [(b.seq, event) for b in batches for event in b.batch.events]


def stores(batches: list[Received]) -> list[BlockStored]:
    return [e for b in batches for e in b.batch.events if isinstance(e, BlockStored)]


def removals(batches: list[Received]) -> list[BlockRemoved]:
    return [e for b in batches for e in b.batch.events if isinstance(e, BlockRemoved)]


class Tap:
    """A subscriber that keeps every batch it delivered (``history``), in arrival order."""

    def __init__(self, sub: Subscriber, ranks: int = 1) -> None:
        self.sub = sub
        self.ranks = ranks
        self.history: list[Received] = []

    def last_seq(self, rank: int = 0) -> int:
        last = self.sub.last_seq(rank)
        return -1 if last is None else last

    def _keep(self, got: list[Received]) -> list[Received]:
        self.history.extend(got)
        return got

    def catch_up(self) -> list[Received]:
        return self._keep(self.sub.catch_up())

    def pump(self, timeout: float) -> list[Received]:
        return self._keep(self.sub.receive(timeout))

    def until(
        self, done: Callable[[], bool], timeout: float = 5.0, what: str = "batches"
    ) -> list[Received]:
        """Receive until ``done()``; returns the batches received meanwhile."""
        got: list[Received] = []
        deadline = time.monotonic() + timeout
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                seqs = [(b.rank, b.seq) for b in got]
                raise AssertionError(f"timed out waiting for {what}; received {seqs}")
            got.extend(self.pump(min(left, 0.1)))
        return got

    def through(self, seqs: Mapping[int, int], timeout: float = 5.0) -> list[Received]:
        """Receive until each rank r has delivered seq ``seqs[r]``."""
        return self.until(
            lambda: all(self.last_seq(r) >= seq for r, seq in seqs.items()),
            timeout,
            f"seqs {dict(seqs)}",
        )

    def settle(self, client: ControlClient, timeout: float = 5.0) -> list[Received]:
        """Receive every batch the daemon reports as already published (stats ``seq``); events
        still pending in the sink are not covered."""
        published = {r.rank: r.seq for r in client.stats().ranks}
        return self.through(published, timeout)

    def go_live(self, client: ControlClient, timeout: float = 10.0) -> list[Received]:
        """Replay from 0, then store and release one-block probe prompts on each rank until a
        batch arrives live on it: from then on its SUB socket is known to be subscribed. Returns
        once the last probe's store was received. Needs the periodic drain running; leaves the
        probes cached and unpinned."""
        got = self.catch_up()
        deadline = time.monotonic() + timeout
        for rank in range(self.ranks):
            for attempt in range(1000):
                request_id = f"live-probe-{rank}-{attempt}"
                tokens = prompt(LIVE_SEED + rank * 1000 + attempt, 1)
                client.store(request_id, tokens, rank=rank)
                client.release(request_id)
                first = chain_hashes(tokens)[0]
                attempt_end = min(deadline, time.monotonic() + 0.25)
                live = False
                while not self.stored_seen(first, rank) and time.monotonic() < attempt_end:
                    new = self.pump(max(0.0, attempt_end - time.monotonic()))
                    got.extend(new)
                    live = live or any(b.rank == rank and not b.replayed for b in new)
                if live:
                    got.extend(
                        self.until(
                            functools.partial(self.stored_seen, first, rank),
                            what="the last probe",
                        )
                    )
                    break
                if time.monotonic() >= deadline:
                    raise AssertionError(f"rank {rank}: no batch arrived live on the SUB socket")
        return got

    def store_seen(
        self,
        client: ControlClient,
        request_id: str,
        tokens: list[int],
        *,
        rank: int = 0,
        release: bool = True,
        **fields: Any,
    ) -> StoreReply:
        """Store (and by default release) a prompt that adds at least one full block, then
        receive until its BlockStored arrives. Needs the periodic drain running."""
        reply = client.store(request_id, tokens, rank=rank, **fields)
        if release:
            client.release(request_id)
        hashes = chain_hashes(
            tokens, lora_id=fields.get("lora_id"), cache_salt=fields.get("cache_salt")
        )
        first_new = hashes[reply.num_cached_tokens // BLOCK_SIZE]
        self.until(lambda: self.stored_seen(first_new, rank), what=f"the store of {request_id}")
        return reply

    def batch(self, rank: int, seq: int) -> Received:
        found = [b for b in self.history if b.rank == rank and b.seq == seq]
        assert len(found) == 1, f"rank {rank} seq {seq}: delivered {len(found)} times"
        return found[0]

    def after(self, rank: int, seq: int) -> list[Received]:
        """The delivered batches of ``rank`` with a seq above ``seq``, in seq order."""
        return sorted((b for b in self.history if b.rank == rank and b.seq > seq), key=seq_key)

    def stored_seen(self, first_hash: BlockHash, rank: int = 0) -> bool:
        return any(
            b.rank == rank and e.block_hashes[0] == first_hash
            for b in self.history
            for e in b.batch.events
            if isinstance(e, BlockStored)
        )


def seq_key(batch: Received) -> int:
    return batch.seq


def concurrent_replays(
    endpoint: str,
    clients: int,
    timeout: float = 60.0,
    attempt_timeout: float = 0.5,
    stall_timeout: float = 10.0,
) -> list[list[int]]:
    """``clients`` DEALERs ask one replay socket for everything from seq 0 at once; returns
    each one's replayed seqs, in arrival order. A request the daemon refused (over its
    ``max_replays``) gets no answer: a client that heard nothing for ``attempt_timeout`` asks
    again from a fresh socket (a new identity, so a late stream to the old one cannot mix in),
    as a client would; one whose stream started and then went quiet for ``stall_timeout`` too.
    Fails after ``timeout``."""
    import zmq

    ctx = zmq.Context()
    request = [b"", (0).to_bytes(8, "big")]
    dealers: list[zmq.Socket[bytes] | None] = [None] * clients
    heard = [0.0] * clients
    seqs: list[list[int]] = [[] for _ in range(clients)]
    finished: set[int] = set()

    def ask(i: int) -> None:
        old = dealers[i]
        if old is not None:
            old.close(linger=0)
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        dealer.send_multipart(request)
        dealers[i], heard[i], seqs[i] = dealer, time.monotonic(), []

    try:
        for i in range(clients):
            ask(i)
        deadline = time.monotonic() + timeout
        while len(finished) < clients:
            if time.monotonic() > deadline:
                raise AssertionError(f"{clients - len(finished)} of {clients} replays unfinished")
            poller = zmq.Poller()
            waiting = [i for i in range(clients) if i not in finished]
            for i in waiting:
                poller.register(dealers[i], zmq.POLLIN)
            ready = dict(poller.poll(50))
            now = time.monotonic()
            for i in waiting:
                dealer = dealers[i]
                assert dealer is not None
                if dealer not in ready:
                    quiet = attempt_timeout if not seqs[i] else stall_timeout
                    if now - heard[i] > quiet:
                        ask(i)
                    continue
                heard[i] = now
                while i not in finished and dealer.poll(0):
                    frames = dealer.recv_multipart()
                    if frames[-2] == END_SEQ:
                        finished.add(i)
                    else:
                        seqs[i].append(int.from_bytes(frames[-2], "big"))
                # Only once finished: a stream still running can deliver its next batch
                # between the two polls.
                if i in finished:
                    assert not dealer.poll(0), "a frame after the end marker"
        return seqs
    finally:
        for dealer in dealers:
            if dealer is not None:
                dealer.close(linger=0)
        ctx.term()


# A process that opens argv[2] connections to argv[1], sends argv[3] (hex) on each as one
# frame after the empty one, and never reads.
_ASKER = """
import sys, zmq
ctx = zmq.Context()
socks = [ctx.socket(zmq.DEALER) for _ in range(int(sys.argv[2]))]
for sock in socks:
    sock.connect(sys.argv[1])
    sock.send_multipart([b"", bytes.fromhex(sys.argv[3])])
print("sent", flush=True)
sys.stdin.read()
"""


def asking_process(endpoint: str, connections: int, request: bytes) -> subprocess.Popen[bytes]:
    """Another process (one peer address) that asks ``request`` on each of ``connections``
    DEALER connections to ``endpoint`` and never reads; returned once all are sent. Kill it."""
    process = subprocess.Popen(
        [sys.executable, "-c", _ASKER, endpoint, str(connections), request.hex()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert process.stdout is not None and process.stdout.readline() == b"sent\n"
    return process
