"""The reset contract (docs/architecture.md), against a real daemon: one marker per reset, in
order after everything captured before it, on the wire before the reply (even while paused,
even with the capture cap exhausted), kept by replay, per rank, refused while blocks are
pinned unless forced.

"Nothing was published" is always shown with a later known event as a fence: the next batch
after the last seen seq is that event, at seq + 1."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import zmq

from kvpubd.client import ControlClient, ControlError, Marker, Mirror, Received, StoreReply
from kvpubd.protocol.endpoints import rank_endpoint
from kvpubd.protocol.wire import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    pack_seq,
    unpack_seq,
)
from tests.daemon import Daemon
from tests.streams import (
    BLOCK_SIZE,
    Tap,
    chain_hashes,
    flat_events,
    is_marker,
    prompt,
    seq_key,
    seq_of,
    stores,
    vllm_extra_keys,
)

StartDaemon = Callable[..., Daemon]


@contextmanager
def live(daemon: Daemon, **sub_kwargs: Any) -> Iterator[tuple[ControlClient, Tap]]:
    """A control client and a Tap whose SUB sockets are proven live on every rank."""
    with daemon.client() as client, daemon.subscriber(**sub_kwargs) as sub:
        tap = Tap(sub, daemon.ranks)
        tap.go_live(client)
        yield client, tap


def store_released(
    client: ControlClient, request_id: str, tokens: list[int], **kw: Any
) -> StoreReply:
    reply = client.store(request_id, tokens, **kw)
    client.release(request_id)
    return reply


def fence(client: ControlClient, tap: Tap, seed: int, rank: int = 0, blocks: int = 1) -> None:
    """Store a fresh prompt (drain running) and receive until its BlockStored arrives."""
    tap.store_seen(client, f"fence-{seed}", prompt(seed, blocks), rank=rank)


def marker_count(batches: list[Received]) -> int:
    return sum(1 for b in batches for e in b.batch.events if is_marker(e))


def assert_gap_free(batches: list[Received], after: int) -> None:
    assert [b.seq for b in batches] == list(range(after + 1, after + 1 + len(batches)))


# -- 1. one marker per reset -----------------------------------------------------------------


def test_each_reset_publishes_exactly_one_marker_in_the_replied_batch(
    start_daemon: StartDaemon,
) -> None:
    """Exactly one AllBlocksCleared per reset, in the batch whose seq the reply names, whether
    the reset finds nothing captured, a published store, or a store still pending."""
    daemon = start_daemon()
    with live(daemon) as (client, tap):
        for case in range(3):
            before = tap.last_seq()
            if case == 1:  # something published (and cached) before the reset
                tap.store_seen(client, f"pub-{case}", prompt(case + 1, 2))
                before = tap.last_seq()
            if case == 2:  # something captured but still pending at the reset
                client.pause()
                store_released(client, f"pend-{case}", prompt(case + 1, 2))
            markers = client.reset().markers
            if case == 2:
                client.resume()
            assert len(markers) == 1 and markers[0].rank == 0
            marker_seq = markers[0].seq
            assert marker_seq == before + 1
            fence(client, tap, seed=100 + case)
            batches = tap.after(0, before)
            assert_gap_free(batches, before)
            assert marker_count(batches) == 1
            marker_batch = tap.batch(0, marker_seq)
            assert marker_count([marker_batch]) == 1
            assert is_marker(marker_batch.batch.events[-1])


# -- 2. order ----------------------------------------------------------------------------------


def test_events_captured_before_reset_leave_before_marker_and_none_after_name_old_blocks(
    start_daemon: StartDaemon,
) -> None:
    """Stores and evictions captured (pending, drain paused) before a reset are published before
    its marker; after the marker no BlockRemoved names a pre-reset block and no store has a
    pre-reset parent, even when a pre-reset prefix is stored again and evictions follow."""
    daemon = start_daemon(cache={"num_blocks": 8})
    with live(daemon) as (client, tap):
        # go_live left one probe block cached (published, unpinned, the oldest leaf).
        probe = stores(tap.history)[-1].block_hashes
        before = tap.last_seq()
        a, b, c = prompt(1, 3), prompt(2, 3), prompt(3, 3)
        ha, hb, hc = chain_hashes(a), chain_hashes(b), chain_hashes(c)

        client.pause()
        store_released(client, "a", a)
        store_released(client, "b", b)
        # 1 probe + 3 + 3 = 7 of 8 blocks: C needs 3, so the probe and A's tail are evicted.
        store_released(client, "c", c)
        [marker] = client.reset().markers

        # After the reset (still paused): A again, extended by two blocks; then E; then F
        # needs evictions, which can only hit blocks stored after the reset.
        ad = a + prompt(4, 2)
        e, f = prompt(5, 3), prompt(6, 2)
        had, he, hf = chain_hashes(ad), chain_hashes(e), chain_hashes(f)
        assert store_released(client, "ad", ad).num_cached_tokens == 0
        store_released(client, "e", e)
        store_released(client, "f", f)
        client.resume()
        tap.until(lambda: tap.stored_seen(hf[0]), what="the store of F")

        events = flat_events(tap.after(0, before))
        at = [i for i, (_, event) in enumerate(events) if is_marker(event)]
        assert len(at) == 1, "exactly one marker"
        assert events[at[0]][0] == marker.seq
        pre = [event for _, event in events[: at[0]]]
        post = [event for _, event in events[at[0] + 1 :]]

        assert pre == [
            BlockStored(ha, None, a, BLOCK_SIZE, None, "CPU", None),
            BlockStored(hb, None, b, BLOCK_SIZE, None, "CPU", None),
            BlockRemoved([probe[0], ha[2]], "CPU"),
            BlockStored(hc, None, c, BLOCK_SIZE, None, "CPU", None),
        ]
        assert post == [
            BlockStored(had, None, ad, BLOCK_SIZE, None, "CPU", None),
            BlockStored(he, None, e, BLOCK_SIZE, None, "CPU", None),
            BlockRemoved([had[4], had[3]], "CPU"),
            BlockStored(hf, None, f, BLOCK_SIZE, None, "CPU", None),
        ]
        # Generic form of the same invariant: after the marker, only post-marker blocks.
        stored_after: set[Any] = set()
        for event in post:
            if isinstance(event, BlockStored):
                assert event.parent_block_hash is None or event.parent_block_hash in stored_after
                stored_after.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= stored_after
        # And a router mirroring the whole stream never sees a broken invariant.
        Mirror(BLOCK_SIZE).apply([e for _, e in flat_events(sorted(tap.history, key=seq_key))])


# -- 3. flush before return --------------------------------------------------------------------


def test_reset_while_paused_is_on_the_wire_before_the_reply(start_daemon: StartDaemon) -> None:
    """With the periodic drain paused and nothing else happening, the reset's reply names the
    marker's seq and that batch (pending events first, marker last) arrives live on the SUB
    socket; the drain stays paused."""
    daemon = start_daemon()
    with live(daemon) as (client, tap):
        client.pause()
        before = tap.last_seq()
        tokens = prompt(1, 2)
        store_released(client, "p", tokens)
        [marker] = client.reset().markers
        assert marker == Marker(0, before + 1)
        got = tap.through({0: before + 1})
        assert [(b.seq, b.replayed) for b in got] == [(before + 1, False)]
        assert got[0].batch.events == [
            BlockStored(chain_hashes(tokens), None, tokens, BLOCK_SIZE, None, "CPU", None),
            AllBlocksCleared(),
        ]
        # Again with nothing pending: the marker alone.
        [marker] = client.reset().markers
        assert marker == Marker(0, before + 2)
        got = tap.through({0: before + 2})
        assert [(b.seq, b.replayed, b.batch.events) for b in got] == [
            (before + 2, False, [AllBlocksCleared()])
        ]
        assert client.stats().paused is True


# -- 4. cap bypass -----------------------------------------------------------------------------


def test_reset_bypasses_an_exhausted_cap_and_starts_a_fresh_budget(
    start_daemon: StartDaemon,
) -> None:
    """With max_events_per_tick = 4 exhausted in a paused tick, the reset marker still goes out
    (not counted as dropped), and stores after it in the same tick are published up to a
    fresh cap of 4. Blocks dropped after the reset are never named by a later removal, even
    when they reuse the pool slots of blocks published before it."""
    daemon = start_daemon(events={"max_events_per_tick": 4}, cache={"num_blocks": 9})
    with live(daemon) as (client, tap):

        def dropped() -> int:
            return client.stats().ranks[0].dropped_stored_blocks

        assert dropped() == 0
        before = tap.last_seq()
        x, y, z = prompt(1, 3), prompt(2, 3), prompt(3, 2)
        client.pause()
        store_released(client, "x", x)  # 3 published
        store_released(client, "y", y)  # 1 published, 2 dropped
        store_released(client, "z", z)  # 2 dropped: the cap is exhausted (and the pool full)
        assert dropped() == 4
        [marker] = client.reset().markers
        assert marker.seq == before + 1
        assert dropped() == 4, "the marker must not count against the cap"
        got = tap.through({0: before + 1})
        assert [b.replayed for b in got] == [False]
        hx, hy = chain_hashes(x), chain_hashes(y)
        assert got[0].batch.events == [
            BlockStored(hx, None, x, BLOCK_SIZE, None, "CPU", None),
            BlockStored(hy[:1], None, y[:BLOCK_SIZE], BLOCK_SIZE, None, "CPU", None),
            AllBlocksCleared(),
        ]

        # Same paused tick, after the reset: a fresh budget of 4.
        w, v = prompt(4, 5), prompt(5, 1)
        assert store_released(client, "w", w).num_cached_tokens == 0
        store_released(client, "v", v)  # over the fresh cap: dropped
        assert dropped() == 4 + 1 + 1
        client.resume()
        got = tap.through({0: before + 2})
        hw = chain_hashes(w)
        assert [(b.seq, b.batch.events) for b in got] == [
            (
                before + 2,
                [BlockStored(hw[:4], None, w[: 4 * BLOCK_SIZE], BLOCK_SIZE, None, "CPU", None)],
            )
        ]

        # A new tick: G needs all 9 blocks, evicting W (tail first) and V. Only the four
        # blocks of W published since the reset may be named; then 4 of G's 9 are published.
        g = prompt(6, 9)
        tap.store_seen(client, "g", g)
        hg = chain_hashes(g)
        assert [b.batch.events for b in tap.after(0, before + 2)] == [
            [
                BlockRemoved(hw[3::-1], "CPU"),
                BlockStored(hg[:4], None, g[: 4 * BLOCK_SIZE], BLOCK_SIZE, None, "CPU", None),
            ]
        ]
        Mirror(BLOCK_SIZE).apply([e for _, e in flat_events(sorted(tap.history, key=seq_key))])


# -- 5. re-reporting ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra", [{}, {"lora_id": 7, "lora_name": "adapter", "cache_salt": "s"}], ids=["base", "lora"]
)
def test_same_prompt_after_reset_is_stored_again_with_same_hashes(
    start_daemon: StartDaemon, extra: dict[str, Any]
) -> None:
    """A prompt stored, reset away and stored again is reported again: same block hashes and
    tokens, first parent nil, not matched against the cleared index."""
    daemon = start_daemon()
    tokens = prompt(1, 3, tail=5)
    full = tokens[: 3 * BLOCK_SIZE]
    hashes = chain_hashes(tokens, lora_id=extra.get("lora_id"), cache_salt=extra.get("cache_salt"))
    expected = BlockStored(
        hashes,
        None,
        full,
        BLOCK_SIZE,
        extra.get("lora_id"),
        "CPU",
        extra.get("lora_name"),
        extra_keys=vllm_extra_keys(0, 3, extra.get("lora_name"), extra.get("cache_salt")),
        cache_salt=extra.get("cache_salt"),
    )
    with live(daemon) as (client, tap):
        before = tap.last_seq()
        assert store_released(client, "p1", tokens, **extra).num_cached_tokens == 0
        first = tap.through({0: before + 1})
        assert [b.batch.events for b in first] == [[expected]]
        # Stored again without a reset: fully matched, nothing new.
        assert store_released(client, "p2", tokens, **extra).num_cached_tokens == len(full)

        [marker] = client.reset().markers
        assert marker.seq == before + 2
        assert store_released(client, "p3", tokens, **extra).num_cached_tokens == 0
        again = tap.through({0: before + 3})
        assert [(b.seq, b.batch.events) for b in again] == [
            (before + 2, [AllBlocksCleared()]),
            (before + 3, [expected]),
        ]


# -- 6. replay keeps the marker ----------------------------------------------------------------


TOPIC = "kv@pod@model"


def raw_replay(endpoint: str, start: int, timeout: float = 5.0) -> list[list[bytes]]:
    """Every message a replay request gets, raw, through our own DEALER, end marker included."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", pack_seq(start)])
        messages: list[list[bytes]] = []
        while True:
            assert sock.poll(int(timeout * 1000)), "replay did not finish"
            frames = sock.recv_multipart()
            messages.append(frames)
            if END_SEQ in frames:
                return messages
    finally:
        sock.close()
        context.term()


