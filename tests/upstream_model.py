"""An engine's true KV state, kept beside its real publisher (``tests.upstream_engines.Engine``).

``EngineModel`` makes the engine's events in the engine's own types (vLLM's or SGLang's
kv_events module), publishes them through its own ``ZmqEventPublisher`` and keeps what the
engine holds after each batch: its blocks by (medium, hash as a router reads it, u64). Blocks
form chains (a store names its parent, held by the engine, as an engine's prefix does); the
engine evicts leaves first, as vLLM's free queue does.

``visible`` is what kvpubd should publish: the engine's blocks, less those a reset or a loss
made kvpubd forget (``forget``) and the engine has not stored again since, and less those
stored under a parent it does not publish (on no medium).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Literal

from tests.upstream_engines import Engine

MASK64 = (1 << 64) - 1
BLOCK_SIZE = 16  # Dynamo's indexer in tests/test_dynamo.py is started with this block size
GROUP = 0  # vLLM's group_idx of every event (SGLang sends none)
HashKind = Literal["bytes", "int", "signed"]
Key = tuple[str, int]  # medium as kvpubd publishes it, block hash as a router reads it (u64)


def routed(raw: bytes | int) -> int:
    """The engine's hash as a u64 router reads it: an int's low 64 bits (vLLM's
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, SGLang's signed hashes), bytes' last 8."""
    return int.from_bytes(raw[-8:], "big") if isinstance(raw, bytes) else raw & MASK64


@dataclass(frozen=True)
class Block:
    raw: bytes | int  # the hash as the engine publishes it
    tokens: tuple[int, ...]
    parent: Key | None


class EngineModel:
    """One engine rank and its true state. Every method that makes events updates the state
    as the engine's would once the batch holding them is published (``publish``)."""

    def __init__(self, engine: Engine, seed: int, hashes: HashKind | None = None) -> None:
        self.engine = engine
        self.rng = random.Random(seed)
        self.hashes: HashKind = hashes or ("signed" if engine.flavour == "sglang" else "bytes")
        # SGLang's host tier is CPU_PINNED, vLLM's CPU (kvpubd renames neither by default).
        self.host_medium = "CPU_PINNED" if engine.flavour == "sglang" else "CPU"
        self.held: dict[Key, Block] = {}
        self.visible: set[Key] = set()
        self.repeated = 0  # blocks stored again while held (kvpubd must not repeat them)
        self.unknown_removed = 0  # removals of blocks never stored (kvpubd must drop them)

    # -- the engine's batches -----------------------------------------------------------------

    def publish(self, *events: Any) -> int:
        """One batch of the engine's publisher; returns its seq."""
        return self.engine.publish_events(list(events))

    def restart(self) -> None:
        """The engine process starts again: its publisher's seqs from 0, no block held."""
        self.engine.shutdown()
        self.engine.start()
        self.held.clear()
        self.visible.clear()

    def forget(self) -> None:
        """kvpubd voids what it published of this engine (a reset, or lost batches)."""
        self.visible.clear()

    # -- events ------------------------------------------------------------------------------

    def new_chain(self, length: int, parent: Key | None = None, medium: str = "GPU") -> Any:
        """A store of ``length`` blocks never stored before, under ``parent``."""
        blocks = []
        for _ in range(length):
            tokens = tuple(self.rng.randrange(50_000) for _ in range(BLOCK_SIZE))
            blocks.append((self._new_hash(), tokens))
        return self._store(blocks, parent, medium)

    def reuse(self, key: Key, extend: int = 0) -> Any:
        """The store an engine publishes again for a prefix hit: the held chain ending at
        ``key`` (already held: nothing changes), then ``extend`` new blocks."""
        blocks = [(b.raw, b.tokens) for b in self.chain(key)]
        for _ in range(extend):
            tokens = tuple(self.rng.randrange(50_000) for _ in range(BLOCK_SIZE))
            blocks.append((self._new_hash(), tokens))
        return self._store(blocks, None, key[0])

    def chain(self, key: Key) -> list[Block]:
        """The held blocks from the root to ``key`` (a prompt's, as ``store_chain`` takes)."""
        chain = [self.held[key]]
        while (parent := chain[-1].parent) is not None:
            chain.append(self.held[parent])
        return chain[::-1]

    def store_chain(self, blocks: list[Block], parent: Key | None = None) -> Any:
        """A store of these blocks (hashes and tokens as before) under ``parent`` (None: from
        the root): the same prompt served again, e.g. by a restarted engine."""
        return self._store([(b.raw, b.tokens) for b in blocks], parent, "GPU")

    def offload(self, key: Key) -> Any:
        """A copy of a held device block on the host tier (same hash, another medium)."""
        block = self.held[key]
        return self._store([(block.raw, block.tokens)], None, self.host_medium)

    def remove(self, keys: list[Key]) -> Any:
        """A removal of held blocks of one medium (evictions)."""
        medium = keys[0][0]
        assert all(k[0] == medium and k in self.held for k in keys), keys
        raws = [self.held.pop(k).raw for k in keys]
        self.visible.difference_update(keys)
        return self._removed(raws, medium)

    def remove_unknown(self) -> Any:
        """A removal of a block the engine never stored (nothing changes)."""
        self.unknown_removed += 1
        return self._removed([self._new_hash()], "GPU")

    def cleared(self) -> Any:
        """The engine's own AllBlocksCleared."""
        self.held.clear()
        self.visible.clear()
        return self.engine.kv.AllBlocksCleared()

    # -- choosing what to do --------------------------------------------------------------------

    def leaves(self, medium: str = "GPU") -> list[Key]:
        """Held blocks of ``medium`` that no held block names as parent (evicted first)."""
        parents = {b.parent for b in self.held.values()}
        return [k for k in self.held if k[0] == medium and k not in parents]

    def parent_hash(self, key: Key) -> int | None:
        parent = self.held[key].parent
        return None if parent is None else parent[1]

    def device_blocks(self) -> list[Key]:
        return [k for k in self.held if k[0] == "GPU"]

    def random_events(self, count: int, host_tier: bool = True) -> list[Any]:
        """``count`` events an engine publishes as it serves: new prompts, prefix hits
        (stores repeated), evictions (leaves first), host tier copies, and a removal of a
        block it never published."""
        events = []
        for _ in range(count):
            device = self.device_blocks()
            roll = self.rng.random()
            if not device or roll < 0.35:
                parent = self.rng.choice(device) if device and self.rng.random() < 0.5 else None
                events.append(self.new_chain(self.rng.randint(1, 3), parent))
            elif roll < 0.55:
                events.append(self.reuse(self.rng.choice(device), self.rng.randint(0, 2)))
            elif roll < 0.85:
                leaves = self.leaves()
                events.append(self.remove(self.rng.sample(leaves, min(len(leaves), 2))))
            elif roll < 0.95 and host_tier:
                hosted = {k[1] for k in self.held if k[0] == self.host_medium}
                fresh = [k for k in device if k[1] not in hosted]
                if fresh:
                    events.append(self.offload(self.rng.choice(fresh)))
                elif hosted:
                    host = [k for k in self.held if k[0] == self.host_medium]
                    events.append(self.remove([self.rng.choice(host)]))
            else:
                events.append(self.remove_unknown())
        return events

    def _visible_hash(self, block_hash: int) -> bool:
        """kvpubd publishes a block only under a parent it published, on any medium."""
        return any(h == block_hash for _, h in self.visible)

    # -- in the engine's own types ----------------------------------------------------------

    def _new_hash(self) -> bytes | int:
        if self.hashes == "bytes":
            return self.rng.randbytes(32)  # vLLM's default: sha256 digests
        if self.hashes == "int":
            return self.rng.getrandbits(64)
        return self.rng.getrandbits(64) - (1 << 63)  # SGLang: signed 64-bit

    def _store(
        self, blocks: list[tuple[bytes | int, tuple[int, ...]]], parent: Key | None, medium: str
    ) -> Any:
        parent_raw = None if parent is None else self.held[parent].raw
        above = parent
        for raw, tokens in blocks:
            key = (medium, routed(raw))
            if key in self.held:
                self.repeated += 1
            else:
                self.held[key] = Block(raw, tokens, above)
            if above is None or self._visible_hash(above[1]):
                self.visible.add(key)
            above = key
        hashes = [raw for raw, _ in blocks]
        token_ids = [t for _, block_tokens in blocks for t in block_tokens]
        kv = self.engine.kv
        if self.engine.flavour == "sglang":
            return kv.BlockStored(
                block_hashes=hashes,
                parent_block_hash=parent_raw,
                token_ids=token_ids,
                block_size=BLOCK_SIZE,
                lora_id=None,
                medium=None if medium == "GPU" else medium,  # SGLang omits its device's
            )
        return kv.BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent_raw,
            token_ids=token_ids,
            block_size=BLOCK_SIZE,
            lora_id=None,
            medium=medium,
            lora_name=None,
            group_idx=GROUP,
            session_id="request-1",  # vLLM's field that kvpubd does not carry
        )

    def _removed(self, raws: list[bytes | int], medium: str) -> Any:
        kv = self.engine.kv
        if self.engine.flavour == "sglang":
            return kv.BlockRemoved(block_hashes=raws, medium=None if medium == "GPU" else medium)
        return kv.BlockRemoved(block_hashes=raws, medium=medium, group_idx=GROUP)
