"""EngineFollower against the engines' real publishers (vLLM's and SGLang's own
ZmqEventPublisher, unmodified): order, gaps repaired through the engine's replay socket, gaps
that replay cannot fill, engine restarts, and batches that do not decode."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpubd.upstream.flavours import DECODE_SLICE_BYTES
from kvpubd.upstream.follower import Condition, EngineFollower, FollowedBatch
from tests.upstream_engines import ENGINES, Collector, Engine, Relay, publish_until

pytestmark = pytest.mark.parametrize("flavour", ENGINES)

RESTARTED_KEYS = 10_000  # the restarted engine's batches: told apart from the first's by key


@pytest.fixture
def engine(flavour: str, tmp_path: Path) -> Iterator[Engine]:
    engine = Engine(flavour, tmp_path).start()
    yield engine
    engine.shutdown()


@pytest.fixture
def relay(engine: Engine, tmp_path: Path) -> Iterator[Relay]:
    relay = Relay(engine.endpoint, tmp_path)
    yield relay
    relay.stop()


def follower(
    engine: Engine,
    endpoint: str | None = None,
    replay: bool = True,
    max_replay_batches: int = 20_000,
) -> EngineFollower:
    return EngineFollower(
        endpoint or engine.endpoint,
        engine.replay_endpoint if replay else None,
        flavour="sglang" if engine.flavour == "sglang" else "vllm",
        max_replay_batches=max_replay_batches,
    )


async def across_a_gap(
    engine: Engine, relay: Relay, following: EngineFollower, dropped: int
) -> tuple[list[FollowedBatch], int, int]:
    """``following`` reads ``engine`` through ``relay``; once it has every batch so far, the
    relay drops the next ``dropped`` and one more comes through. The batches given out from
    the first dropped one on, that one's seq, and the batches lost while joining."""
    collector = Collector(following)
    key = await publish_until(engine, collector, lambda: bool(collector.batches), 0)
    await collector.until(lambda: collector.batches[-1].seq == key - 1, "the warm-up")
    lost_joining = following.counters.lost
    first_hole = key
    relay.drop = set(range(first_hole, first_hole + dropped)).__contains__
    for _ in range(dropped + 1):
        engine.publish(key)
        key += 1
    await collector.until(lambda: collector.batches[-1].seq == key - 1, "the last batch")
    await collector.stop()
    return [b for b in collector.batches if b.seq >= first_hole], first_hole, lost_joining


async def across_a_restart(
    engine: Engine, collector: Collector, more_before: int = 0
) -> tuple[list[FollowedBatch], int]:
    """The engine publishes until ``collector`` follows it (and ``more_before`` batches more),
    restarts on the same endpoints and publishes until the follower has its new history: the
    batches given out after the first engine's, and the next key."""
    key = await publish_until(engine, collector, lambda: bool(collector.batches), 0)
    for _ in range(more_before):
        engine.publish(key)
        key += 1
    before = key
    await collector.until(lambda: len(collector.batches) == before, "the first engine's")
    engine.shutdown()
    engine.start()
    key = await publish_until(
        engine, collector, lambda: len(collector.batches) > before, RESTARTED_KEYS
    )
    await collector.until(lambda: len(collector.batches) == before + engine.published, "all")
    await collector.stop()
    return collector.batches[before:], key


def seqs(batches: list[FollowedBatch]) -> list[int]:
    return [b.seq for b in batches]


async def test_every_batch_in_order_from_seq_0(engine: Engine) -> None:
    """A follower that joins while the engine publishes gives out its whole history in order:
    what the SUB socket missed while joining comes from replay, the rest live."""
    collector = Collector(follower(engine))
    key = await publish_until(engine, collector, lambda: bool(collector.batches), 0)
    for _ in range(10):
        engine.publish(key)
        key += 1
    await collector.until(lambda: len(collector.batches) == key, "every batch")
    await collector.stop()
    batches = collector.batches
    assert seqs(batches) == list(range(key))
    assert [b.events for b in batches] == [[engine.expected(k)] for k in range(key)]
    assert {b.condition for b in batches} <= {Condition.NONE, Condition.REPLAYED}
    assert batches[-1].condition == Condition.NONE  # the tail came live
    assert {b.rank for b in batches} == {0}
    counters = collector.follower.counters
    assert (counters.lost, counters.restarts, counters.malformed) == (0, 0, 0)
    assert counters.live + counters.replayed == key


