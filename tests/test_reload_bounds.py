"""SIGHUP reload and start-up never wait on what a path turns out to be: a config path that is
a FIFO, a device or a huge file is refused with one line, and the CURVE authorised keys are
read once, a few files per loop turn (issue item 10)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from kvpubd.daemon.curve import KEY_FILES_PER_TURN, CurveServer
from kvpubd.daemon.settings import MAX_CONFIG_BYTES, ConfigError, load_settings
from kvpubd.protocol.auth import AuthError, create_keys
from tests.test_cli import kvpubd
from tests.test_cli_errors import assert_one_line


def test_config_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "kvpubd.toml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):
        load_settings(fifo)


def test_config_larger_than_the_bound_is_refused(tmp_path: Path) -> None:
    big = tmp_path / "kvpubd.toml"
    big.write_bytes(b"#" * (MAX_CONFIG_BYTES + 1))
    with pytest.raises(ConfigError, match=f"the limit is {MAX_CONFIG_BYTES}"):
        load_settings(big)


@pytest.mark.process
def test_serve_with_config_dev_zero_exits_2_with_one_line() -> None:
    result = kvpubd("serve", "--config", "/dev/zero", timeout=20)
    assert_one_line(result, 2, "/dev/zero", "not a regular file")


@pytest.fixture
def curve(tmp_path: Path) -> Iterator[tuple[CurveServer, Path]]:
    _, secret = create_keys(tmp_path / "server", "server")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    context = zmq.Context()
    server = CurveServer(context, secret, allowed)
    try:
        yield server, allowed
    finally:
        server.stop()
        context.destroy(linger=0)


def add_client_keys(directory: Path, count: int) -> set[bytes]:
    """``count`` client public key files in ``directory``; their keys."""
    keys = set()
    for i in range(count):
        public, _ = zmq.curve_keypair()
        (directory / f"c{i}.key").write_text(
            f'metadata\ncurve\n    public-key = "{public.decode()}"\n'
        )
        keys.add(public)
    return keys


def run_counting_turns(coroutine: object) -> tuple[int, object]:
    """Drive a coroutine that only yields bare loop turns (asyncio.sleep(0)) to its end by
    hand; (turns it yielded, its result)."""
    turns = 0
    while True:
        try:
            coroutine.send(None)  # type: ignore[attr-defined]
        except StopIteration as done:
            return turns, done.value
        turns += 1


def test_key_reload_reads_a_few_files_per_loop_turn(curve: tuple[CurveServer, Path]) -> None:
    server, allowed = curve
    count = 10 * KEY_FILES_PER_TURN
    keys = add_client_keys(allowed, count)
    turns, loaded = run_counting_turns(server.reload())
    assert loaded == count
    # Every turn reads at most KEY_FILES_PER_TURN files: the reload takes that many turns.
    assert turns >= count // KEY_FILES_PER_TURN - 1
    assert set(server._authenticator.certs["*"]) == keys


def test_key_reload_that_fails_keeps_the_keys_loaded(curve: tuple[CurveServer, Path]) -> None:
    server, allowed = curve
    keys = add_client_keys(allowed, 3)
    asyncio.run(server.reload())
    os.mkfifo(allowed / "stuck.key")  # would block a reader until a writer came
    with pytest.raises(AuthError, match="not a regular file"):
        asyncio.run(server.reload())
    assert set(server._authenticator.certs["*"]) == keys


async def test_sighup_reads_the_config_off_the_loop_one_reload_at_a_time(tmp_path: Path) -> None:
    """The file was read and checked on the loop: half a second for a file near the old 1 MiB
    bound, and a reset waited that long. It is read on a thread now (here, a read that waits
    until the loop has turned), one reload at a time: SIGHUPs meanwhile read it once more."""
    import threading

    from kvpubd.daemon.service import Service
    from kvpubd.daemon.settings import Settings
    from tests.loop_turns import until

    settings = Settings(
        events={"endpoint": f"ipc://{tmp_path}/ev", "replay_endpoint": ""},
        control={"endpoint": f"ipc://{tmp_path}/ctl"},
        service={"linger_ms": 0},
    )
    go_on = threading.Event()
    reads: list[bool] = []  # whether each read was let go on (else it gave up waiting)

    reading = threading.Event()

    def read() -> Settings:
        reading.set()
        reads.append(go_on.wait(5.0))
        return settings

    service = Service(settings, reload_settings=read)
    await service.startup()
    try:
        service.reload()
        # The loop turns while the read waits on its thread (read inline, it waited its 5 s
        # out, and each SIGHUP read the file again).
        await until(reading.is_set, "the read")
        service.reload()  # during the read: one more read after it
        service.reload()  # and no more than one
        go_on.set()
        reloading = service._reloading
        assert reloading is not None
        await until(reloading.done, "the reloads")
        assert reads == [True, True]
    finally:
        go_on.set()
        await service.shutdown()


async def test_sighup_with_kv_cache_groups_unchanged_names_nothing_changed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``cache.groups`` compared as models on one side and dicts on the other: never equal, so
    every SIGHUP of a hybrid cache warned that it had changed and wanted a restart."""
    import logging

    from kvpubd.daemon.service import Service
    from kvpubd.daemon.settings import Settings
    from tests.hybrid import hybrid_cache
    from tests.loop_turns import until

    settings = Settings(
        cache=hybrid_cache(),
        events={"endpoint": f"ipc://{tmp_path}/ev", "replay_endpoint": ""},
        control={"endpoint": f"ipc://{tmp_path}/ctl"},
        service={"linger_ms": 0},
    )
    service = Service(settings, reload_settings=lambda: settings.model_copy(deep=True))
    await service.startup()
    try:
        with caplog.at_level(logging.INFO, "kvpubd"):
            service.reload()
            await until(lambda: "SIGHUP: reloaded" in caplog.text, "the reload")
        assert "changed; restart the daemon" not in caplog.text, caplog.text
    finally:
        await service.shutdown()
