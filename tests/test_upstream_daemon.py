"""The daemon in upstream mode (``[upstream]``), a real ``kvpubd serve`` process, following vLLM's
and SGLang's own publishers (their kv_events.py, unmodified; tests/upstream_engines.py).

The test keeps the engine's true state (tests/upstream_model.py) and a router reads the
daemon's stream with kvpubd's client and with vLLM's own decoder types
(tests/upstream_router.py): after stores, prefix hits (stores repeated), evictions, removals
of blocks never stored, the engine's own clears, an engine restart, dropped batches, a loss
that replay cannot fill and a late join, both hold exactly what the engine holds (less what a
loss voided) and so does the daemon's snapshot. Then the reset contract in front of an engine
(its reset_url a real HTTP server here): kvpubd's marker at once, the engine's events from
before its own clear (its AllBlocksCleared, or TensorRT-LLM's removals of every block) never
after it. Last, Dynamo 1.6.1's indexer in front of it all holds the engine's blocks."""

from __future__ import annotations

import importlib.util
import threading
import time
import types
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import DaemonFactory
from tests.daemon import Daemon
from tests.upstream_engines import ENGINES, Engine, Relay, engine_module
from tests.upstream_model import EngineModel, Key, routed
from tests.upstream_router import WAIT_S, Router, snapshot_keys

pytestmark = pytest.mark.daemon_process

SEED = 24
RETRY_S = 0.5  # a sentinel not seen this long is published again (a SUB socket still joining)


@pytest.fixture
def vllm_kv() -> types.ModuleType:
    """vLLM's kv_events module: the router's decoder types."""
    return engine_module("vllm")