def check_replay_keeps_marker(start_daemon: StartDaemon, framing: str) -> None:
    daemon = start_daemon(events={"topic": TOPIC, "replay_framing": framing})
    with live(daemon, topic=TOPIC) as (client, tap):
        client.pause()
        store_released(client, "p", prompt(1, 2))
        [marker] = client.reset().markers
        client.resume()
        seq = seq_of(marker)
        [received] = tap.through({0: seq})
        assert (received.seq, received.replayed) == (seq, False)
        assert is_marker(received.batch.events[-1])

        endpoint = rank_endpoint(daemon.replay_endpoint, 0)
        for start in (0, seq):
            messages = raw_replay(endpoint, start)
            if framing == "legacy":
                assert messages[-1] == [b"", END_SEQ, b""]
                assert all(len(m) == 3 and m[0] == b"" for m in messages[:-1])
            else:
                assert messages[-1] == [b"", b"", END_SEQ, b""]
                topic = TOPIC.encode()
                assert all(len(m) == 4 and m[:2] == [b"", topic] for m in messages[:-1])
            batches = {unpack_seq(m[-2]): m[-1] for m in messages[:-1]}
            # From 0: everything retained, from the run's first seq (its origin).
            assert list(batches) == list(range(max(start, daemon.first_seq()), seq + 1))
            assert batches[seq] == received.payload, "replayed payload differs from the live one"
            events = decode_batch(batches[seq]).events
            assert sum(1 for e in events if is_marker(e)) == 1 and is_marker(events[-1])


