"""A consumer of one rank's live stream and snapshot endpoint, written from the snapshot
protocol's text alone (pyzmq and plain msgpack; nothing of kvpubd), so that tests of the
daemon's snapshot endpoint check the daemon against the protocol, not against its own code.

Blocking and single-threaded: the caller drives it with ``step``/``run_until``. It bootstraps
as the protocol's consumer procedure says (one live message buffered, a snapshot asked on a
fresh REQ socket, the buffered messages past the snapshot's seq applied on top), then follows
the live stream and bootstraps again on a new publisher identity, a gap or silence. Every
deviation from the protocol it sees is recorded in ``violations`` rather than raised, so a
test can assert there were none and still see the consumer's state.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

BlockHash = int | bytes
SEQ_BYTES = 8
PUBLISHER_ID_BYTES = 16
SNAPSHOT_REQUEST = b"snapshot"
LIVE_PER_STEP = 1000
SNAPSHOT_UNAVAILABLE = -2  # any seq below -1 means "not now, retry"
# The array form of events (tag, then the fields in declaration order), as vLLM publishes it.
STORED_ARRAY_FIELDS = (
    *("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"),
    *("medium", "lora_name", "extra_keys"),
)
REMOVED_ARRAY_FIELDS = ("block_hashes",)


@dataclass(frozen=True)
class Block:
    """One cached block as the index keeps it."""

    parent: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    extra_keys: Any = None  # this block's entry of the store's extra_keys
    medium: str | None = None
    lora_name: str | None = None
    cache_salt: str | None = None  # the map form's (absent from arrays)


@dataclass(frozen=True)
class Stored:
    block_hashes: list[BlockHash]
    parent: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    extra_keys: list[Any] | None
    medium: str | None = None
    lora_name: str | None = None
    cache_salt: str | None = None


@dataclass(frozen=True)
class Removed:
    block_hashes: list[BlockHash]


@dataclass(frozen=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


@dataclass(frozen=True)
class LiveBatch:
    seq: int
    rank: int
    publisher_id: bytes | None  # None: a 3-element payload (no snapshots served)
    events: list[Event]


class ProtocolError(ValueError):
    """A frame or payload that the protocol does not allow."""


def decode_event(raw: Any) -> Event:
    """One event in the map form (a dict with "type") or the array form (tag first)."""
    if isinstance(raw, dict):
        kind, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = {"BlockStored": STORED_ARRAY_FIELDS, "BlockRemoved": REMOVED_ARRAY_FIELDS}
        # Older publishers' arrays may end early: the missing fields are absent.
        fields = dict(zip(names.get(kind, ()), raw[1:], strict=False))
    else:
        raise ProtocolError(f"not an event: {raw!r}")
    if kind == "AllBlocksCleared":
        return Cleared()
    try:
        hashes = list(fields["block_hashes"])
        if kind == "BlockRemoved":
            return Removed(hashes)
        if kind == "BlockStored":
            extra = fields.get("extra_keys")
            return Stored(
                block_hashes=hashes,
                parent=fields["parent_block_hash"],
                token_ids=list(fields["token_ids"]),
                block_size=int(fields["block_size"]),
                lora_id=fields.get("lora_id"),
                extra_keys=None if extra is None else list(extra),
                medium=fields.get("medium"),
                lora_name=fields.get("lora_name"),
                cache_salt=fields.get("cache_salt"),
            )
    except (KeyError, TypeError) as error:
        raise ProtocolError(f"bad {kind}: {raw!r}") from error
    raise ProtocolError(f"unknown event type {kind!r}")


def decode_payload(
    payload: bytes, lengths: tuple[int, ...] = (3, 4)
) -> tuple[int, list[Event], bytes | None]:
    """(data_parallel_rank, events, publisher_id or None) of ``[ts, events, rank(, id)]``, an
    array of one of ``lengths``."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except ValueError as error:  # msgpack's own errors (ExtraData, FormatError...) included
        raise ProtocolError(f"payload is not msgpack: {error}") from error
    if not isinstance(batch, list) or len(batch) not in lengths:
        raise ProtocolError(f"payload is not an array of {lengths} elements: {batch!r}")
    ts, events, rank = batch[:3]
    if not isinstance(ts, (int, float)) or not isinstance(events, list):
        raise ProtocolError(f"bad ts or events: {batch!r}")
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise ProtocolError(f"data_parallel_rank is not an int: {rank!r}")
    publisher_id = batch[3] if len(batch) == 4 else None
    if publisher_id is not None and (
        not isinstance(publisher_id, bytes) or len(publisher_id) != PUBLISHER_ID_BYTES
    ):
        raise ProtocolError(f"publisher_id is not 16 bytes: {publisher_id!r}")
    return rank, [decode_event(event) for event in events], publisher_id


