"""Shared helpers for tests that read a daemon's event streams.

``Tap`` wraps a ``Subscriber`` and keeps every batch it delivered. ``Tap.go_live`` proves each
rank's SUB socket is subscribed (a batch arrived live, not through replay) and ``Tap.settle``
waits until the subscriber holds every batch the daemon reports as published. Every wait polls
with a deadline; nothing sleeps in place of synchronisation."""

from __future__ import annotations

import hashlib
import struct
import time
from collections.abc import Callable, Mapping
from typing import Any

from kvpubd.client import ControlClient, Received, Subscriber
from kvpubd.protocol.hashing import chain_digests, root_key, tokens_array, wire_hasher
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


def chain_hashes(
    tokens: list[int],
    *,
    lora_id: int | None = None,
    cache_salt: str | None = None,
    hash_format: str = "u64",
    block_size: int = BLOCK_SIZE,
) -> list[BlockHash]:
    """The published hashes of the full blocks of ``tokens``, computed independently."""
    wire = wire_hasher(hash_format)  # type: ignore[arg-type]
    digests = chain_digests(tokens_array(tokens), block_size, root_key(lora_id, cache_salt))
    return wire(digests)


def reference_chain(
    tokens: list[int], lora_id: int | None = None, salt: str | None = None
) -> list[int]:
    """The u64 wire hashes of the full blocks of ``tokens``, computed from DESIGN.md's chain
    with hashlib and struct alone (independent of kvpubd.protocol.hashing but for the root key)."""
    prev = root_key(lora_id, salt)
    out = []
    for i in range(len(tokens) // BLOCK_SIZE):
        block = struct.pack(f"<{BLOCK_SIZE}I", *tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
        prev = hashlib.sha256(prev + block).digest()
        out.append(int.from_bytes(prev[-8:], "big"))
    return out


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
        published = {r["rank"]: r["seq"] for r in client.stats()["ranks"]}
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
                            lambda first=first, rank=rank: self.stored_seen(first, rank),
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
    ) -> dict[str, Any]:
        """Store (and by default release) a prompt that adds at least one full block, then
        receive until its BlockStored arrives. Needs the periodic drain running."""
        reply = client.store(request_id, tokens, rank=rank, **fields)
        if release:
            client.release(request_id)
        hashes = chain_hashes(
            tokens, lora_id=fields.get("lora_id"), cache_salt=fields.get("cache_salt")
        )
        first_new = hashes[reply["num_cached_tokens"] // BLOCK_SIZE]
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


def concurrent_replays(endpoint: str, clients: int, timeout: float = 20.0) -> list[list[int]]:
    """``clients`` DEALERs ask one replay socket for everything from seq 0 at once; returns
    each one's replayed seqs, in arrival order. A request the daemon refused (over its
    ``max_replays``) gets no answer: after ``timeout`` quiet seconds the unfinished ask again,
    as a client would."""
    import zmq

    ctx = zmq.Context()
    dealers = []
    try:
        for _ in range(clients):
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(endpoint)
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            dealers.append(dealer)
        poller = zmq.Poller()
        for dealer in dealers:
            poller.register(dealer, zmq.POLLIN)
        seqs: dict[zmq.Socket, list[int]] = {dealer: [] for dealer in dealers}
        finished: set[zmq.Socket] = set()
        while len(finished) < len(dealers):
            ready = dict(poller.poll(int(timeout * 1000)))
            if not ready:
                for dealer in set(dealers) - finished:
                    seqs[dealer] = []
                    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
                continue
            for dealer in ready:
                while dealer.poll(0):
                    frames = dealer.recv_multipart()
                    assert dealer not in finished, "a frame after the end marker"
                    if frames[-2] == END_SEQ:
                        finished.add(dealer)
                    else:
                        seqs[dealer].append(int.from_bytes(frames[-2], "big"))
        return [seqs[dealer] for dealer in dealers]
    finally:
        for dealer in dealers:
            dealer.close()
        ctx.term()
