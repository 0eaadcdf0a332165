"""A pure-Python radix index over the block hash chain.

Each node is one full block, keyed by its chain digest (the digest encodes the whole prefix, so
a dict lookup per block walks the tree). Only unpinned leaves are evictable, so every cached
block's parent stays cached, and eviction runs tail-first in least-recently-used order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator


class Node:
    __slots__ = ("block_id", "children", "digest", "lora_id", "lora_name", "parent", "refs")

    def __init__(
        self,
        digest: bytes,
        block_id: int,
        parent: Node | None,
        lora_id: int | None,
        lora_name: str | None,
    ) -> None:
        self.digest = digest
        self.block_id = block_id
        self.parent = parent
        self.lora_id = lora_id
        self.lora_name = lora_name
        self.children = 0
        self.refs = 0


class RadixIndex:
    def __init__(self) -> None:
        self._nodes: dict[bytes, Node] = {}
        self._by_block: dict[int, Node] = {}
        # Unpinned leaves, oldest first.
        self._evictable: OrderedDict[Node, None] = OrderedDict()
        self._unpinned = 0

    def __len__(self) -> int:
        return len(self._nodes)

    def __iter__(self) -> Iterator[Node]:
        return iter(self._nodes.values())

    @property
    def unpinned(self) -> int:
        """Cached blocks no request holds: all of them can be evicted, leaves first."""
        return self._unpinned

    def node_for_block(self, block_id: int) -> Node | None:
        return self._by_block.get(block_id)

    def match(self, digests: list[bytes]) -> list[Node]:
        """The cached nodes of the longest cached prefix of ``digests``."""
        nodes = self._nodes
        matched = []
        for digest in digests:
            node = nodes.get(digest)
            if node is None:
                break
            matched.append(node)
        return matched

    def pin(self, nodes: list[Node]) -> None:
        evictable = self._evictable
        for node in nodes:
            if node.refs == 0:
                self._unpinned -= 1
                evictable.pop(node, None)
            node.refs += 1

    def unpin(self, nodes: list[Node]) -> None:
        # Deepest first, so a released chain is evicted tail-first.
        evictable = self._evictable
        for node in reversed(nodes):
            node.refs -= 1
            if node.refs == 0:
                self._unpinned += 1
                if node.children == 0:
                    evictable[node] = None

    def insert(
        self,
        digest: bytes,
        block_id: int,
        parent: Node | None,
        lora_id: int | None,
        lora_name: str | None,
    ) -> Node:
        """Add a block under ``parent`` (which the caller holds pinned); it starts pinned once."""
        node = Node(digest, block_id, parent, lora_id, lora_name)
        node.refs = 1
        if parent is not None:
            parent.children += 1
        self._nodes[digest] = node
        self._by_block[block_id] = node
        return node

    def evict_one(self) -> Node:
        """Remove the least-recently-used unpinned leaf; its parent may become the next."""
        node, _ = self._evictable.popitem(last=False)
        del self._nodes[node.digest]
        del self._by_block[node.block_id]
        self._unpinned -= 1
        parent = node.parent
        if parent is not None:
            parent.children -= 1
            if parent.children == 0 and parent.refs == 0:
                self._evictable[parent] = None
                self._evictable.move_to_end(parent, last=False)
        return node

    def reapable(self) -> tuple[dict, ...]:
        """The containers holding every node, for freeing piecemeal (kvpubd.reaper)."""
        return (self._evictable, self._by_block, self._nodes)

    def clear(self) -> RadixIndex:
        """Empty the index in O(1); returns the old contents so the caller can drop them later."""
        old = RadixIndex()
        old._nodes, self._nodes = self._nodes, {}
        old._by_block, self._by_block = self._by_block, {}
        old._evictable, self._evictable = self._evictable, OrderedDict()
        old._unpinned, self._unpinned = self._unpinned, 0
        return old
