"""The published record's frozen views: a view yields exactly the blocks published when it was
taken, in publication order, with the data captured for blocks removed (and their ids reused)
while it was open; compaction keeps order and membership and never runs under a view."""

from __future__ import annotations

import random
from unittest.mock import patch

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpubd.daemon import published
from kvpubd.daemon.published import FrozenView, PublishedRecord, ValuedRecord
from kvpubd.daemon.sink import block_record

BLOCKS = 64


class Model:
    """The record as the daemon drives it, beside a plain ordered dict of what is live, and a
    per-block 'data' that changes whenever a block id is reused."""

    def __init__(self, record: PublishedRecord[int] | None = None) -> None:
        self.record: PublishedRecord[int] = PublishedRecord() if record is None else record
        self.live: dict[int, str] = {}  # block id -> data, in publication order
        self.generation = 0

    def data(self, block_id: int) -> str:
        return self.live[block_id]

    def publish(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            self.generation += 1
            self.live[block_id] = f"{block_id}@{self.generation}"
        self.record.add(block_ids)

    def remove(self, block_id: int) -> None:
        assert self.record.discard(block_id)
        del self.live[block_id]

    def remove_named(self, block_ids: list[int], unpublished: list[int]) -> None:
        """The pool's removals: published blocks and never published ones, in one call."""
        names = [f"name{block_id}" for block_id in block_ids + unpublished]
        named = self.record.discard_named(block_ids + unpublished, names)
        assert named == names[: len(block_ids)]
        for block_id in block_ids:
            del self.live[block_id]

    def clear(self) -> None:
        self.record = self.record.successor()
        self.live.clear()


def drain(view: FrozenView[int], model: Model, step: int = 3) -> list[tuple[int, str]]:
    out = []
    while not view.finished:
        for block_id, saved in view.take(step):
            out.append((block_id, saved if saved is not None else model.data(block_id)))
    return out


def test_view_sees_the_state_when_taken_despite_removal_and_reuse() -> None:
    model = Model()
    model.publish([1, 2, 3, 4])
    before = list(model.live.items())
    view = model.record.freeze(model.data)
    assert view is not None and view.count == 4
    model.remove(2)
    model.remove(4)
    model.publish([4, 9])  # id 4 reused with new data, 9 new: neither belongs to the view
    assert drain(view, model) == before
    view.close()
    assert list(model.record) == list(model.live)


def test_removal_after_a_block_was_read_needs_no_capture() -> None:
    model = Model()
    model.publish([5, 6])
    captured: list[int] = []

    def capture(block_id: int) -> str:
        captured.append(block_id)
        return model.data(block_id)

    view = model.record.freeze(capture)
    assert view is not None
    assert [b for b, _ in view.take(1)] == [5]
    model.remove(5)  # already read: no capture
    model.remove(6)  # not yet read: captured now
    assert captured == [6]
    assert [b for b, _ in view.take(10)] == [6]


def test_compaction_waits_for_views_and_keeps_order() -> None:
    model = Model()
    ids = list(range(10_000))
    model.publish(ids)
    for block_id in ids[::2]:
        model.remove(block_id)
    model.publish(ids[::2])  # republished: the log holds 15 000 entries, 10 000 live
    view = model.record.freeze(model.data)
    assert view is not None
    # A view is open: no compaction starts, the view stays valid.
    assert model.record.compact_some(step=10) is True
    assert drain(view, model, step=1000) == list(model.live.items())
    view.close()
    # 30 000 more; the oldest 25 000 entries go (a stale front), then three in four of the
    # last 20 000 (holes in the middle).
    fresh = list(range(100_000, 130_000))
    model.publish(fresh)
    for block_id in [*ids, *fresh[:10_000]]:
        if block_id in model.live:
            model.remove(block_id)
    for block_id in fresh[10_000:]:
        if block_id % 4:
            model.remove(block_id)
    assert model.record.needs_compaction
    refused = 0
    while not model.record.compact_some(step=1000):
        # Publications and removals go on meanwhile. The stale front is trimmed first, a view
        # may be taken between slices; then the holes are left: the log is copied, and no
        # view is taken until that is done.
        view = model.record.freeze(model.data)
        if view is None:
            refused += 1
        else:
            assert drain(view, model, step=500) == list(model.live.items())
            view.close()
        model.publish([20_000 + len(model.live)])
        model.remove(next(iter(model.live)))
    assert refused >= 1
    assert not model.record.needs_compaction
    assert list(model.record) == list(model.live)
    assert len(model.record) == len(model.live)


@settings(max_examples=120, deadline=None)
@given(st.data())
def test_random_histories(data: st.DataObject) -> None:
    """Random interleavings of publications, removals (one, or the pool's bulk removals with
    never published blocks among them), id reuse, views, compaction and clears; with a
    record of any keys and with a pool's (block ids, no hashing, its table shared with the
    records that follow it)."""
    rng = random.Random(data.draw(st.integers(0, 2**32)))
    # Slack 0: every trim, cut and compaction path is taken in a short history.
    slack = data.draw(st.sampled_from([0, 3, published.COMPACT_SLACK]))
    pools = data.draw(st.booleans())
    with patch.object(published, "COMPACT_SLACK", slack):
        model = Model(block_record(BLOCKS) if pools else None)
        views: list[tuple[FrozenView[int], list[tuple[int, str]]]] = []
        free = list(range(BLOCKS))
        for _ in range(data.draw(st.integers(1, 200))):
            action = rng.random()
            if action < 0.45 and free:
                run = [free.pop(rng.randrange(len(free))) for _ in range(rng.randint(1, 3)) if free]
                model.publish(run)
            elif action < 0.7 and model.live:
                block_id = rng.choice(list(model.live))
                model.remove(block_id)
                free.append(block_id)
            elif action < 0.8 and model.live:
                removed = rng.sample(list(model.live), rng.randint(1, min(4, len(model.live))))
                model.remove_named(removed, free[: rng.randint(0, 2)])
                free += removed
            elif action < 0.82:
                for open_view, _expected in views:
                    open_view.close()  # a clear abandons every snapshot under way
                views = []
                free += list(model.live)
                model.clear()
            elif action < 0.9:
                view = model.record.freeze(model.data)
                if view is not None:
                    views.append((view, list(model.live.items())))
            elif views:
                view, expected = views.pop(rng.randrange(len(views)))
                assert drain(view, model) == expected
                view.close()
            else:
                model.record.compact_some(step=rng.randint(1, 50))
            assert len(model.record) == len(model.live)
            assert all((block_id in model.record) == (block_id in model.live) for block_id in free)
        for view, expected in views:
            assert drain(view, model) == expected
            view.close()
        while not model.record.compact_some():
            pass
        assert list(model.record) == list(model.live)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_a_valued_record_finds_each_blocks_value_through_compaction_and_views(
    data: st.DataObject,
) -> None:
    """The relay's record: add_valued publishes a run of new, distinct ids or changes
    nothing; value() finds each live block's value, also while a compaction is half done;
    a view captures a removed block's value through value() (so before it goes)."""
    rng = random.Random(data.draw(st.integers(0, 2**32)))
    # Slack 0: every trim, cut and compaction path is taken in a short history.
    slack = data.draw(st.sampled_from([0, 3, published.COMPACT_SLACK]))
    with patch.object(published, "COMPACT_SLACK", slack):
        record: ValuedRecord[int, str] = ValuedRecord()
        live: dict[int, str] = {}  # id -> value, in publication order
        views: list[tuple[FrozenView[int], list[tuple[int, str]]]] = []
        stores = 0
        for _ in range(data.draw(st.integers(1, 300))):
            action = rng.random()
            if action < 0.45:
                run = [rng.randrange(48) for _ in range(rng.randint(1, 4))]
                stores += 1
                value = f"store {stores}"
                fresh = len(set(run)) == len(run) and not live.keys() & set(run)
                assert record.add_valued(run, value) is fresh
                if fresh:
                    live.update(dict.fromkeys(run, value))
            elif action < 0.7 and live:
                block_id = rng.choice(list(live))
                assert record.discard_named([block_id, -1], [block_id, -1]) == [block_id]
                del live[block_id]
            elif action < 0.75 and live and not views:  # forget: no snapshot reads it
                gone = rng.sample(list(live), min(len(live), 2))
                record.forget([*gone, -1])
                for block_id in gone:
                    del live[block_id]
            elif action < 0.82:
                view = record.freeze(record.value)
                if view is not None:
                    views.append((view, list(live.items())))
            elif action < 0.88 and views:
                view, expected = views.pop(rng.randrange(len(views)))
                got = []
                while not view.finished:
                    got += [(b, s if s is not None else record.value(b)) for b, s in view.take(3)]
                assert got == expected
                view.close()
            else:
                record.compact_some(step=rng.randint(1, 20))
            assert {b: record.value(b) for b in live} == live
            assert len(record) == len(live)
        for view, _ in views:
            view.close()
        while not record.compact_some(step=7):
            assert {b: record.value(b) for b in live} == live
        assert list(record) == list(live)
