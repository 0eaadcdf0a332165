"""One rank's publishing: what was published (a ``History``: seqs, the ring kept for replay,
heartbeats) and how it travels (a ``Transport``, chosen by ``events.publisher``).

Usable as a library over ZeroMQ: ``Publisher.over_zmq(context, endpoint=...).publish(events)``
encodes, numbers and sends one batch and returns its seq; its ``transport.handle_replay()``
answers whatever replay requests are waiting.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import zmq

from kvpubd.daemon.history import History
from kvpubd.daemon.transports import Listener, Transport
from kvpubd.daemon.transports.zmq import ZmqTransport
from kvpubd.protocol.wire import WireFormat

T = TypeVar("T", bound=Transport)


class Publisher(Generic[T]):
    def __init__(self, history: History, transport: T) -> None:
        self.history = history
        self.transport = transport
        history.send = transport.send
        # The history's own methods: nothing in between on the hot path.
        self.publish = history.publish
        self.heartbeat = history.heartbeat

    @classmethod
    def over_zmq(
        cls,
        context: zmq.Context[zmq.Socket[bytes]],
        *,
        endpoint: str,
        replay_endpoint: str = "",
        topic: str = "",
        wire_format: WireFormat = "map",
        rank: int = 0,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        replay_framing: str = "v026",
        linger_ms: int = 2000,
        max_replays: int = 64,
        first_seq: int = 0,
        heartbeat_ms: int = 0,
        overlap: int = 0,
        record_seq: Callable[[int], None] | None = None,
    ) -> Publisher[ZmqTransport]:
        history = History(
            wire_format=wire_format,
            rank=rank,
            buffer_steps=buffer_steps,
            first_seq=first_seq,
            heartbeat_ms=heartbeat_ms,
            overlap=overlap,
            record_seq=record_seq,
        )
        transport = ZmqTransport(
            context,
            history,
            endpoint=endpoint,
            replay_endpoint=replay_endpoint,
            topic=topic,
            hwm=hwm,
            replay_framing=replay_framing,
            linger_ms=linger_ms,
            max_replays=max_replays,
        )
        return Publisher(history, transport)

    @property
    def last_seq(self) -> int:
        """The seq of the last batch sent, ``first_seq - 1`` before the first."""
        return self.history.last_seq

    @property
    def endpoint(self) -> str:
        return self.transport.endpoint

    @property
    def replay_endpoint(self) -> str:
        return self.transport.replay_endpoint

    def listeners(self) -> list[Listener]:
        return self.transport.listeners()

    def start(self) -> None:
        self.transport.start()

    def stop(self) -> None:
        self.transport.stop()

    def close(self, linger_ms: int | None = None) -> None:
        """``linger_ms``: what queued events get at most, where the transport lingers (ZeroMQ's
        PUB socket); None: its own linger."""
        if linger_ms is not None and isinstance(self.transport, ZmqTransport):
            self.transport.shorten_linger(linger_ms)
        self.transport.close()
