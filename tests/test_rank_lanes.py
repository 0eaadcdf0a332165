"""Which connection to a rank's worker the service of rank processes puts each client's
requests on (rank_front): seen at a stand-in worker, a real ROUTER that notes the connection
each request came on and answers when the test says. Small control ops go on the priority
connection and resets on the reset one, where a reset of any client is read next; nothing long
nor deep goes on either."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest
import zmq

from kvpubd.daemon import rank_front
from kvpubd.daemon.hooks import NullMetrics
from kvpubd.daemon.rank_front import PRIORITY_DEPTH, RankFront
from kvpubd.daemon.rank_link import Conn, RankLink
from kvpubd.daemon.settings import Settings
from kvpubd.protocol.control_frames import parse_request
from tests.loop_turns import until

DEADLINE_S = 10.0


@dataclass
class Worker:
    """A stand-in rank worker: the requests it got, by connection, unanswered till told."""

    sock: zmq.Socket[bytes]
    lanes: dict[bytes, str] = field(default_factory=dict)  # routing id -> "bulk", "reset", ...
    got: list[tuple[str, dict[str, Any], list[bytes]]] = field(default_factory=list)
    seen: list[tuple[str, str]] = field(default_factory=list)  # (connection, op), answered too

    def read(self) -> None:
        while self.sock.poll(0):
            identity, correlation, empty, body = self.sock.recv_multipart()
            request = msgpack.unpackb(body)
            if identity not in self.lanes:  # the link's own probe, naming its connection
                self.lanes[identity] = request["lane"]
            self.got.append((self.lanes[identity], request, [identity, correlation, empty]))
            self.seen.append((self.lanes[identity], request.get("op", "?")))

    def has_seen(self, lane: str, op: str) -> bool:
        """Whether a request of ``op`` came on ``lane``, once what came is read."""
        self.read()
        return (lane, op) in self.seen

    def holds(self, count: int) -> bool:
        """Whether ``count`` requests (or more) are here, once what came is read."""
        self.read()
        return len(self.got) >= count

    def on(self, lane: str) -> list[str]:
        return [r.get("op", "?") for which, r, _ in self.got if which == lane]

    def answer_all(self, op: str | None = None) -> None:
        """Answer what is here (only the requests of ``op``, if named)."""
        kept = []
        for entry in self.got:
            _, request, envelope = entry
            if op is not None and request.get("op") != op:
                kept.append(entry)
                continue
            reply = {"ok": True, "id": 0, "ranks": [], "epoch": 1, "paused": False}
            if request.get("op") == "store":
                reply = {"ok": True, "id": 0, "rank": 0, "block_ids": [], "cached_tokens": 0}
            self.sock.send_multipart([*envelope, msgpack.packb(reply)])
        self.got = kept


@dataclass
class Rig:
    front: RankFront
    worker: Worker
    link: RankLink

    def send(self, route: bytes, request: dict[str, Any]) -> None:
        frame = msgpack.packb(request)
        self.front.handle(parse_request(frame, 1 << 30, 1 << 30), None, frame, (route,))


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.bind("inproc://worker")
    worker = Worker(router)
    link = RankLink(context, "inproc://worker", 0)
    link.start()
    # One request on each connection names it to the worker (answered: nothing in flight).
    for conn in Conn:
        link.request(msgpack.packb({"lane": conn.name.lower()}), conn)
    await until(lambda: worker.holds(len(Conn)), "every connection")
    worker.answer_all()
    await until(lambda: link.in_flight == 0, "the probes' replies")
    front = RankFront(Settings(), lambda rank: link, NullMetrics(), epoch=1)
    try:
        yield Rig(front, worker, link)
    finally:
        link.close("test over")
        context.destroy(linger=0)


def store(n: int) -> dict[str, Any]:
    return {"op": "store", "id": n, "request_id": f"r{n}", "token_ids": list(range(16))}


async def test_stores_behind_a_clients_unanswered_stats_wait_and_go_on_the_bulk_connection(
    rig: Rig,
) -> None:
    """They once followed the stats onto the priority connection, and another client's reset
    read there waited behind every one of them."""
    rig.send(b"engine", {"op": "stats", "id": 1})
    for n in range(3):
        rig.send(b"engine", store(n))
    rig.send(b"other", {"op": "reset", "id": 9, "force": True})
    await until(lambda: rig.worker.holds(2), "stats and reset")
    assert rig.worker.on("priority") == ["stats"]
    assert rig.worker.on("reset") == ["reset"]
    assert rig.worker.on("bulk") == []
    rig.worker.answer_all()  # the stats answered: the stores go, in order, on the bulk one
    await until(lambda: rig.worker.holds(3), "the stores")
    assert rig.worker.on("bulk") == ["store"] * 3
    assert [r["request_id"] for _, r, _ in rig.worker.got] == ["r0", "r1", "r2"]


async def test_a_flood_of_small_ops_puts_at_most_priority_depth_on_the_priority_connection(
    rig: Rig,
) -> None:
    for n in range(3 * PRIORITY_DEPTH):
        rig.send(b"flood", {"op": "stats", "id": n})
    for round_ in range(1, 4):  # a round on its way at once, the next once it is answered
        await until(lambda: rig.worker.holds(PRIORITY_DEPTH), "stats")
        rig.worker.read()
        assert rig.worker.on("priority") == ["stats"] * PRIORITY_DEPTH, round_
        rig.worker.answer_all()
    assert rig.worker.on("bulk") == []


async def test_a_reset_held_behind_a_clients_own_stats_goes_on_the_reset_connection(
    rig: Rig,
) -> None:
    """Once the client's stats ahead of it are answered, its reset goes where other clients'
    stores are not ahead of it. It once went on the bulk connection, behind them all."""
    for n in range(3):
        rig.send(b"engine", store(n))
    for n in range(PRIORITY_DEPTH):
        rig.send(b"router", {"op": "stats", "id": n})
    rig.send(b"router", {"op": "reset", "id": 99, "force": True})
    await until(lambda: rig.worker.holds(3 + PRIORITY_DEPTH), "stores and stats")
    rig.worker.answer_all("stats")  # the engine's stores stay unanswered
    await until(lambda: rig.worker.holds(4), "the reset")
    assert rig.worker.on("bulk") == ["store"] * 3
    assert rig.worker.on("reset") == ["reset"]


async def test_a_reset_is_not_queued_behind_another_clients_small_ops(rig: Rig) -> None:
    """A client's stats fill its share of the priority connection, each read in turn with a
    store; another client's reset goes on the reset connection, read next. It once waited
    behind them all on the priority connection: eight turns of the worker's connections."""
    rig.send(b"engine", store(0))
    for n in range(PRIORITY_DEPTH):
        rig.send(b"monitor", {"op": "stats", "id": n})
    rig.send(b"router", {"op": "reset", "id": 99, "force": True})
    await until(lambda: rig.worker.holds(2 + PRIORITY_DEPTH), "the store, stats and reset")
    assert rig.worker.on("priority") == ["stats"] * PRIORITY_DEPTH
    assert rig.worker.on("reset") == ["reset"]