async def test_a_gap_is_repaired_through_replay(engine: Engine, relay: Relay) -> None:
    """Two batches dropped between the engine and the follower come back from the engine's
    replay socket, in their place."""
    collector = Collector(follower(engine, relay.endpoint))
    key = await publish_until(engine, collector, lambda: bool(collector.batches), 0)
    holes = {key + 1, key + 2}
    relay.drop = holes.__contains__
    for _ in range(5):
        engine.publish(key)
        key += 1
    await collector.until(lambda: len(collector.batches) == key, "every batch")
    await collector.stop()
    batches = collector.batches
    assert holes <= set(relay.dropped)
    assert seqs(batches) == list(range(key))
    assert [b.events for b in batches] == [[engine.expected(k)] for k in range(key)]
    assert all(batches[seq].condition == Condition.REPLAYED for seq in holes)
    assert batches[-1].condition == Condition.NONE
    assert collector.follower.counters.lost == 0


async def test_a_gap_replay_cannot_fill_is_reported_lost(flavour: str, tmp_path: Path) -> None:
    """The engine's replay ring holds 2 batches: of the 5 dropped in a row, the last comes
    back (the ring's other one is the live batch that shows the gap) and the first 4 are
    reported lost on it."""
    engine = Engine(flavour, tmp_path, buffer_steps=2).start()
    relay = Relay(engine.endpoint, tmp_path)
    following = follower(engine, relay.endpoint)
    try:
        after, first_hole, lost_joining = await across_a_gap(engine, relay, following, 5)
    finally:
        relay.stop()
        engine.shutdown()
    assert seqs(after) == [first_hole + 4, first_hole + 5]
    assert [b.events for b in after] == [[engine.expected(b.seq)] for b in after]
    assert (after[0].condition, after[0].missing_before) == (
        Condition.REPLAYED | Condition.LOST,
        4,
    )
    assert after[1].condition == Condition.NONE
    assert following.counters.lost == lost_joining + 4


async def test_an_answer_cut_short_is_asked_for_again_from_where_it_stopped(
    flavour: str, tmp_path: Path
) -> None:
    """A gap of 30 batches, and replay answers cut after 7 (the follower's own bound, as an
    answer is cut when the engine's ROUTER drops its tail on the way): each answer's batches
    are given out and the rest asked for again, as long as an answer brings more, so nothing
    the engine still holds is lost."""
    engine = Engine(flavour, tmp_path).start()
    relay = Relay(engine.endpoint, tmp_path)
    following = follower(engine, relay.endpoint, max_replay_batches=7)
    try:
        after, first_hole, lost_joining = await across_a_gap(engine, relay, following, 30)
    finally:
        relay.stop()
        engine.shutdown()
    assert seqs(after) == list(range(first_hole, first_hole + 31))
    assert [b.events for b in after] == [[engine.expected(b.seq)] for b in after]
    assert following.counters.lost == lost_joining
    assert following.counters.replays_repeated >= 30 // 7


async def test_without_a_replay_socket_a_gap_is_lost(engine: Engine, relay: Relay) -> None:
    collector = Collector(follower(engine, relay.endpoint, replay=False))
    key = await publish_until(engine, collector, lambda: bool(collector.batches), 0)
    relay.drop = {key}.__contains__
    for _ in range(2):
        engine.publish(key)
        key += 1
    await collector.until(lambda: collector.batches[-1].seq == key - 1, "the last batch")
    await collector.stop()
    last = collector.batches[-1]
    assert key - 2 not in seqs(collector.batches)
    assert (last.condition, last.missing_before) == (Condition.LOST, 1)


async def test_an_engine_restart_is_detected(engine: Engine) -> None:
    """The engine restarts on the same endpoints, its seqs from 0 again: the follower marks
    the new engine's first batch RESTART and gives out its whole history from seq 0."""
    collector = Collector(follower(engine))
    after, key = await across_a_restart(engine, collector)
    assert seqs(after) == list(range(engine.published))
    assert [b.events for b in after] == [[engine.expected(k)] for k in range(RESTARTED_KEYS, key)]
    assert after[0].condition & Condition.RESTART
    assert after[0].condition & Condition.NEW_ENGINE  # its connection was lost first
    assert not any(b.condition & Condition.RESTART for b in after[1:])
    assert collector.follower.counters.restarts == 1
    assert collector.follower.counters.lost == 0


