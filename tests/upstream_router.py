"""A router following one rank of a daemon, two ways over the same batches: kvpubd's client
(``Subscriber``, its ``Mirror``) and vLLM's own decoder types (``KVEventBatch`` of vLLM's
kv_events.py), the latter applied to a strict set of blocks of its own. Blocks are keyed
(medium, hash) as ``tests.upstream_model`` keys them."""

from __future__ import annotations

import time
import types
from dataclasses import dataclass
from typing import Any

import msgspec

from kvpubd.client import ControlClient, Received, Subscriber
from kvpubd.client.mirror import Mirror
from kvpubd.protocol.wire import BlockHash, BlockStored
from kvpubd.tools.launcher import DaemonProcess
from tests.upstream_model import Key

WAIT_S = 20.0  # a deadline for what must happen, never a pause


@dataclass(frozen=True)
class Seen:
    """One batch as vLLM's types decode it: its seq and events in order, as (type name,
    keys) pairs."""

    seq: int
    events: list[tuple[str, list[Key]]]


class Router:
    def __init__(self, daemon: DaemonProcess, vllm_kv: types.ModuleType, host_medium: str) -> None:
        self.subscriber = Subscriber(
            daemon.events_endpoint,
            daemon.replay_endpoint,
            control=daemon.control_endpoint,
            host_medium=host_medium,
        )
        self._decoder = msgspec.msgpack.Decoder(vllm_kv.KVEventBatch)
        self.blocks: set[Key] = set()  # as vLLM's types read the stream
        self.parents: dict[Key, int | None] = {}  # each block's parent hash, as last stored
        self.batches: list[Seen] = []
        self.violations: list[str] = []  # a store repeated, a removal of an unknown block
        self._take(self.subscriber.catch_up())

    def close(self) -> None:
        self.subscriber.close()

    def pump(self, timeout: float = 0.05) -> None:
        self._take(self.subscriber.receive(timeout))

    def until(self, holds: Key, what: str = "") -> None:
        """Receive until ``holds`` is among the blocks: everything published before it is
        applied then (the daemon publishes in order)."""
        deadline = time.monotonic() + WAIT_S
        while holds not in self.blocks:
            assert time.monotonic() < deadline, f"{what or holds} never reached the router"
            self.pump()

    def until_seq(self, seq: int) -> None:
        deadline = time.monotonic() + WAIT_S
        while not self.batches or self.batches[-1].seq < seq:
            assert time.monotonic() < deadline, f"batch {seq} never reached the router"
            self.pump()

    def mirror_blocks(self) -> set[Key]:
        """What kvpubd's client holds."""
        mirror = self.subscriber.mirror()
        assert mirror is not None
        return _keys(mirror)

    def after(self, seq: int) -> list[tuple[str, list[Key]]]:
        """The events of the batches after ``seq``, in order."""
        return [event for batch in self.batches if batch.seq > seq for event in batch.events]

    def _take(self, received: list[Received]) -> None:
        for batch in received:
            self._apply(batch)

    def _apply(self, received: Received) -> None:
        decoded = self._decoder.decode(received.payload)
        events: list[tuple[str, list[Key]]] = []
        for event in decoded.events:
            name = type(event).__name__
            keys = [(getattr(event, "medium", ""), h) for h in getattr(event, "block_hashes", [])]
            events.append((name, keys))
            if name == "AllBlocksCleared":
                self.blocks.clear()
            elif name == "BlockStored":
                self._stored(event, keys)
            else:
                self._removed(keys)
        self.batches.append(Seen(received.seq, events))

    def _stored(self, event: Any, keys: list[Key]) -> None:
        parent = event.parent_block_hash
        for key in keys:
            if key in self.blocks:
                self.violations.append(f"store of live block {key}")
            self.blocks.add(key)
            self.parents[key] = parent
            parent = key[1]
        if len(event.token_ids) != len(keys) * event.block_size:
            self.violations.append(f"store of {len(keys)} blocks with {len(event.token_ids)}")

    def _removed(self, keys: list[Key]) -> None:
        for key in keys:
            if key not in self.blocks:
                self.violations.append(f"removal of unknown block {key}")
            self.blocks.discard(key)


def _keys(mirror: Mirror) -> set[Key]:
    """Every block the mirror holds, of every group (the engine names group 1)."""
    blocks = [*mirror.blocks.items(), *mirror.host_blocks.items()]
    for group in mirror.group_blocks.values():
        blocks += group.items()
    return {(b.medium or "", _u64(h)) for h, b in blocks}


def _u64(block_hash: BlockHash) -> int:
    assert isinstance(block_hash, int), block_hash  # events.hash_format u64
    return block_hash


def snapshot_keys(client: ControlClient, rank: int = 0) -> set[Key]:
    """The daemon's snapshot of the rank, as keys (every event a one-block store)."""
    keys: set[Key] = set()
    for event in client.snapshot(rank).events:
        assert isinstance(event, BlockStored) and len(event.block_hashes) == 1, event
        keys.add((event.medium or "", _u64(event.block_hashes[0])))
    return keys