def decode_live(frames: list[bytes]) -> LiveBatch:
    if len(frames) != 3 or len(frames[1]) != SEQ_BYTES:
        raise ProtocolError(f"a live message is [topic, seq(8), payload]: {len(frames)} frames")
    rank, events, publisher_id = decode_payload(frames[2])
    return LiveBatch(int.from_bytes(frames[1], "big"), rank, publisher_id, events)


@dataclass
class Counters:
    bootstraps: int = 0  # indexes installed
    snapshot_requests: int = 0
    bootstrap_failures: Counter[str] = field(default_factory=Counter)
    resyncs: Counter[str] = field(default_factory=Counter)  # "identity", "gap", "silence", ...
    applied_batches: int = 0  # live batches applied to an index (buffered ones included)
    applied_heartbeats: int = 0  # of which empty
    duplicates: int = 0
    buffer_overflows: int = 0
    without_publisher_id: int = 0
    last_snapshot_seq: int | None = None
    last_snapshot_chunks: int = 0


class Index:
    """Block hash -> Block, built by applying events; what the protocol forbids is recorded."""

    def __init__(self, violations: list[str]) -> None:
        self.blocks: dict[BlockHash, Block] = {}
        self._violations = violations

    def apply(self, events: list[Event], where: str) -> None:
        for event in events:
            if isinstance(event, Cleared):
                self.blocks.clear()
            elif isinstance(event, Removed):
                for block_hash in event.block_hashes:
                    if self.blocks.pop(block_hash, None) is None:
                        self._violations.append(f"{where}: removes unknown {block_hash!r}")
            else:
                self._store(event, where)

    def _store(self, event: Stored, where: str) -> None:
        size = event.block_size
        if len(event.token_ids) != size * len(event.block_hashes):
            self._violations.append(f"{where}: token_ids are not blocks x block_size")
        if event.extra_keys is not None and len(event.extra_keys) != len(event.block_hashes):
            self._violations.append(f"{where}: extra_keys not one per block")
        parent = event.parent
        if parent is not None and parent not in self.blocks:
            self._violations.append(f"{where}: parent {parent!r} is not in the index")
        for i, block_hash in enumerate(event.block_hashes):
            if block_hash in self.blocks:
                self._violations.append(f"{where}: stores {block_hash!r} again")
            self.blocks[block_hash] = Block(
                parent=parent,
                token_ids=tuple(event.token_ids[i * size : (i + 1) * size]),
                block_size=size,
                lora_id=event.lora_id,
                extra_keys=None if event.extra_keys is None else event.extra_keys[i],
                medium=event.medium,
                lora_name=event.lora_name,
                cache_salt=event.cache_salt,
            )
            parent = block_hash


IDLE, BOOTSTRAPPING, FOLLOWING = "idle", "bootstrapping", "following"