async def test_seqs_that_go_back_on_a_connection_kept_are_not_a_new_engine_for_certain(
    engine: Engine, relay: Relay
) -> None:
    """The engine restarts behind a relay that keeps the follower's connection, and the new
    engine's seqs reach the follower below the next it expects: RESTART (its history is taken
    again from seq 0), but not NEW_ENGINE, which an engine's seqs going back alone cannot
    tell (a reset's fence stays on: see Relay.restart)."""
    collector = Collector(follower(engine, relay.endpoint))
    after, _ = await across_a_restart(engine, collector, more_before=20)
    assert engine.published < len(collector.batches) - len(after)  # went back
    assert seqs(after) == list(range(engine.published))
    assert after[0].condition & Condition.RESTART
    assert not after[0].condition & Condition.NEW_ENGINE


async def test_a_restart_whose_seqs_passed_ours_is_detected(engine: Engine, relay: Relay) -> None:
    """The follower misses the restart entirely: the new engine's first batch it receives
    has a seq past the next it expects. The replay of its gap starts at the last batch it
    took, which comes back different: a restart, and the new history is taken from seq 0."""
    collector = Collector(follower(engine, relay.endpoint))
    key = await publish_until(engine, collector, lambda: bool(collector.batches), 0)
    before = key
    await collector.until(lambda: len(collector.batches) == before, "the first engine's")
    relay.drop = lambda seq: True
    engine.shutdown()
    engine.start()
    for k in range(RESTARTED_KEYS, RESTARTED_KEYS + before + 3):
        engine.publish(k)
    engine.wait_sent(engine.published - 1)
    relay.drop = lambda seq: False
    key = await publish_until(
        engine, collector, lambda: len(collector.batches) > before, RESTARTED_KEYS + before + 3
    )
    await collector.until(lambda: len(collector.batches) == before + engine.published, "all")
    await collector.stop()
    after = collector.batches[before:]
    assert seqs(after) == list(range(engine.published))
    assert [b.events for b in after] == [[engine.expected(k)] for k in range(RESTARTED_KEYS, key)]
    assert after[0].condition == Condition.REPLAYED | Condition.RESTART | Condition.NEW_ENGINE
    assert collector.follower.counters.restarts == 1


async def test_a_restart_whose_seqs_continue_ours_is_detected(engine: Engine, relay: Relay) -> None:
    """The worst case: the new engine's first batch the follower receives has exactly the seq
    it expects next. Its connection was lost meanwhile (the PUB socket went away and came
    back), so the batch is checked: the replay of the last batch taken comes back different."""
    collector = Collector(follower(engine, relay.endpoint))
    key = await publish_until(engine, collector, lambda: bool(collector.batches), 0)
    for _ in range(200):  # room for the relay to reconnect to the new engine within it
        engine.publish(key)
        key += 1
    before = key
    await collector.until(lambda: len(collector.batches) == before, "the first engine's")
    relay.close_pub()
    relay.drop = lambda seq: seq < before
    engine.shutdown()
    engine.start()
    key, heard = RESTARTED_KEYS, len(relay.received)
    while len(relay.received) == heard:  # until the relay hears the new engine
        engine.publish(key)
        key += 1
        await collector.seen(lambda: len(relay.received) > heard, 0.02)
    assert relay.received[heard] < before, "the relay did not reconnect in time"
    while engine.published < before:
        engine.publish(key)
        key += 1
    relay.open_pub()
    await collector.until(relay.subscribed.is_set, "the follower's subscription")
    engine.publish(key)  # seq `before`: the one the follower expects next
    key += 1
    await collector.until(lambda: len(collector.batches) == before + engine.published, "all")
    await collector.stop()
    after = collector.batches[before:]
    assert seqs(after) == list(range(engine.published))
    assert [b.events for b in after] == [[engine.expected(k)] for k in range(RESTARTED_KEYS, key)]
    assert after[0].condition == Condition.REPLAYED | Condition.RESTART | Condition.NEW_ENGINE
    assert after[-1].condition == Condition.NONE  # the live one, after its history
    assert collector.follower.counters.restarts == 1


