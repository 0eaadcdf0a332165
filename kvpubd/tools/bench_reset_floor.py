"""The floor of the per-rank reset measurement: the same fan-out in bare pyzmq, no daemon.

A service of rank processes takes a reset on its control socket, sends it to every rank's
worker, and each worker publishes its marker on the rank's PUB socket; a watcher process per
rank reads that stream. The floor has the same processes and hops and nothing else: a front
process (ROUTER towards the bench, ROUTER towards the ranks), a process per rank (a DEALER to
the front, a PUB bound on its own endpoint) that publishes one marker batch per trigger, and
the bench's own watcher process per rank. Its latency is what this host gives any Python
program of that shape: wakeups of some 3 x ranks threads on an otherwise idle (or loaded)
machine, nothing of kvpubd's. ``bench throughput --fill-blocks`` times it beside kvpubd, a
round of each in turn, so both see the same moments of the host."""

from __future__ import annotations

import shutil
import tempfile
from contextlib import ExitStack, suppress
from typing import Any

import zmq

from kvpubd.tools.bench_children import answer, start_child

MARKER_PAYLOAD = b"AllBlocksCleared"  # what the watchers look for (a byte search)


def floor_front(client_endpoint: str, ranks_endpoint: str, ranks: int, pipe: Any) -> None:
    """The front: each request from the bench goes to every rank; once every rank has
    answered with its marker's seq, the seqs (8 bytes each, in rank order) are the reply."""
    ctx = zmq.Context()
    client = ctx.socket(zmq.ROUTER)
    client.bind(client_endpoint)
    links = ctx.socket(zmq.ROUTER)
    links.bind(ranks_endpoint)
    poller = zmq.Poller()
    poller.register(client, zmq.POLLIN)
    poller.register(links, zmq.POLLIN)
    poller.register(pipe.fileno(), zmq.POLLIN)
    joined: set[bytes] = set()
    asking: list[bytes] | None = None
    seqs: dict[bytes, bytes] = {}
    pipe.send("bound")
    while True:
        # A ROUTER drops what it sends to a peer not yet connected: requests wait (polled
        # every 10 ms) until every rank has said hello.
        ready = dict(poller.poll(1000 if len(joined) == ranks else 10))
        if pipe.fileno() in ready and pipe.recv() is None:
            break
        if links in ready:
            while links.poll(0):
                identity, body = links.recv_multipart()
                if body == b"hello":
                    joined.add(identity)
                elif asking is not None:
                    seqs[identity] = body
        if asking is None and len(joined) == ranks and client.poll(0):
            asking = client.recv_multipart()[:-1]  # its envelope
            seqs = {}
            for rank in range(ranks):
                links.send_multipart([_rank_identity(rank), b"reset"])
        if asking is not None and len(seqs) == ranks:
            reply = b"".join(seqs[_rank_identity(rank)] for rank in range(ranks))
            client.send_multipart([*asking, reply])
            asking = None
    ctx.destroy(linger=0)


def floor_rank(ranks_endpoint: str, events_endpoint: str, rank: int, pipe: Any) -> None:
    """A rank: on each trigger from the front, one marker batch (topic, seq, payload) on its
    PUB socket, then the seq back to the front."""
    ctx = zmq.Context()
    link = ctx.socket(zmq.DEALER)
    link.setsockopt(zmq.IDENTITY, _rank_identity(rank))
    link.connect(ranks_endpoint)
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind(events_endpoint)
    link.send(b"hello")
    poller = zmq.Poller()
    poller.register(link, zmq.POLLIN)
    poller.register(pipe.fileno(), zmq.POLLIN)
    seq = 0
    pipe.send("bound")
    while True:
        ready = dict(poller.poll(1000))
        if pipe.fileno() in ready and pipe.recv() is None:
            break
        if link in ready:
            link.recv()
            seq += 1
            seq_frame = seq.to_bytes(8, "big")
            pub.send_multipart([b"", seq_frame, MARKER_PAYLOAD])
            link.send(seq_frame)
    ctx.destroy(linger=0)


def _rank_identity(rank: int) -> bytes:
    return b"rank-%d" % rank


class ResetFloor:
    """The floor's processes, started in ``stack``; ``watch`` starts a watcher process per
    rank on its endpoints (the bench's own watcher, as it reads kvpubd's streams)."""

    def __init__(self, stack: ExitStack, ranks: int, watch: Any) -> None:
        folder = tempfile.mkdtemp(prefix="kvpubd-floor-")
        stack.callback(shutil.rmtree, folder, ignore_errors=True)
        self.ranks = ranks
        client_endpoint = f"ipc://{folder}/front"
        ranks_endpoint = f"ipc://{folder}/ranks"
        events = [f"ipc://{folder}/events-{rank}" for rank in range(ranks)]
        self._children = [start_child(stack, floor_front, client_endpoint, ranks_endpoint, ranks)]
        self._children += [
            start_child(stack, floor_rank, ranks_endpoint, events[rank], rank)
            for rank in range(ranks)
        ]
        for pipe in self._children:
            if answer(pipe, "a reset-floor process", 60) != "bound":
                raise RuntimeError("a reset-floor process did not start")
        self.watchers = [watch(endpoint) for endpoint in events]
        self._ctx = zmq.Context()
        stack.callback(self._ctx.destroy, 0)
        self._client = self._ctx.socket(zmq.DEALER)
        self._client.connect(client_endpoint)
        for pipe in self._children:
            stack.callback(_stop, pipe)

    def reset(self, timeout_s: float) -> list[int]:
        """One fan-out: the marker seq of every rank, in rank order."""
        self._client.send(b"reset")
        if not self._client.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"the reset floor's front did not answer in {timeout_s:g} s")
        reply = self._client.recv()
        return [int.from_bytes(reply[i : i + 8], "big") for i in range(0, len(reply), 8)]


def _stop(pipe: Any) -> None:
    with suppress(OSError):  # it ended already
        pipe.send(None)