class SnapshotConsumer:
    """Follows one rank: ``events_endpoint`` and ``snapshot_endpoint`` are that rank's own.

    ``silence_s``: no live message for that long (by ``clock``) while following or
    bootstrapping makes the state unavailable and starts over. ``request_timeout_s``: a
    snapshot request unanswered for that long fails (retried after ``retry_s``). At most
    ``buffer_limit`` live messages are buffered while a bootstrap waits (oldest dropped).
    """

    def __init__(
        self,
        events_endpoint: str,
        snapshot_endpoint: str,
        *,
        topic: bytes = b"",
        silence_s: float = 5.0,
        request_timeout_s: float = 2.0,
        retry_s: float = 0.05,
        buffer_limit: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        self.snapshot_endpoint = snapshot_endpoint
        self.silence_s = silence_s
        self.request_timeout_s = request_timeout_s
        self.retry_s = retry_s
        self.buffer_limit = buffer_limit
        self.clock = clock
        self._own_context = context is None
        self._context: zmq.Context[zmq.Socket[bytes]] = context or zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, 0)  # a slow test thread must not turn into gaps
        self._sub.setsockopt(zmq.SUBSCRIBE, topic)
        self._sub.connect(events_endpoint)
        self._req: zmq.Socket[bytes] | None = None
        self._request_deadline = 0.0
        self._retry_at: float | None = None
        self._buffer: deque[LiveBatch] = deque()
        self._last_heard = clock()

        self.state = IDLE
        self.publisher_id: bytes | None = None
        self.next_seq: int | None = None
        self.rank: int | None = None
        self.counters = Counters()
        self.violations: list[str] = []
        self._index = Index(self.violations)
        self.snapshots_served: bool | None = None  # False once a batch came without an id

    # -- the caller's view ---------------------------------------------------------------

    @property
    def index(self) -> dict[BlockHash, Block]:
        """The installed index (empty while the rank's state is unavailable)."""
        return self._index.blocks

    @property
    def ready(self) -> bool:
        return self.state == FOLLOWING

    @property
    def last_applied_seq(self) -> int | None:
        return None if self.next_seq is None or not self.ready else self.next_seq - 1

    @property
    def buffered(self) -> int:
        """Live messages held while a bootstrap waits for its snapshot."""
        return len(self._buffer)

    def parents(self) -> dict[BlockHash, BlockHash | None]:
        return {block_hash: block.parent for block_hash, block in self.index.items()}

    def step(self, timeout_s: float = 0.02) -> None:
        """Wait at most ``timeout_s`` (less when a deadline comes first) for a live message or
        a snapshot reply, handle everything ready, then the deadlines that passed."""
        wait = max(0.0, min(timeout_s, self._next_deadline() - self.clock()))
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        if self._req is not None:
            poller.register(self._req, zmq.POLLIN)
        ready = dict(poller.poll(int(wait * 1000)))
        if self._sub in ready:
            # Bounded, so that a busy stream still lets the snapshot reply in.
            for _ in range(LIVE_PER_STEP):
                try:
                    frames = self._sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._on_live(frames)
        req = self._req
        if req is not None and req in ready and req.poll(0):
            self._on_reply(req.recv_multipart())
        self._check_deadlines()

    def run_until(
        self, predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "it"
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out waiting for {what}: state {self.state}, {self.counters}, "
                    f"violations {self.violations[:5]}"
                )
            self.step()

    def close(self) -> None:
        self._close_req()
        self._sub.close(linger=0)
        if self._own_context:
            self._context.term()

    def __enter__(self) -> SnapshotConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- live messages -------------------------------------------------------------------

    def _on_live(self, frames: list[bytes]) -> None:
        self._last_heard = self.clock()
        try:
            batch = decode_live(frames)
        except ProtocolError as error:
            self.violations.append(f"live: {error}")
            return
        if self.rank is not None and batch.rank != self.rank:
            self.violations.append(f"live: rank {batch.rank} after rank {self.rank}")
        self.rank = batch.rank
        if batch.publisher_id is None:
            self.counters.without_publisher_id += 1
            self.snapshots_served = False
            if self.state != IDLE:
                self._unavailable("no publisher_id", None)
            return
        self.snapshots_served = True
        if self.state == IDLE:
            self._start_bootstrap(batch)
        elif self.state == BOOTSTRAPPING:
            self._buffer_live(batch)
        elif batch.publisher_id != self.publisher_id:
            self._unavailable("identity", batch)
        elif batch.seq < self._following_seq():
            self.counters.duplicates += 1
        elif batch.seq > self._following_seq():
            self._unavailable("gap", batch)
        else:
            self._apply_live(batch, "live")

    def _following_seq(self) -> int:
        assert self.next_seq is not None, "following without a next seq"
        return self.next_seq

    def _buffer_live(self, batch: LiveBatch) -> None:
        if self._buffer and self._buffer[-1].publisher_id != batch.publisher_id:
            self._buffer.clear()  # an earlier publisher's messages can never be applied
        self._buffer.append(batch)
        if len(self._buffer) > self.buffer_limit:
            self._buffer.popleft()
            self.counters.buffer_overflows += 1

    def _apply_live(self, batch: LiveBatch, where: str) -> None:
        self._index.apply(batch.events, f"{where} seq {batch.seq}")
        self.next_seq = batch.seq + 1
        self.counters.applied_batches += 1
        if not batch.events:
            self.counters.applied_heartbeats += 1

    def _unavailable(self, reason: str, trigger: LiveBatch | None) -> None:
        """The rank's state is unknown: drop the index and bootstrap again, from ``trigger``
        (a live message just received) when there is one."""
        self.counters.resyncs[reason] += 1
        self._index = Index(self.violations)
        self.next_seq = None
        self._close_req()
        self._buffer.clear()
        self._retry_at = None
        self.state = IDLE
        if trigger is not None and trigger.publisher_id is not None:
            self._start_bootstrap(trigger)

    # -- bootstrap -----------------------------------------------------------------------

    def _start_bootstrap(self, first: LiveBatch) -> None:
        self.state = BOOTSTRAPPING
        self._buffer.clear()
        self._buffer.append(first)
        self._request()

    def _request(self) -> None:
        self._close_req()
        self._retry_at = None
        req = self._context.socket(zmq.REQ)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(self.snapshot_endpoint)
        self._req = req
        self._request_deadline = self.clock() + self.request_timeout_s
        self.counters.snapshot_requests += 1
        try:
            req.send(SNAPSHOT_REQUEST, zmq.NOBLOCK)
        except zmq.Again:
            self._fail("send")

    def _fail(self, reason: str) -> None:
        self.counters.bootstrap_failures[reason] += 1
        self._close_req()
        self._retry_at = self.clock() + self.retry_s

    def _on_reply(self, frames: list[bytes]) -> None:
        self._close_req()
        if len(frames) < 2 or len(frames[0]) != SEQ_BYTES or len(frames[1]) != PUBLISHER_ID_BYTES:
            self.violations.append(f"snapshot reply malformed: {[len(f) for f in frames]}")
            self._fail("malformed")
            return
        seq = int.from_bytes(frames[0], "big", signed=True)
        publisher_id, chunks = frames[1], frames[2:]
        if seq < -1:
            if chunks:
                self.violations.append(f"snapshot seq {seq} came with {len(chunks)} chunks")
            self._fail("unavailable")
            return
        if not self._buffer or publisher_id != self._buffer[-1].publisher_id:
            self._fail("identity")
            return
        index = Index(self.violations)
        for number, chunk in enumerate(chunks):
            where = f"snapshot seq {seq} chunk {number}"
            try:
                _, events, _ = decode_payload(chunk, lengths=(3,))  # a KVEventBatch
            except ProtocolError as error:
                self.violations.append(f"{where}: {error}")
                self._fail("malformed")
                return
            if any(isinstance(event, Cleared) for event in events):
                self.violations.append(f"{where}: AllBlocksCleared in a snapshot")
            if any(isinstance(e, Stored) and len(e.block_hashes) != 1 for e in events):
                self.violations.append(f"{where}: a BlockStored of more than one block")
            index.apply(events, where)
        rest = [batch for batch in self._buffer if batch.seq > seq]
        expected = list(range(seq + 1, seq + 1 + len(rest)))
        if [b.seq for b in rest] != expected or any(b.publisher_id != publisher_id for b in rest):
            self._fail("sequence")
            return
        self._index = index
        self.publisher_id = publisher_id
        self.next_seq = seq + 1
        self.state = FOLLOWING
        for batch in rest:
            self._apply_live(batch, "buffered")
        self._buffer.clear()
        self.counters.bootstraps += 1
        self.counters.last_snapshot_seq = seq
        self.counters.last_snapshot_chunks = len(chunks)

    # -- deadlines -----------------------------------------------------------------------

    def _next_deadline(self) -> float:
        deadlines = [float("inf")]
        if self.state != IDLE:
            deadlines.append(self._last_heard + self.silence_s)
        if self._req is not None:
            deadlines.append(self._request_deadline)
        if self._retry_at is not None:
            deadlines.append(self._retry_at)
        return min(deadlines)

    def _check_deadlines(self) -> None:
        now = self.clock()
        if self.state != IDLE and now - self._last_heard >= self.silence_s:
            self._unavailable("silence", None)
            return
        if self._req is not None and now >= self._request_deadline:
            self._fail("timeout")
        elif self._retry_at is not None and now >= self._retry_at:
            self._request()

    def _close_req(self) -> None:
        if self._req is not None:
            self._req.close(linger=0)
            self._req = None
