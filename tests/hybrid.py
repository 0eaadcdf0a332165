"""A hybrid model's cache for tests over real sockets: its ``cache.groups`` (full attention,
then a sliding window of 64 tokens with a small pool of its own, so that it evicts often), a
random workload of stores, releases and resets, and what a stream of it showed."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvpubd.client import ControlClient, ControlError, Mirror
from kvpubd.protocol.wire import BlockHash
from tests.mirrors import BLOCK_SIZE, store_released, unique_prompt

FULL, WINDOW = 0, 1  # the groups' group_idx
WINDOW_TOKENS = 64
KINDS = {FULL: ("full_attention", None), WINDOW: ("sliding_window", WINDOW_TOKENS)}


def hybrid_cache(num_blocks: int = 24, window_blocks: int = 16) -> dict[str, Any]:
    """The ``cache`` section of a daemon with a full-attention group of ``num_blocks`` and a
    sliding-window group of ``window_blocks``."""
    return {
        "num_blocks": num_blocks,
        "groups": [
            {"kind": "full_attention", "layers": [0]},
            {
                "kind": "sliding_window",
                "sliding_window": WINDOW_TOKENS,
                "layers": [1],
                "num_blocks": window_blocks,
            },
        ],
    }


def group_hashes(mirror: Mirror) -> dict[int, set[BlockHash]]:
    """The hashes each group of a mirror holds (groups holding none left out)."""
    return {group: set(blocks) for group, blocks in mirror.group_blocks.items()}


def random_workload(
    client: ControlClient,
    seed: int,
    steps: int,
    rank: int = 0,
    each_step: Callable[[], object] | None = None,
) -> list[int]:
    """Stores of prompts sharing a few trunks (a prefix of one, then maybe a branch that recurs
    and a partial last block), a quarter of them left open (and computed: their blocks out of
    the window unpinned), releases, and forced resets; a store the pools cannot hold (open
    requests pin them) is refused and skipped. Then every open request is released and
    ``orphan_window_blocks`` ends the run (its prompt returned). ``each_step`` is called
    before every step (a subscriber's receive, to follow the stream live)."""
    rng = random.Random(seed)
    trunks = [unique_prompt(rng.randint(3, 8)) for _ in range(4)]
    open_ids: list[str] = []
    for step in range(steps):
        if each_step is not None:
            each_step()
        roll = rng.random()
        if roll < 0.03:
            client.reset(rank, force=True)
            open_ids.clear()
        elif roll < 0.3 and open_ids:
            client.release(open_ids.pop(rng.randrange(len(open_ids))))
        else:
            trunk = rng.choice(trunks)
            tokens = trunk[: rng.randint(1, len(trunk) // BLOCK_SIZE) * BLOCK_SIZE]
            if rng.random() < 0.4:
                tokens += [rng.randint(1, 4)] * BLOCK_SIZE
            if rng.random() < 0.3:
                tokens += [7] * (BLOCK_SIZE // 2)
            request_id = f"w{seed}-{step}"
            try:
                client.store(request_id, tokens, rank=rank)
            except ControlError as error:
                assert error.code == "pool_exhausted", error
                continue
            if rng.random() < 0.25:
                open_ids.append(request_id)
                # Computed: the window group unpins what fell out of the window.
                client.computed(request_id, len(tokens))
            else:
                client.release(request_id)
    for request_id in open_ids:
        client.release(request_id)
    return orphan_window_blocks(client, rank)


def orphan_window_blocks(client: ControlClient, rank: int = 0) -> list[int]:
    """Leave the window group holding blocks whose parent it let go (of a pool of 16 blocks,
    none pinned): a prompt of 8 blocks, then it extended by 2 (the window group reuses the
    last 4 cached and stores 2), then 10 other blocks. The window group evicts least recently
    released first, the blocks of a request from its last: the 6 blocks it held before, then
    the prompt's first 4, which its 5th block chains from. Returns the extended prompt (the
    full-attention group holds all of it)."""
    first = unique_prompt(8)
    extended = first + unique_prompt(2)
    for tokens in (first, extended, unique_prompt(10)):
        store_released(client, tokens, rank)
    return extended


def as_map(event: msgspec.Struct) -> dict[str, Any]:
    """An event decoded as a struct (kvpubd's or vLLM's), as its map form reads: ``type``
    (the class name) and every field by name."""
    return {"type": type(event).__name__, **msgspec.structs.asdict(event)}


@dataclass
class Coverage:
    """What a hybrid stream showed (from its events in map form, in order): what a consumer
    that keeps groups apart must get right for the run to test it."""

    window_evictions: int = 0
    # Window removals of a hash the full group still held: applied to the wrong group (or to
    # none), they would remove a block the router can still route to.
    shared_evictions: int = 0
    full_evictions: int = 0
    resets: int = 0
    held: dict[int | None, set[BlockHash]] = field(default_factory=dict)

    def see(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            if event["type"] == "AllBlocksCleared":
                self.resets += 1
                self.held.clear()
                continue
            group, hashes = event.get("group_idx"), event["block_hashes"]
            held = self.held.setdefault(group, set())
            if event["type"] == "BlockStored":
                held.update(hashes)
            elif event["type"] == "BlockRemoved":
                held.difference_update(hashes)
                if group == WINDOW:
                    self.window_evictions += 1
                    full = self.held.get(FULL, set())
                    self.shared_evictions += any(h in full for h in hashes)
                elif group == FULL:
                    self.full_evictions += 1

    def assert_complete(self) -> None:
        """The run evicted from both groups (a window block the full group kept among them)
        and was reset after its start-up marker."""
        assert self.shared_evictions and self.full_evictions and self.resets > 1, self


def window_orphans(mirror: Mirror) -> int:
    """Blocks the window group holds under a parent it does not hold (let go, or skipped)."""
    window = mirror.group(WINDOW)
    return sum(
        block.parent_block_hash is not None and block.parent_block_hash not in window
        for block in window.values()
    )
