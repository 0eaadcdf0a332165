"""The ZeroMQ transport (``events.publisher = "zmq"``, vLLM's ``ZmqEventPublisher``): every
batch on a PUB socket as ``[topic, seq, payload]``, and a ROUTER answering replay requests
from the history's ring.

A replay asks with ``[b"", start_seq]`` and gets each retained batch from ``start_seq`` on,
then the end marker. Replays stream round-robin, a slice per loop turn, so no replay or flood
of requests holds the loop. One whose start the ring no longer holds is parked until a
snapshot batch of the current state is ready (see ``History.snapshot_batch``), then sends
that batch and what followed it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import zmq

from kvpubd.daemon.history import History, SnapshotBatch, Snapshots
from kvpubd.daemon.transports.zmq_snapshot import SnapshotEndpoint
from kvpubd.daemon.zmq_loop import (
    LIVE_AFFINITY,
    REPLAY_AFFINITY,
    BoundedMessages,
    address_share,
    listener,
    peer_address,
    readable,
    reader_fd,
)
from kvpubd.protocol.endpoints import rank_endpoint
from kvpubd.protocol.wire import END_SEQ, pack_seq

if TYPE_CHECKING:
    from kvpubd.daemon.transports.base import Listener, TransportSetup

log = logging.getLogger(__name__)

# A replay request is 8 bytes; anything far larger is abuse. Not less: ZeroMQ's handshake
# (READY, with a routing id of up to 255 bytes) is held to it too.
REPLAY_MAX_MESSAGE_BYTES = 512
REPLAY_CHUNK = 64  # batches one replay sends before the next replay gets a turn
REPLAY_ACCEPT = 32  # replay requests read per loop turn: a flood waits in ZeroMQ, not here
REPLAY_FRAMES = 3  # [identity, b"", start seq]
REPLAY_SLICE_S = 0.0005  # replay work per loop turn
_MORE = int(zmq.SNDMORE)  # a plain int: combining pyzmq's flag enums costs per frame
# pyzmq's compiled send, under the Python ``Socket.send`` that only adds DRAFT sockets' routing
# ids and groups: called directly it costs about half as much per frame (three a batch).
_send_frame = zmq.backend.Socket.send


@dataclass(slots=True, eq=False)  # one replay is one request: compared by identity
class _Replay:
    identity: bytes
    next_seq: int
    address: str = ""  # the peer's (see zmq_loop.peer_address)
    # Set while the replay waits for a snapshot batch (its history is no longer retained).
    snapshot: asyncio.Future[SnapshotBatch] | None = None
    # The seq of the first batch published after it began to wait: the snapshot it waits for
    # is of that moment or later, so the ring keeps what follows from here on.
    parked_at: int = 0

    @property
    def needs_from(self) -> int:
        """The oldest seq this replay may still send from the ring."""
        return self.parked_at if self.snapshot is not None else self.next_seq


class ZmqTransport:
    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        history: History,
        *,
        endpoint: str,
        replay_endpoint: str = "",
        topic: str = "",
        hwm: int = 100_000,
        replay_framing: str = "v026",
        linger_ms: int = 2000,
        max_replays: int = 64,
        snapshot_endpoint: str = "",
        snapshots: Snapshots | None = None,
    ) -> None:
        self.history = history
        self.rank = history.rank
        self.topic = topic.encode()
        self.legacy_replay = replay_framing == "legacy"
        self.replay_requests = 0
        self.replays_refused = 0
        self.max_replays = max_replays
        self._replays: deque[_Replay] = deque()  # streaming, round-robin
        self._waiting: list[_Replay] = []  # waiting for a snapshot batch
        self._by_peer: dict[bytes, _Replay] = {}  # each replay in progress, by its peer
        self._by_address: dict[str, int] = {}  # replays in progress by peer address
        self._pump_scheduled = False
        self._replay_fd: int | None = None
        self.snapshot_server: SnapshotEndpoint | None = None

        self.pub = listener(context.socket(zmq.PUB), LIVE_AFFINITY, context)
        self.pub.setsockopt(zmq.SNDHWM, hwm)
        self.pub.setsockopt(zmq.LINGER, linger_ms)
        self.pub.bind(endpoint)
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)

        self.replay: zmq.Socket[bytes] | None = None
        self._requests = BoundedMessages(REPLAY_FRAMES)
        self.replay_endpoint = ""
        if replay_endpoint:
            self.replay = listener(context.socket(zmq.ROUTER), REPLAY_AFFINITY, context)
            # A full replay (the whole ring, a snapshot batch and the end marker) always fits.
            self.replay.setsockopt(zmq.SNDHWM, 2 * (history.max_retained + 2))
            self.replay.setsockopt(zmq.MAXMSGSIZE, REPLAY_MAX_MESSAGE_BYTES)
            # Errors instead of silent drops: a gone or stalled peer ends its replay early.
            self.replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self.replay.setsockopt(zmq.LINGER, 0)
            # Payloads go without a copy whatever their size (pyzmq copies those under 64 kB
            # even when asked not to): every replay shares the ring's bytes.
            self.replay.copy_threshold = 0
            try:
                self.replay.bind(replay_endpoint)
            except zmq.ZMQError:
                self.close()  # the PUB socket's file must not outlive a failed start
                raise
            self.replay_endpoint = self.replay.getsockopt_string(zmq.LAST_ENDPOINT)

        if snapshot_endpoint:
            if snapshots is None:
                self.close()
                raise ValueError("a snapshot endpoint needs the rank's snapshots")
            try:
                self.snapshot_server = SnapshotEndpoint(
                    context, history, snapshots, snapshot_endpoint
                )
            except (zmq.ZMQError, ValueError):
                self.close()  # the other sockets' files must not outlive a failed start
                raise

    @classmethod
    def from_setup(cls, setup: TransportSetup) -> ZmqTransport:
        events, rank = setup.settings.events, setup.rank
        return cls(
            setup.context,
            setup.history,
            endpoint=rank_endpoint(events.endpoint, rank),
            replay_endpoint=rank_endpoint(events.replay_endpoint, rank)
            if events.replay_endpoint
            else "",
            topic=events.topic,
            hwm=events.hwm,
            replay_framing=events.replay_framing,
            linger_ms=setup.settings.service.linger_ms,
            max_replays=events.max_replays,
            snapshot_endpoint=rank_endpoint(events.snapshot_endpoint, rank)
            if events.snapshot_endpoint
            else "",
            snapshots=setup.snapshots,
        )

    def send(self, seq_frame: bytes, payload: bytes) -> None:
        # PUB never blocks: at the HWM ZeroMQ drops for that subscriber, and replay repairs it.
        pub = self.pub
        _send_frame(pub, self.topic, _MORE)
        _send_frame(pub, seq_frame, _MORE)
        _send_frame(pub, payload)

    def listeners(self) -> list[Listener]:
        found: list[Listener] = [(self.pub, self.endpoint, "events")]
        if self.replay is not None:
            found.append((self.replay, self.replay_endpoint, "replay"))
        if self.snapshot_server is not None and self.snapshot_server.socket is not None:
            found.append((self.snapshot_server.socket, self.snapshot_server.endpoint, "snapshot"))
        return found

    @property
    def snapshot_endpoint(self) -> str:
        return self.snapshot_server.endpoint if self.snapshot_server is not None else ""

    @property
    def snapshot_requests(self) -> int:
        return self.snapshot_server.requests if self.snapshot_server is not None else 0

    @property
    def snapshots_unavailable(self) -> int:
        return self.snapshot_server.unavailable if self.snapshot_server is not None else 0

    @property
    def replays_in_progress(self) -> int:
        """Replays accepted and not finished (streaming, or waiting for a snapshot batch)."""
        return len(self._replays) + len(self._waiting)

    def start(self) -> None:
        """Serve replay (and snapshot) requests from the running loop (readers on the ROUTERs'
        FDs)."""
        if self.snapshot_server is not None:
            self.snapshot_server.start()
        if self.replay is None:
            return
        loop = asyncio.get_running_loop()
        self._replay_fd = reader_fd(self.replay)
        loop.add_reader(self._replay_fd, self._pump)
        self._schedule_pump()  # anything that arrived before the reader existed

    def stop(self) -> None:
        if self.snapshot_server is not None:
            self.snapshot_server.stop()
        if self._replay_fd is not None:
            asyncio.get_running_loop().remove_reader(self._replay_fd)
            self._replay_fd = None

    def _schedule_pump(self) -> None:
        if not self._pump_scheduled:
            self._pump_scheduled = True
            asyncio.get_running_loop().call_soon(self._pump)

    def _pump(self) -> None:
        self._pump_scheduled = False
        if self.handle_replay():
            self._schedule_pump()

    def handle_replay(self, slice_s: float = REPLAY_SLICE_S) -> bool:
        """Take up to REPLAY_ACCEPT waiting requests and stream the replays in progress,
        round-robin, for about ``slice_s`` seconds, without blocking. Returns True while work
        remains: call it again on a later loop turn (no replay or flood holds the loop)."""
        sock = self.replay
        if sock is None:
            return False
        deadline = time.perf_counter() + slice_s
        # A request is 3 frames: REPLAY_ACCEPT of them a turn, read a frame at a time (reading
        # EVENTS after our own sends re-arms the socket's edge-triggered FD).
        for frames, first in self._requests.take(sock, REPLAY_ACCEPT * REPLAY_FRAMES):
            self._accept(frames, peer_address(first))
        while self._replays and time.perf_counter() < deadline:
            replay = self._replays.popleft()
            if not self._stream(sock, replay, REPLAY_CHUNK):
                self._replays.append(replay)
            elif replay.snapshot is None:  # finished (a parked one still holds the ring)
                self._finished(replay)
        more_requests = self._requests.discarding or readable(sock)
        return bool(self._replays) or more_requests

    def _accept(self, frames: list[bytes], address: str = "") -> None:
        # [identity, b"", start_seq]: what a REQ sends (a DEALER sends [b"", start_seq]).
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            log.debug(
                "rank %d: ignored malformed replay request (%d frames)", self.rank, len(frames)
            )
            return
        identity = frames[0]
        # A peer asks again only once it has given up on its answer (a REQ cannot do otherwise;
        # kvpubd's clients then ask from a fresh socket): its new request replaces the old, so
        # one peer never holds more than one of the max_replays slots. One that asked over
        # and over, never reading, held them all, and refused everyone else's.
        self._drop_replay_of(identity)
        # Nor does one address (host, or local process) hold more than its share of them,
        # however many connections it opens.
        share = address_share(self.max_replays)
        if self.replays_in_progress >= self.max_replays or (
            address and self._by_address.get(address, 0) >= share
        ):
            # No reply: the client times out and asks again once the others are served.
            self.replays_refused += 1
            log.debug("rank %d: replay from %s refused: no slot free", self.rank, address)
            return
        self.replay_requests += 1
        replay = _Replay(identity, int.from_bytes(frames[2], "big"), address)
        log.debug("rank %d: replay from seq %d", self.rank, replay.next_seq)
        self._by_peer[identity] = replay
        self._by_address[address] = self._by_address.get(address, 0) + 1
        self.history.hold(replay)
        if not self._wait_for_snapshot(replay):
            self._replays.append(replay)

    def _drop_replay_of(self, identity: bytes) -> None:
        """End the replay in progress of the peer ``identity``, if any, without its end
        marker."""
        old = self._by_peer.get(identity)
        if old is None:
            return
        if old in self._waiting:
            self._waiting.remove(old)
        elif old in self._replays:
            self._replays.remove(old)
        self._finished(old)

    def _finished(self, replay: _Replay) -> None:
        self.history.release(replay)
        if self._by_peer.get(replay.identity) is replay:
            del self._by_peer[replay.identity]
        held = self._by_address.pop(replay.address) - 1
        if held:
            self._by_address[replay.address] = held

    def _wait_for_snapshot(self, replay: _Replay) -> bool:
        """Park a replay whose start the ring no longer holds until a snapshot batch of the
        current state is ready; False when the ring has what it asks for."""
        history = self.history
        if not history.lost(replay.next_seq):
            return False
        replay.snapshot = history.snapshot_batch()
        replay.parked_at = history.next_seq
        self._waiting.append(replay)
        replay.snapshot.add_done_callback(lambda _: self._snapshot_ready(replay))
        return True

    def _snapshot_ready(self, replay: _Replay) -> None:
        if replay in self._waiting:
            self._waiting.remove(replay)
            self._replays.append(replay)
            self._schedule_pump()

    def _stream(self, sock: zmq.Socket[bytes], replay: _Replay, limit: int) -> bool:
        """Send up to ``limit`` batches of ``replay`` (its snapshot batch first, if it waited
        for one); the end marker once it is past the last. Returns True when it leaves the
        queue: finished, or parked until a newer snapshot batch is ready."""
        head = (replay.identity, b"") if self.legacy_replay else (replay.identity, b"", self.topic)
        try:
            snapshot: SnapshotBatch | None = None
            if replay.snapshot is not None:
                batch, replay.snapshot = replay.snapshot, None
                if batch.cancelled() or batch.exception() is not None:
                    return True  # no end marker: the client asks again
                snapshot = batch.result()
                replay.next_seq = snapshot[0] + 1
            if self._wait_for_snapshot(replay):
                # The ring no longer holds what comes next (a snapshot older than the moment
                # the replay parked, or a stream that fell behind the ring's limit): nothing
                # is sent that would leave a gap; the replay waits for a newer snapshot batch,
                # which _snapshot_ready queues (so it leaves the queue here).
                log.debug("rank %d: a replay fell behind the ring", self.rank)
                return True
            if snapshot is not None:
                # Without a copy: every replay shares the one payload.
                seq, snapshot_payload = snapshot
                sock.send_multipart(
                    (*head, pack_seq(seq), snapshot_payload), zmq.NOBLOCK, copy=False
                )
            first, batches = self.history.read(replay.next_seq, limit)
            sent = 0
            for seq_frame, payload in batches:
                for frame in (*head, seq_frame):
                    sock.send(frame, zmq.SNDMORE | zmq.NOBLOCK)
                # A copy per replay let each client that never reads hold a whole ring's
                # worth of daemon memory.
                sock.send(payload, zmq.NOBLOCK, copy=False)
                sent += 1
            replay.next_seq = max(replay.next_seq, first + sent)
            if first + sent < self.history.next_seq:
                return False
            end = head[:2] if self.legacy_replay else (*head[:2], b"")
            sock.send_multipart((*end, END_SEQ, b""), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone or over its HWM: it sees no end marker, asks again
            log.debug("rank %d: replay to a peer stopped: %s", self.rank, exc)
        return True

    def shorten_linger(self, linger_ms: int) -> None:
        """What queued events get at most once closed, whatever linger_ms said."""
        self.pub.setsockopt(zmq.LINGER, linger_ms)

    def close(self) -> None:
        self.stop()
        snapshot_endpoint = self.snapshot_endpoint
        if self.snapshot_server is not None:
            self.snapshot_server.close()
            self.snapshot_server = None
        if self.replay is not None:
            self.replay.close()
            # A pump already scheduled, or a snapshot batch finished later, finds no socket
            # and no replays (they once raised on the closed socket during shutdown).
            self.replay = None
            for replay in (*self._replays, *self._waiting):
                self._finished(replay)
            self._replays.clear()
            self._waiting.clear()
        self.pub.close()
        for endpoint in (self.endpoint, self.replay_endpoint, snapshot_endpoint):
            if endpoint.startswith("ipc://"):
                Path(endpoint.removeprefix("ipc://")).unlink(missing_ok=True)