async def test_a_batch_that_does_not_decode_is_counted_and_skipped(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """Counted, skipped and logged: one line, however many follow within 10 s (a message
    without a seq was counted only, and an undecodable one logged nowhere)."""
    collector = Collector(follower(engine))
    key = await publish_until(engine, collector, lambda: bool(collector.batches), 0)
    with caplog.at_level(logging.WARNING, "kvpubd.upstream"):
        engine.publish_junk()
        junk_seq = engine.published - 1
        engine.publish_junk()
        engine.publish(key)
        await collector.until(lambda: collector.batches[-1].events == [engine.expected(key)], "it")
    await collector.stop()
    after_junk = collector.batches[-1]
    assert junk_seq not in seqs(collector.batches)
    assert after_junk.seq == junk_seq + 2
    assert after_junk.condition & Condition.LOST and after_junk.missing_before == 2
    assert collector.follower.counters.malformed == 2
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(lines) == 1 and f"batch {junk_seq} does not decode" in lines[0], lines


async def test_a_flood_is_bounded_by_the_high_water_marks_and_repaired(
    flavour: str, tmp_path: Path
) -> None:
    """The engine publishes 1000 batches of 2000 tokens while nothing takes them from the
    follower: the engine's PUB and the follower's SUB socket each hold 10 (their high-water
    marks), ZeroMQ drops the rest, and the follower takes them back from replay, in order."""
    engine = Engine(flavour, tmp_path, hwm=10, block_size=2000).start()
    try:
        follower_ = EngineFollower(
            engine.endpoint,
            engine.replay_endpoint,
            flavour="sglang" if flavour == "sglang" else "vllm",
            rcvhwm=10,
            idle_check=0.2,  # the flood's tail is dropped: nothing later would reveal it
        )
        collector = Collector(follower_)
        key = await publish_until(engine, collector, lambda: bool(collector.batches), 0)
        collector.stop_taking()
        for _ in range(1000):
            engine.publish(key)
            key += 1
        engine.wait_sent(key - 1)
        collector.take()
        await collector.until(lambda: len(collector.batches) == key, "every batch")
        await collector.stop()
    finally:
        engine.shutdown()
    assert seqs(collector.batches) == list(range(key))
    assert [b.events for b in collector.batches] == [[engine.expected(k)] for k in range(key)]
    counters = follower_.counters
    assert counters.replayed > 500  # most were dropped on the way, none is missing
    assert counters.lost == 0


def idle_checking(engine: Engine, relay: Relay) -> Collector:
    """A follower of ``engine`` through ``relay`` that checks the engine when it falls silent."""
    return Collector(
        EngineFollower(
            relay.endpoint,
            engine.replay_endpoint,
            flavour="sglang" if engine.flavour == "sglang" else "vllm",
            idle_check=0.05,
            replay_timeout=0.5,  # the first engine's replay socket is gone for a while
        )
    )


async def test_a_restart_during_a_silence_is_found_by_the_idle_check(
    engine: Engine, relay: Relay
) -> None:
    """No batch of the restarted engine reaches the follower live: the idle check's replay of
    the last batch taken comes back different, and the new engine's history is given out."""
    collector = idle_checking(engine, relay)
    key = await publish_until(engine, collector, lambda: bool(collector.batches), 0)
    before = key
    await collector.until(lambda: len(collector.batches) == before, "the first engine's")
    relay.drop = lambda seq: True
    engine.shutdown()
    engine.start()
    for k in range(RESTARTED_KEYS, RESTARTED_KEYS + before + 2):
        engine.publish(k)
    await collector.until(lambda: len(collector.batches) == before + engine.published, "all")
    await collector.stop()
    after = collector.batches[before:]
    assert seqs(after) == list(range(engine.published))
    assert [b.events for b in after] == [
        [engine.expected(k)] for k in range(RESTARTED_KEYS, RESTARTED_KEYS + before + 2)
    ]
    assert after[0].condition == Condition.REPLAYED | Condition.RESTART | Condition.NEW_ENGINE
    assert all(b.condition == Condition.REPLAYED for b in after[1:])
    assert collector.follower.counters.restarts == 1


async def test_a_restart_with_fewer_batches_during_a_silence_is_found(
    engine: Engine, relay: Relay
) -> None:
    """The restarted engine has published fewer batches than the first one, none of them
    received live: after the lost connection, the idle check's replay from the last batch
    taken comes back empty, which the same engine never answers (its ring always holds its
    newest batch); the new engine's history is given out from its seq 0."""
    collector = idle_checking(engine, relay)
    key = await publish_until(engine, collector, lambda: bool(collector.batches), 0)
    for _ in range(5):
        engine.publish(key)
        key += 1
    before = key
    await collector.until(lambda: len(collector.batches) == before, "the first engine's")
    relay.drop = lambda seq: True
    relay.close_pub()
    engine.shutdown()
    engine.start()
    relay.open_pub()
    engine.publish(RESTARTED_KEYS)  # seq 0, far below the follower's last
    await collector.until(lambda: len(collector.batches) == before + 1, "the new engine's")
    await collector.stop()
    (after,) = collector.batches[before:]
    assert (after.seq, after.events) == (0, [engine.expected(RESTARTED_KEYS)])
    assert after.condition == Condition.REPLAYED | Condition.RESTART | Condition.NEW_ENGINE
    assert collector.follower.counters.restarts == 1


async def test_a_message_over_the_payload_limit_loses_that_batch_and_no_more(
    engine: Engine,
) -> None:
    """The engine publishes one batch larger than max_payload_bytes. ZeroMQ closes the
    connection on it (a protocol error) and, unlike after a connection error, never connects
    again: the follower heard nothing more of the engine. It connects again itself; the
    batch, over the limit from replay too, is lost, and the engine is followed on."""
    limit = 1 << 16
    collector = Collector(
        EngineFollower(
            engine.endpoint,
            engine.replay_endpoint,
            flavour="sglang" if engine.flavour == "sglang" else "vllm",
            max_payload_bytes=limit,
        )
    )
    key = await publish_until(engine, collector, lambda: bool(collector.batches), 0)
    await collector.until(lambda: collector.batches[-1].seq == key - 1, "the warm-up")
    vllm_only = {"medium": "GPU", "lora_name": None} if engine.flavour == "vllm" else {}
    big = engine.kv.BlockStored(
        block_hashes=list(range(1, limit // 4)),
        parent_block_hash=None,
        token_ids=[7] * (limit // 2),
        block_size=2,
        lora_id=None,
        **vllm_only,
    )
    big_seq = engine.publish_events([big])
    # Until the follower has every batch after it (one it missed while connecting again is
    # repaired by the next).
    await publish_until(
        engine, collector, lambda: collector.batches[-1].seq == engine.published - 1, key
    )
    await collector.stop()
    after = [b for b in collector.batches if b.seq > big_seq]
    assert big_seq not in seqs(collector.batches)
    # Lost with it: what a repair's answer held behind it (the answer ends there too).
    assert after[0].condition & Condition.LOST and after[0].missing_before >= 1
    assert seqs(after) == list(range(after[0].seq, engine.published))
    assert collector.follower.counters.reconnects >= 1


async def test_a_large_batch_is_decoded_a_slice_per_loop_turn(engine: Engine) -> None:
    """A batch of several megabytes took one step of the loop to decode (2 to 7 ms a megabyte),
    and a reset waited behind it: it goes a slice of DECODE_SLICE_BYTES per loop turn, and
    comes out whole."""
    collector = Collector(follower(engine))
    key = await publish_until(engine, collector, lambda: bool(collector.batches), 0)
    await collector.until(lambda: collector.batches[-1].seq == key - 1, "the warm-up")
    counters = collector.follower.counters
    vllm_only = {"medium": "GPU", "lora_name": None} if engine.flavour == "vllm" else {}
    events = [
        engine.kv.BlockStored(
            block_hashes=[1_000_000 + i],
            parent_block_hash=None,
            token_ids=list(range(i, i + 64)),
            block_size=64,
            lora_id=None,
            **vllm_only,
        )
        for i in range(20_000)
    ]
    before = counters.decoded_bytes
    big_seq = engine.publish_events(events)
    per_turn = []
    while not collector.batches or collector.batches[-1].seq != big_seq:
        decoded = counters.decoded_bytes
        await asyncio.sleep(0)
        per_turn.append(counters.decoded_bytes - decoded)
        assert len(per_turn) < 10_000_000, "the batch never came out"
    await collector.stop()
    assert counters.decoded_bytes - before > 3 * 2**20  # megabytes of events
    assert max(per_turn) <= DECODE_SLICE_BYTES, max(per_turn)
    assert len(collector.batches[-1].events) == len(events)