@pytest.fixture(params=ENGINES)
def flavour(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def engine(flavour: str, tmp_path: Path) -> Iterator[Engine]:
    started = Engine(flavour, tmp_path).start()
    yield started
    started.shutdown()


@pytest.fixture
def vllm_engine(tmp_path: Path) -> Iterator[Engine]:
    started = Engine("vllm", tmp_path).start()
    yield started
    started.shutdown()


def following(
    start_daemon: DaemonFactory,
    engine: Engine,
    endpoint: str | None = None,
    flavour: str | None = None,
    **upstream: Any,
) -> Daemon:
    """A daemon following ``engine`` (through ``endpoint``: a Relay's, else the engine's)."""
    return start_daemon(
        upstream={
            "flavour": flavour or engine.flavour,
            "endpoint": endpoint or engine.endpoint,
            "replay_endpoint": engine.replay_endpoint,
            **upstream,
        }
    )


@pytest.fixture
def routers() -> Iterator[Callable[[Daemon, types.ModuleType, str], Router]]:
    made: list[Router] = []

    def make(daemon: Daemon, vllm_kv: types.ModuleType, host_medium: str) -> Router:
        made.append(Router(daemon, vllm_kv, host_medium))
        return made[-1]

    yield make
    for router in made:
        router.close()


def settle(model: EngineModel, router: Router, retry: bool = True) -> Key:
    """The engine stores one new block (again, if ``retry``, while it is not seen: the
    daemon's SUB socket may still be joining); returns once the router holds it."""
    deadline = time.monotonic() + WAIT_S
    while True:
        before = set(model.held)
        model.publish(model.new_chain(1))
        (key,) = set(model.held) - before
        if not retry:
            router.until(key)
            return key
        seen_by = time.monotonic() + RETRY_S
        while key not in router.blocks and time.monotonic() < seen_by:
            router.pump()
        if key in router.blocks:
            return key
        assert time.monotonic() < deadline, "the daemon never followed the engine"


def assert_exact(model: EngineModel, router: Router, daemon: Daemon, retry: bool = True) -> None:
    """After a new block reached the router: both of its readings and the daemon's snapshot
    hold exactly what kvpubd should publish of the engine, a subset of what it holds."""
    settle(model, router, retry)
    assert router.violations == []
    counters = router.subscriber.counters
    assert (counters.violations, counters.lost) == (0, 0)
    assert model.visible <= set(model.held)
    assert router.blocks == model.visible
    assert {k: router.parents[k] for k in model.visible} == {
        k: model.parent_hash(k) for k in model.visible
    }
    assert router.mirror_blocks() == model.visible
    with daemon.client() as client:
        assert snapshot_keys(client) == model.visible


def stored_keys(events: list[tuple[str, list[Key]]]) -> set[Key]:
    return {key for name, keys in events if name == "BlockStored" for key in keys}


def cleared_before_stores(events: list[tuple[str, list[Key]]]) -> bool:
    """The first event is AllBlocksCleared and no other AllBlocksCleared follows it."""
    names = [name for name, _ in events]
    return bool(names) and names[0] == "AllBlocksCleared" and names.count("AllBlocksCleared") == 1


# -- following an engine ------------------------------------------------------------------------


def test_follows_the_engine_exactly(
    engine: Engine, vllm_kv: types.ModuleType, start_daemon: DaemonFactory, routers: Any
) -> None:
    """Prompts, prefix hits (vLLM publishes the reused blocks again: not repeated), evictions,
    host tier copies (same hash, another medium), removals of blocks never stored (not
    published) and the engine's own clears: the router and the snapshot hold the engine's
    blocks, hashes as u64 (vLLM's sha256 digests by their last 8 bytes, SGLang's negative
    hashes masked)."""
    model = EngineModel(engine, SEED)
    daemon = following(start_daemon, engine)
    router = routers(daemon, vllm_kv, model.host_medium)
    assert_exact(model, router, daemon)
    for round_ in range(6):
        for _ in range(4):
            model.publish(*model.random_events(model.rng.randint(1, 4)))
        if round_ == 3:
            model.publish(*model.random_events(2), model.cleared(), *model.random_events(2))
        assert_exact(model, router, daemon)
    # A block evicted before its child (vLLM's sliding-window groups may), then stored again
    # with that child under their parent: only it is new, under that parent.
    model.publish(model.new_chain(3))
    top, middle, leaf = model.chain(model.leaves()[-1])
    model.publish(model.remove([("GPU", routed(middle.raw))]))
    model.publish(model.store_chain([middle, leaf], parent=("GPU", routed(top.raw))))
    assert_exact(model, router, daemon)
    assert model.repeated and model.unknown_removed  # both happened, neither published
    assert any(name == "BlockRemoved" for b in router.batches for name, _ in b.events)
    assert any(medium == model.host_medium for medium, _ in model.visible)
    assert any(h >> 63 for _, h in model.visible)  # u64 beyond i64 (SGLang: negative ones)
    log = daemon.log()
    assert "Traceback" not in log, log


def test_engine_restart(
    engine: Engine, vllm_kv: types.ModuleType, start_daemon: DaemonFactory, routers: Any
) -> None:
    """The engine starts again (its seqs from 0): kvpubd publishes AllBlocksCleared, then the
    new engine's blocks, also those with the old engine's hashes (the same prompts again)."""
    model = EngineModel(engine, SEED)
    daemon = following(start_daemon, engine)
    router = routers(daemon, vllm_kv, model.host_medium)
    for _ in range(5):
        model.publish(*model.random_events(3, host_tier=False))
    assert_exact(model, router, daemon)
    last_old = router.batches[-1].seq
    old_leaf = model.leaves()[0]
    old_chain = model.chain(old_leaf)
    model.restart()
    # The new engine: the old prompt's blocks again (same hashes), then new ones under them.
    model.publish(model.store_chain(old_chain))
    model.publish(model.new_chain(2, parent=old_leaf))
    assert_exact(model, router, daemon)
    after = router.after(last_old)
    assert cleared_before_stores(after), after
    assert old_leaf in stored_keys(after)
    assert "the engine restarted" in daemon.log()


def test_dropped_batches_repaired_through_replay(
    engine: Engine,
    vllm_kv: types.ModuleType,
    start_daemon: DaemonFactory,
    routers: Any,
    tmp_path: Path,
) -> None:
    """Batches lost between the engine and kvpubd come back from the engine's replay socket:
    no marker, nothing missing."""
    relay = Relay(engine.endpoint, tmp_path)
    try:
        model = EngineModel(engine, SEED)
        daemon = following(start_daemon, engine, relay.endpoint)
        router = routers(daemon, vllm_kv, model.host_medium)
        assert_exact(model, router, daemon)
        first = engine.published
        holes = {first + 1, first + 3, first + 4}
        relay.drop = holes.__contains__
        marker_count = sum(n == "AllBlocksCleared" for b in router.batches for n, _ in b.events)
        for _ in range(6):
            model.publish(*model.random_events(3))
        assert_exact(model, router, daemon)
        assert holes <= set(relay.dropped)
        markers = sum(n == "AllBlocksCleared" for b in router.batches for n, _ in b.events)
        assert markers == marker_count
    finally:
        relay.stop()


def test_loss_replay_cannot_fill(
    flavour: str,
    vllm_kv: types.ModuleType,
    start_daemon: DaemonFactory,
    routers: Any,
    tmp_path: Path,
) -> None:
    """Batches dropped that the engine's replay ring (2 batches) no longer holds: kvpubd
    publishes AllBlocksCleared, then what the engine published from the first batch it could
    still replay: a subset of the engine's blocks, never one it does not hold (a removal of a
    block stored before the loss is not published)."""
    engine = Engine(flavour, tmp_path, buffer_steps=2).start()
    relay = Relay(engine.endpoint, tmp_path)
    try:
        model = EngineModel(engine, SEED)
        # No idle check: the loss must be found by the batch after it, not by a silence.
        daemon = following(start_daemon, engine, relay.endpoint, idle_check_ms=0)
        router = routers(daemon, vllm_kv, model.host_medium)
        settle(model, router)  # live, whatever the joining lost
        model.publish(model.cleared())  # from here on the state is known
        for _ in range(3):
            model.publish(*model.random_events(3))
        assert_exact(model, router, daemon, retry=False)
        last_before = router.batches[-1].seq
        first = engine.published
        relay.drop = set(range(first, first + 5)).__contains__
        for _ in range(4):
            model.publish(*model.random_events(4))
        model.forget()  # the first batch the ring still holds: the marker before it
        before_loss = model.device_blocks()
        model.publish(
            # Under a block from before the loss: not published (nor is its child).
            model.new_chain(2, parent=before_loss[0]),
            # A prefix hit on blocks from before the loss: published again from the root.
            model.reuse(before_loss[-1], extend=1),
            *model.random_events(2),
        )
        engine.wait_sent(first + 4)
        # The next batch reveals the gap; replay returns the last two.
        assert_exact(model, router, daemon, retry=False)
        assert cleared_before_stores(router.after(last_before))
        # The engine evicts what it stored before the loss: kvpubd publishes no such removal.
        forgotten = [k for k in model.leaves() if k not in model.visible]
        assert forgotten
        model.publish(model.remove(forgotten[:2]))
        assert_exact(model, router, daemon, retry=False)
    finally:
        relay.stop()
        engine.shutdown()


def test_late_join(
    engine: Engine, vllm_kv: types.ModuleType, start_daemon: DaemonFactory, routers: Any
) -> None:
    """A daemon started after the engine published its history takes it from the engine's
    replay socket."""
    model = EngineModel(engine, SEED)
    for _ in range(8):
        model.publish(*model.random_events(3))
    engine.wait_sent(engine.published - 1)
    daemon = following(start_daemon, engine)
    router = routers(daemon, vllm_kv, model.host_medium)
    assert_exact(model, router, daemon)
    assert len(model.visible) > 5


# -- the reset contract -------------------------------------------------------------------------


class EngineReset:
    """The engine's reset endpoint (upstream.reset_url), a real HTTP server on a thread: a
    POST runs ``on_reset`` (the engine's reaction) and is answered 200."""

    def __init__(self, on_reset: Callable[[], None]) -> None:
        self.calls = 0
        self.done = threading.Event()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                on_reset()
                owner.calls += 1
                owner.done.set()
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/reset_prefix_cache"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def engine_reset() -> Iterator[Callable[[Callable[[], None]], EngineReset]]:
    made: list[EngineReset] = []

    def make(on_reset: Callable[[], None]) -> EngineReset:
        made.append(EngineReset(on_reset))
        return made[-1]

    yield make
    for server in made:
        server.close()


def reset_in_front_of_the_engine(
    model: EngineModel,
    router: Router,
    daemon: Daemon,
    server: EngineReset,
    pre_clear: list[Key],
    after_clear: list[Key],
) -> int:
    """A reset on the control socket, whose reset_url has the engine publish ``pre_clear``
    blocks, its clear (its AllBlocksCleared or per-block removals), then two stores of
    ``after_clear``: kvpubd's marker at once (the next batch), none of the engine's blocks
    from before its clear anywhere, its two stores after the marker. Returns the marker's
    seq."""
    last_before = router.batches[-1].seq
    model.forget()  # kvpubd's reset: before the engine is called
    with daemon.client() as client:
        (marker,) = client.reset().markers
    assert marker.seq == last_before + 1  # at once, before anything the engine does
    assert server.done.wait(WAIT_S)
    router.until(after_clear[-1])
    after = router.after(marker.seq)
    assert [name for name, _ in after] == ["BlockStored", "BlockStored"], after
    assert stored_keys(after) == set(after_clear)
    seen = {key for batch in router.batches for _, keys in batch.events for key in keys}
    assert not seen & set(pre_clear)
    assert_exact(model, router, daemon)
    return marker.seq


def test_reset_fences_the_engines_events_before_its_clear(
    engine: Engine,
    vllm_kv: types.ModuleType,
    start_daemon: DaemonFactory,
    routers: Any,
    engine_reset: Any,
) -> None:
    """A reset with upstream.reset_url: kvpubd's marker goes out at once (the next batch), then
    the engine, called, publishes what was still queued before its clear (a store, an
    eviction), its AllBlocksCleared with a new store in the same batch, and more stores. None
    of the engine's events up to its clear appear anywhere; everything after it does, after
    the marker."""
    model = EngineModel(engine, SEED)
    pre_clear: list[Key] = []
    after_clear: list[Key] = []

    def engine_resets() -> None:
        before = set(model.held)
        queued = model.new_chain(1)  # stored just before its clear, still in its queue
        pre_clear.extend(set(model.held) - before)
        model.publish(queued, model.remove(model.leaves()[:1]))
        model.publish(model.cleared(), model.new_chain(2))
        model.publish(model.new_chain(1, parent=next(iter(model.held))))
        after_clear.extend(model.held)

    server = engine_reset(engine_resets)
    daemon = following(start_daemon, engine, reset_url=server.url)
    router = routers(daemon, vllm_kv, model.host_medium)
    for _ in range(3):
        model.publish(*model.random_events(3))
    assert_exact(model, router, daemon)
    marker_seq = reset_in_front_of_the_engine(model, router, daemon, server, pre_clear, after_clear)
    assert router.batches[[b.seq for b in router.batches].index(marker_seq)].events == [
        ("AllBlocksCleared", [])
    ]
    assert server.calls == 1


def test_reset_of_an_idle_engine_that_never_clears(
    vllm_engine: Engine, vllm_kv: types.ModuleType, start_daemon: DaemonFactory, routers: Any
) -> None:
    """A reset while the engine publishes nothing: the marker at once. The engine never
    clears (no reset_url): its stores are dropped until upstream.clear_timeout_ms has passed,
    then followed again; its removals of blocks from before the reset are not published."""
    model = EngineModel(vllm_engine, SEED)
    daemon = following(start_daemon, vllm_engine, clear_timeout_ms=1000)
    router = routers(daemon, vllm_kv, model.host_medium)
    for _ in range(3):
        model.publish(*model.random_events(3, host_tier=False))
    assert_exact(model, router, daemon)
    last_before = router.batches[-1].seq
    model.forget()
    with daemon.client() as client:
        (marker,) = client.reset().markers
        assert marker.seq == last_before + 1
        router.until_seq(marker.seq)
        assert router.blocks == set() and router.mirror_blocks() == set()
        assert snapshot_keys(client) == set()
    # Stored right after the reset, well within the timeout: dropped.
    published: list[Key] = []
    deadline = time.monotonic() + WAIT_S
    while not router.blocks:
        before = set(model.held)
        model.publish(model.new_chain(1))
        published.extend(set(model.held) - before)
        model.visible.clear()  # not followed, unless it is the first one after the timeout
        seen_by = time.monotonic() + 0.1
        while not router.blocks and time.monotonic() < seen_by:
            router.pump()
        assert time.monotonic() < deadline, "kvpubd never followed the engine again"
    first_seen = next(key for key in published if key in router.blocks)
    model.visible.update(published[published.index(first_seen) :])
    assert first_seen != published[0]
    assert "did not clear within 1.0 s" in daemon.log()
    # Blocks the engine held before the reset: their removal is not published.
    old = [k for k in model.leaves() if k not in model.visible]
    model.publish(model.remove(old[:2]))
    assert_exact(model, router, daemon)


def test_reset_trtllm_per_block_removals(
    vllm_engine: Engine,
    vllm_kv: types.ModuleType,
    start_daemon: DaemonFactory,
    routers: Any,
    engine_reset: Any,
) -> None:
    """flavour "trtllm" (TensorRT-LLM sends no AllBlocksCleared: its reset removes every block
    one by one), its tagged maps sent by vLLM's publisher with int hashes (the trtllm decoder
    takes them): after the marker, kvpubd drops the engine's events until it has removed every
    block it held at the reset (stores still queued before its reset among them), then
    follows it."""
    model = EngineModel(vllm_engine, SEED, hashes="int")
    pre_clear: list[Key] = []
    after_clear: list[Key] = []

    def queued() -> tuple[Any, Key]:
        """A store from before the engine's reset, still in its queue."""
        before = set(model.held)
        event = model.new_chain(1)
        (key,) = set(model.held) - before
        pre_clear.append(key)
        return event, key

    def engine_resets() -> None:
        held = list(model.held)
        first, first_key = queued()
        model.publish(first, model.remove(held[:1]))
        # Between its removals: more of what was queued (removed with the rest).
        second, second_key = queued()
        model.publish(second, model.remove([first_key]), model.remove(held[1:-1]))
        model.publish(model.remove([second_key]), model.remove(held[-1:]), model.new_chain(2))
        model.publish(model.new_chain(1))
        after_clear.extend(model.held)

    server = engine_reset(engine_resets)
    daemon = following(start_daemon, vllm_engine, flavour="trtllm", reset_url=server.url)
    router = routers(daemon, vllm_kv, model.host_medium)
    model.publish(model.new_chain(3))
    for _ in range(3):
        model.publish(*model.random_events(3, host_tier=False))
    assert_exact(model, router, daemon)
    assert len(model.held) >= 3
    reset_in_front_of_the_engine(model, router, daemon, server, pre_clear, after_clear)


# -- Dynamo's indexer in front of kvpubd in front of vLLM ------------------------------------


@pytest.mark.dynamo
@pytest.mark.skipif(
    importlib.util.find_spec("dynamo") is None,
    reason="Dynamo's indexer is not installed (pip install 'kvpubd[interop]')",
)
def test_dynamo_indexer_follows_the_engine(vllm_engine: Engine, tmp_path: Path) -> None:
    """Dynamo 1.6.1's indexer registered on kvpubd (tcp) following vLLM's publisher: after
    prompts, prefix hits, evictions and an engine restart its tree holds the engine's
    blocks."""
    from tests.test_dynamo import Indexer

    model = EngineModel(vllm_engine, SEED)
    daemon = Daemon(
        {
            "events": {"medium": "GPU", "heartbeat_ms": 500},
            "upstream": {
                "flavour": "vllm",
                "endpoint": vllm_engine.endpoint,
                "replay_endpoint": vllm_engine.replay_endpoint,
            },
        },
        transport="tcp",
    )
    indexer = Indexer(tmp_path / "indexer.log")
    try:
        daemon.start()
        indexer.register(daemon)

        def indexer_exact() -> None:
            wanted = {h for _, h in model.visible}
            deadline = time.monotonic() + WAIT_S
            while (held := indexer.blocks(0)) != wanted:
                assert time.monotonic() < deadline, (
                    f"indexer holds {len(held)} blocks, the engine {len(wanted)}:\n"
                    + indexer.log()[-3000:]
                )
                time.sleep(0.05)  # a poll of the indexer's tree
            with daemon.client() as client:
                assert {h for _, h in snapshot_keys(client)} == wanted

        for _ in range(6):
            model.publish(*model.random_events(3, host_tier=False))
        indexer_exact()
        assert model.visible
        old_leaf = model.leaves()[0]
        old_chain = model.chain(old_leaf)
        model.restart()
        model.publish(model.store_chain(old_chain))
        for _ in range(3):
            model.publish(*model.random_events(3, host_tier=False))
        indexer_exact()
    finally:
        indexer.close()
        daemon.cleanup()
