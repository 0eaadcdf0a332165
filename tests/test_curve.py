"""CURVE on the control socket: only authorised clients reach the daemon; the others' resets
and stores have no effect; secret keys never appear in the log."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq.auth

from kvpubd.client import ControlClient, ControlTimeout
from kvpubd.protocol.auth import create_keys
from tests.daemon import Daemon
from tests.streams import prompt


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    server_public, server_secret = create_keys(tmp_path / "server", "server")
    client_public, client_secret = create_keys(tmp_path / "client", "client")
    _, intruder_secret = create_keys(tmp_path / "intruder", "intruder")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "client.key").write_bytes(client_public.read_bytes())
    return {
        "server_public": server_public,
        "server_secret": server_secret,
        "client_secret": client_secret,
        "intruder_secret": intruder_secret,
        "allowed": allowed,
    }


@pytest.fixture
def curve_daemon(keys: dict[str, Path]) -> Iterator[Daemon]:
    control = {
        "curve_secret_key": str(keys["server_secret"]),
        "curve_authorized_keys": str(keys["allowed"]),
    }
    daemon = Daemon({"control": control}, curve=(keys["client_secret"], keys["server_public"]))
    try:
        yield daemon.start()
    finally:
        daemon.cleanup()


def test_authorised_client_works(curve_daemon: Daemon) -> None:
    with curve_daemon.client() as client:
        assert client.ping().epoch == curve_daemon.epoch
        assert len(client.store("ok", prompt(1, 2)).block_ids) == 2
        client.release("ok")
        assert client.reset().markers[0].rank == 0


@pytest.mark.parametrize("who", ["plain", "intruder"])
def test_unauthorised_client_cannot_reset_or_store(
    curve_daemon: Daemon, keys: dict[str, Path], who: str
) -> None:
    with curve_daemon.client() as client:
        client.store("held", prompt(2, 3))
        client.release("held")
        before = client.snapshot()
    curve = None if who == "plain" else (keys["intruder_secret"], keys["server_public"])
    with ControlClient(curve_daemon.control_endpoint, timeout=0.5, curve=curve) as outsider:
        for call in (
            lambda: outsider.reset(force=True).markers,
            lambda: outsider.store("evil", prompt(3, 2)),
        ):
            with pytest.raises(ControlTimeout):
                call()
    with curve_daemon.client() as client:
        after = client.snapshot()
        assert after.seq == before.seq
        assert after.events == before.events
        assert client.stats().ranks[0].resets == 0


def test_secret_keys_never_logged(curve_daemon: Daemon, keys: dict[str, Path]) -> None:
    with curve_daemon.client() as client:
        client.reset()
    assert curve_daemon.stop() == 0
    log = curve_daemon.log()
    server_public, server_secret = zmq.auth.load_certificate(keys["server_secret"])
    assert server_public.decode() in log  # the public key is, so the check can fail
    assert server_secret.decode() not in log
    _, client_secret = zmq.auth.load_certificate(keys["client_secret"])
    assert client_secret.decode() not in log


@pytest.mark.parametrize(
    ("control", "key"),
    [
        ({"curve_secret_key": "SECRET"}, "control.curve_authorized_keys"),
        ({"curve_secret_key": "PUBLIC", "curve_authorized_keys": "ALLOWED"}, "curve_secret_key"),
        ({"curve_secret_key": "SECRET", "curve_authorized_keys": "MISSING"}, "curve_authorized"),
    ],
)
def test_bad_curve_settings_exit_2(
    keys: dict[str, Path], tmp_path: Path, control: dict[str, str], key: str
) -> None:
    paths = {
        "SECRET": str(keys["server_secret"]),
        "PUBLIC": str(keys["server_public"]),
        "ALLOWED": str(keys["allowed"]),
        "MISSING": str(tmp_path / "nowhere"),
    }
    daemon = Daemon({"control": {k: paths[v] for k, v in control.items()}})
    try:
        result = subprocess.run(
            [sys.executable, "-m", "kvpubd", "serve", "--config", str(daemon.config_path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        daemon.cleanup()
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert key in line


def test_cli_with_curve_keys(curve_daemon: Daemon, keys: dict[str, Path]) -> None:
    base = [sys.executable, "-m", "kvpubd", "reset", "--control", curve_daemon.control_endpoint]
    authorised = subprocess.run(
        [
            *base,
            "--curve-key",
            str(keys["client_secret"]),
            "--server-key",
            str(keys["server_public"]),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert authorised.returncode == 0, authorised.stderr
    assert authorised.stdout.startswith("rank 0: marker seq ")
    refused = subprocess.run(
        [*base, "--timeout", "0.3"], capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 1
    assert "daemon" in refused.stderr