def test_replay_keeps_the_marker_batch_byte_identical(start_daemon: StartDaemon) -> None:
    """Replay (v0.26 framing, with topic) returns the marker batch at its live seq with a
    byte-identical payload, end marker last."""
    check_replay_keeps_marker(start_daemon, "v026")


def test_legacy_replay_keeps_the_marker_batch_byte_identical(start_daemon: StartDaemon) -> None:
    """Same with replay_framing = "legacy": [b"", seq, payload], end [b"", ff*8, b""]."""
    check_replay_keeps_marker(start_daemon, "legacy")


# -- 7. repeated resets ------------------------------------------------------------------------


def test_twenty_resets_give_twenty_markers_on_gap_free_seqs(start_daemon: StartDaemon) -> None:
    """N resets (some with a pending store) give N replies on consecutive seqs and N live
    batches, each with exactly one marker, last."""
    daemon = start_daemon()
    n = 20
    with live(daemon) as (client, tap):
        before = tap.last_seq()
        client.pause()
        seqs = []
        for i in range(n):
            if i % 2:
                store_released(client, f"r{i}", prompt(i, 1))
            [marker] = client.reset().markers
            seqs.append(seq_of(marker))
        assert seqs == list(range(before + 1, before + 1 + n))
        got = tap.through({0: seqs[-1]})
        assert [(b.seq, b.replayed) for b in got] == [(s, False) for s in seqs]
        for i, b in enumerate(got):
            events = b.batch.events
            assert marker_count([b]) == 1 and is_marker(events[-1])
            assert len(events) == (2 if i % 2 else 1)
        assert tap.sub.counters.gaps == 0