async def test_a_store_held_behind_priority_ops_takes_the_lane_to_the_bulk_connection(
    rig: Rig,
) -> None:
    """Order is kept: the stats after the store follow it onto the bulk connection."""
    rig.send(b"engine", {"op": "stats", "id": 1})
    rig.send(b"engine", store(2))
    rig.send(b"engine", {"op": "stats", "id": 3})
    await until(lambda: rig.worker.holds(1), "the first stats")
    rig.worker.answer_all()
    await until(lambda: rig.worker.holds(2), "the store and the stats")
    assert rig.worker.on("bulk") == ["store", "stats"]


async def test_what_waits_in_the_service_counts_against_the_in_flight_cap(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rank_front, "MAX_IN_FLIGHT", 2 * PRIORITY_DEPTH)
    replies = []
    for n in range(3 * PRIORITY_DEPTH):
        frame = msgpack.packb({"op": "stats", "id": n})
        request = parse_request(frame, 1 << 30, 1 << 30)
        replies.append(rig.front.handle(request, None, frame, (b"flood",)))
    refused = [r for r in replies if isinstance(r, bytes) and b"busy" in r]
    assert len(refused) == PRIORITY_DEPTH  # 8 sent, 8 waiting here, the rest refused


async def test_what_a_lane_holds_is_answered_unavailable_when_its_worker_dies(
    rig: Rig,
) -> None:
    """Every request held behind the ones on their way fails with them, at once, and nothing
    is sent to the worker gone; even thousands of small ops (once sent round by round to the
    closed link, a recursion as deep as the rounds)."""
    count = rank_front.MAX_IN_FLIGHT - 1
    replies = []
    for n in range(count):
        frame = msgpack.packb({"op": "stats", "id": n})
        request = parse_request(frame, 1 << 30, 1 << 30)
        replies.append(rig.front.handle(request, None, frame, (b"flood",)))
    got: list[bytes] = []
    for reply in replies:
        assert not isinstance(reply, bytes)
        reply.then(lambda value, _: got.append(bytes(value or b"")))
    rig.link.close("worker died")
    assert len(got) == count
    assert all(msgpack.unpackb(r)["error"]["code"] == "unavailable" for r in got)
    assert rig.front._held[0] == [0, 0]


async def test_a_dead_clients_store_held_in_its_lane_is_released_after_the_worker_has_it(
    rig: Rig,
) -> None:
    """A client pipelines stats and a store and dies (no grace): its store waits in its lane
    behind the stats. The release for its death once went to the worker at once, ahead of
    the store, which then pinned its blocks for good: this side had forgotten the request."""
    settings = Settings.model_validate({"control": {"orphan_grace_ms": 0}})
    front = RankFront(settings, lambda rank: rig.link, NullMetrics(), epoch=1)
    owner = ("ipc", 4242)
    front.owners.connected(owner)
    for request in ({"op": "stats", "id": 1}, store(2)):
        frame = msgpack.packb(request)
        front.handle(parse_request(frame, 1 << 30, 1 << 30), owner, frame, (b"dies",))
    await until(lambda: rig.worker.holds(1), "the stats")
    front.owners.disconnected(owner)
    for _ in range(3):  # loop turns, counted: the grace of 0 runs out in the next one
        await asyncio.sleep(0)
    rig.worker.answer_all("stats")
    await until(lambda: rig.worker.has_seen("bulk", "store"), "the store")
    rig.worker.answer_all("store")
    await until(lambda: rig.worker.has_seen("bulk", "release"), "the release")
    sent = [op for lane, op in rig.worker.seen if lane == "bulk" and op != "?"]  # not probes
    assert sent == ["store", "release"]
    assert front.open_requests(0) == 0
