"""The radix index against a plain reference model: same eviction order, same survivors.

The model keeps the documented rule in the most literal form: unpinned leaves queue oldest
first; evicting one makes a parent left without children and pins the next in line."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpubd.daemon.radix import ROOT, RadixIndex


@dataclass
class Model:
    parent: dict[int, int] = field(default_factory=dict)
    refs: dict[int, int] = field(default_factory=dict)
    queue: list[int] = field(default_factory=list)  # unpinned leaves, oldest first

    def children(self, block: int) -> int:
        return sum(1 for p in self.parent.values() if p == block)

    def insert(self, blocks: list[int], parent: int) -> None:
        for block in blocks:
            self.parent[block] = parent
            self.refs[block] = 1
            parent = block

    def unpin(self, blocks: list[int]) -> None:
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0 and self.children(block) == 0:
                self.queue.append(block)

    def evict(self, count: int) -> list[int]:
        out = []
        for _ in range(count):
            block = self.queue.pop(0)
            parent = self.parent.pop(block)
            del self.refs[block]
            out.append(block)
            if parent != ROOT and self.children(parent) == 0 and self.refs[parent] == 0:
                self.queue.insert(0, parent)
        return out


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 6), st.booleans(), st.integers(0, 5)),
        min_size=1,
        max_size=30,
    )
)
def test_eviction_matches_the_reference_model(steps: list[tuple[int, bool, int]]) -> None:
    """Chains stored (some under a cached block), released, then evictions of various sizes:
    the index evicts exactly the blocks, in exactly the order, the model does."""
    capacity = 256
    index, model = RadixIndex(capacity), Model()
    free = list(range(capacity))
    for chain, extend, evict in steps:
        count = min(evict, sum(1 for r in model.refs.values() if r == 0))
        freed = model.evict(count)
        assert index.evict(count) == freed
        free.extend(freed)
        parent = ROOT
        if extend and model.parent:
            parent = max(model.parent)  # an existing block: pin it while extending
            index.pin([parent])
            model.refs[parent] += 1
            if parent in model.queue:
                model.queue.remove(parent)
        blocks = [free.pop(0) for _ in range(chain)]
        digests = [b"%d-%d" % (block, len(model.parent)) for block in blocks]
        index.insert_run(digests, blocks, parent, None)
        model.insert(blocks, parent)
        index.match(digests)
        release = blocks if parent == ROOT else [parent, *blocks]
        index.unpin(release)
        model.unpin(release)
        assert index.unpinned == sum(1 for r in model.refs.values() if r == 0)
    assert len(index) == len(model.parent)