# -- 8. empty cache ----------------------------------------------------------------------------


def test_reset_of_an_empty_cache_publishes_a_marker(start_daemon: StartDaemon) -> None:
    """A reset of a cache that never held a block, and of one just emptied, both publish a
    marker batch at the replied seq."""
    daemon = start_daemon()
    with daemon.client() as client, daemon.subscriber() as sub:
        ranks = client.stats().ranks
        assert ranks[0].blocks_cached == 0 and ranks[0].blocks_used == 0
        first = ranks[0].first_seq
        assert client.reset().markers == [Marker(0, first + 1)]
        got = sub.catch_up()  # the SUB socket may not be connected yet: read through replay
        assert [(b.seq, b.batch.events) for b in got] == [
            (first, [AllBlocksCleared()]),
            (first + 1, [AllBlocksCleared()]),
        ]
    with live(daemon) as (client, tap):
        client.reset()  # drops go_live's probe block
        tap.settle(client)
        ranks = client.stats().ranks
        assert ranks[0].blocks_cached == 0 and ranks[0].blocks_used == 0
        before = tap.last_seq()
        assert client.reset().markers == [Marker(0, before + 1)]
        got = tap.through({0: before + 1})
        assert [(b.seq, b.replayed, b.batch.events) for b in got] == [
            (before + 1, False, [AllBlocksCleared()])
        ]


