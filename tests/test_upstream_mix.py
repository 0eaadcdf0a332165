"""The daemon in upstream mode through a random mix of what tests/test_upstream_daemon.py takes
one at a time: an engine's batches, its own clears, batches lost on the way and repaired through
its replay socket, resets in front of it (its reset_url answering with a clear, a clear that is
itself lost on the way, or a restart), and engine restarts. After every step the router (kvpubd's
client and vLLM's decoder types) and the daemon's snapshot hold exactly what kvpubd should
publish of the engine's true state."""

from __future__ import annotations

import os
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import DaemonFactory
from tests.daemon import Daemon
from tests.test_upstream_daemon import EngineReset, assert_exact, following
from tests.upstream_engines import ENGINES, Engine, Relay, engine_module
from tests.upstream_model import EngineModel
from tests.upstream_router import WAIT_S, Router

pytestmark = [pytest.mark.daemon_process, pytest.mark.slow]

STEPS = 40
REACTIONS = ("clear", "lost-clear", "restart")  # what the engine does when kvpubd resets
# More mixes: MIX_SEEDS=1,2,3,... (each seed is a mix of its own).
SEEDS = [int(seed) for seed in os.environ.get("MIX_SEEDS", "1,2").split(",")]


class Mix:
    """One engine, the relay between it and kvpubd, kvpubd and a router, and what the next
    reset makes the engine do (``reaction``)."""

    def __init__(self, engine: Engine, relay: Relay, seed: int) -> None:
        self.engine = engine
        self.relay = relay
        self.model = EngineModel(engine, seed)
        self.rng = self.model.rng
        self.reaction: Callable[[], None] = lambda: None
        self.resets = 0
        # The next batches the relay forwards are lost, as many as this says.
        self._to_lose = 0
        self.lost = 0  # batches lost so far
        self.planned = 0  # batches meant to be lost so far
        self._losing = threading.Lock()
        relay.drop = self._drop

    def _drop(self, seq: int) -> bool:
        """On the relay's thread, for each batch it would forward."""
        with self._losing:
            if self._to_lose == 0:
                return False
            self._to_lose -= 1
            self.lost += 1
            return True

    def lose_next(self, count: int) -> None:
        """The next ``count`` batches the engine publishes are lost on the way to kvpubd. The
        relay has forwarded what the engine published before them first (a restarted engine's
        first batches may never reach it: a SUB socket joins late)."""
        last = self.engine.published - 1
        deadline = time.monotonic() + WAIT_S
        while last >= 0 and last not in self.relay.received[-1:]:
            assert time.monotonic() < deadline, f"the relay never had batch {last}"
            time.sleep(0.001)  # polls the relay's thread
        with self._losing:
            self._to_lose += count
        self.planned += count

    def restart_engine(self) -> None:
        """The engine process starts again; kvpubd's connection to it drops meanwhile (the
        relay's PUB socket goes with the engine's, as a direct connection would)."""
        self.relay.close_pub()
        self.model.restart()
        self.relay.open_pub()

    # -- steps ------------------------------------------------------------------------------

    def serve(self, batches: int = 0) -> None:
        for _ in range(batches or self.rng.randint(1, 3)):
            self.model.publish(*self.model.random_events(self.rng.randint(1, 4)))

    def own_clear(self) -> None:
        model = self.model
        model.publish(*model.random_events(2), model.cleared(), *model.random_events(2))

    def lossy(self) -> None:
        lost = self.rng.randint(1, 3)
        self.lose_next(lost)
        self.serve(lost + self.rng.randint(0, 1))

    def reset(self, daemon: Daemon, server: EngineReset) -> None:
        """kvpubd's reset; the engine, called, publishes what it still had queued, then
        clears (in a batch that may be lost on the way), or restarts instead."""
        model = self.model
        how = REACTIONS[self.resets % len(REACTIONS)]
        self.resets += 1

        def react() -> None:
            if model.device_blocks():
                model.publish(*model.random_events(2))  # queued before its clear
            if how == "restart":
                self.restart_engine()
            else:
                if how == "lost-clear":
                    self.lose_next(1)
                model.publish(model.cleared(), model.new_chain(2))
            model.publish(*model.random_events(2))

        self.reaction = react
        model.forget()  # kvpubd's reset: before the engine is called
        calls = server.calls
        with daemon.client() as client:
            client.reset()
        deadline_ok = server.done.wait(WAIT_S)
        assert deadline_ok and server.calls == calls + 1
        server.done.clear()

    def restart(self) -> None:
        self.restart_engine()
        self.serve()


def both(first: Callable[[], None], second: Callable[[], None]) -> None:
    first()
    second()


@pytest.fixture(params=ENGINES)
def flavour(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def engine(flavour: str, tmp_path: Path) -> Iterator[Engine]:
    started = Engine(flavour, tmp_path).start()
    yield started
    started.shutdown()


@pytest.mark.parametrize("seed", SEEDS)
def test_a_random_mix_of_what_an_engine_and_its_operators_do(
    engine: Engine, start_daemon: DaemonFactory, tmp_path: Path, seed: int
) -> None:
    vllm_kv: types.ModuleType = engine_module("vllm")
    relay = Relay(engine.endpoint, tmp_path)
    mix = Mix(engine, relay, seed)
    server = EngineReset(lambda: mix.reaction())
    router: Router | None = None
    try:
        daemon = following(start_daemon, engine, relay.endpoint, reset_url=server.url)
        router = Router(daemon, vllm_kv, mix.model.host_medium)
        assert_exact(mix.model, router, daemon)
        steps: dict[str, Callable[[], Any]] = {
            "serve": mix.serve,
            "own clear": mix.own_clear,
            "lossy": mix.lossy,
            "reset": lambda: mix.reset(daemon, server),
            "restart": mix.restart,
            # Two at once, with nothing settled between them.
            "reset after a loss": lambda: both(mix.lossy, lambda: mix.reset(daemon, server)),
            "reset twice": lambda: both(*[lambda: mix.reset(daemon, server)] * 2),
        }
        # Every step at least once, reset three times (one of each reaction), the rest drawn.
        plan = [*steps, "reset", "reset"]
        plan += mix.rng.choices(list(steps), [5, 1, 2, 2, 1, 1, 1], k=STEPS - len(plan))
        mix.rng.shuffle(plan)
        done = []
        for name in plan:
            steps[name]()
            done.append(name)
            try:
                assert_exact(mix.model, router, daemon)
            except AssertionError as failure:
                raise AssertionError(f"after {done}: {failure}") from failure
        assert mix.lost == mix.planned
        log = daemon.log()
        assert "Traceback" not in log, log
    finally:
        if router is not None:
            router.close()
        relay.stop()
        server.close()