# -- 9. data-parallel ranks --------------------------------------------------------------------


def test_reset_of_all_ranks_puts_one_marker_on_each_rank_socket(
    start_daemon: StartDaemon,
) -> None:
    """With two ranks, a reset of all puts exactly one marker on each rank's own socket, at the
    seq the reply gives for that rank."""
    daemon = start_daemon(cache={"data_parallel_size": 2})
    with live(daemon) as (client, tap):
        for rank in range(2):
            tap.store_seen(client, f"p{rank}", prompt(1 + rank, 2), rank=rank)
        before = {rank: tap.last_seq(rank) for rank in range(2)}
        markers = sorted(client.reset().markers, key=lambda m: m.rank)
        assert markers == [Marker(r, before[r] + 1) for r in range(2)]
        for rank in range(2):
            fence(client, tap, seed=10 + rank, rank=rank)
        for rank in range(2):
            batches = tap.after(rank, before[rank])
            assert_gap_free(batches, before[rank])
            assert marker_count(batches) == 1
            marker_batch = tap.batch(rank, before[rank] + 1)
            assert marker_batch.batch.events == [AllBlocksCleared()]
            assert marker_batch.batch.data_parallel_rank == rank
            assert not marker_batch.replayed


def test_reset_of_one_rank_leaves_the_other_rank_untouched(start_daemon: StartDaemon) -> None:
    """A reset of rank 1 publishes a marker on rank 1 only: rank 0's next batch is the next
    rank-0 store at seq + 1, and rank 0's cache still matches its prefix."""
    daemon = start_daemon(cache={"data_parallel_size": 2})
    with live(daemon) as (client, tap):
        p, q = prompt(1, 2), prompt(2, 2)
        tap.store_seen(client, "p", p, rank=0)
        tap.store_seen(client, "q", q, rank=1)
        before = {rank: tap.last_seq(rank) for rank in range(2)}

        assert client.reset(rank=1).markers == [Marker(1, before[1] + 1)]
        # Fence on rank 0: P extended by one block still matches P, and its store is the very
        # next rank-0 batch.
        ext = p + prompt(3, 1)
        assert store_released(client, "ext", ext, rank=0).num_cached_tokens == len(p)
        tap.until(lambda: tap.last_seq(0) > before[0], what="rank 0's next batch")
        tap.through({1: before[1] + 1})
        hp, hext = chain_hashes(p), chain_hashes(ext)
        assert [(b.seq, b.batch.events) for b in tap.after(0, before[0])] == [
            (
                before[0] + 1,
                [BlockStored(hext[2:], hp[-1], ext[32:], BLOCK_SIZE, None, "CPU", None)],
            )
        ]
        assert [(b.seq, b.batch.events) for b in tap.after(1, before[1])] == [
            (before[1] + 1, [AllBlocksCleared()])
        ]
        stats = {r.rank: r for r in client.stats().ranks}
        assert (stats[0].resets, stats[1].resets) == (0, 1)
        assert store_released(client, "q2", q, rank=1).num_cached_tokens == 0


# -- 10. busy / force --------------------------------------------------------------------------


def test_reset_while_blocks_are_pinned_is_busy_unless_forced(start_daemon: StartDaemon) -> None:
    """A reset while an open request pins blocks answers "busy" and changes nothing (snapshot
    and counters unchanged, no marker); with force it resets, publishes the marker, and the
    dropped request is unknown afterwards."""
    daemon = start_daemon()
    with live(daemon) as (client, tap):
        pinned = prompt(1, 2, tail=3)
        tap.store_seen(client, "open", pinned, release=False)

        def state() -> tuple[Any, ...]:
            snap = client.snapshot(0)
            r = client.stats().ranks[0]
            counters = ("resets", "blocks_cached", "blocks_used", "requests_open", "seq")
            return snap.seq, snap.epoch, snap.events, tuple(getattr(r, k) for k in counters)

        before_state = state()
        before = tap.last_seq()
        assert before_state[0] == before
        for rank in (None, 0):
            with pytest.raises(ControlError) as refused:
                client.reset(rank)
            assert refused.value.code == "busy"
        assert state() == before_state

        # No marker went out: the next batch is the fence store, at seq + 1.
        fence(client, tap, seed=50)
        q = prompt(50, 1)
        assert [(b.seq, b.batch.events) for b in tap.after(0, before)] == [
            (before + 1, [BlockStored(chain_hashes(q), None, q, BLOCK_SIZE, None, "CPU", None)])
        ]

        [marker] = client.reset(force=True).markers
        assert marker == Marker(0, before + 2)
        got = tap.through({0: before + 2})
        assert [(b.seq, b.replayed, b.batch.events) for b in got] == [
            (before + 2, False, [AllBlocksCleared()])
        ]
        with pytest.raises(ControlError) as unknown:
            client.release("open")
        assert unknown.value.code == "unknown_request"
        r = client.stats().ranks[0]
        assert (r.requests_open, r.blocks_cached, r.blocks_used) == (0, 0, 0)
        assert client.snapshot(0).events == []


# -- CLI ---------------------------------------------------------------------------------------


@pytest.mark.process
def test_cli_reset_prints_each_rank_marker_seq(start_daemon: StartDaemon) -> None:
    """`python -m kvpubd reset --control <endpoint>` exits 0 and prints, per rank, the seq of
    the marker that rank's subscriber then receives."""
    daemon = start_daemon(cache={"data_parallel_size": 2})
    with live(daemon) as (_client, tap):
        before = {rank: tap.last_seq(rank) for rank in range(2)}
        done = subprocess.run(
            [sys.executable, "-m", "kvpubd", "reset", "--control", daemon.control_endpoint],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        printed = {
            int(m[1]): int(m[2])
            for m in re.finditer(r"^rank (\d+): marker seq (\d+)$", done.stdout, re.MULTILINE)
        }
        assert printed == {rank: before[rank] + 1 for rank in range(2)}, done.stdout
        tap.through(printed)
        for rank, seq in printed.items():
            assert tap.batch(rank, seq).batch.events == [AllBlocksCleared()]
