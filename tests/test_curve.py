"""CURVE on the control socket: only authorised clients reach the daemon; the others' resets
and stores have no effect; secret keys never appear in the log."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq.auth

from kvpubd.client import ControlClient, ControlError, ControlTimeout
from kvpubd.protocol.auth import create_keys
from tests.daemon import Daemon, wait_for
from tests.streams import prompt
from tests.test_cli import ENV, kvpubd_all

# CURVE through the command line and real daemons: processes.
pytestmark = pytest.mark.process


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
            lambda: outsider.reset(force=True),
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
    assert server_secret is not None  # a secret key file holds both keys
    assert server_secret.decode() not in log
    _, client_secret = zmq.auth.load_certificate(keys["client_secret"])
    assert client_secret is not None
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
    result = serve_exit({k: paths[v] for k, v in control.items()})
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert key in line


def test_every_client_command_speaks_curve(curve_daemon: Daemon, keys: dict[str, Path]) -> None:
    """ping, stats, reset, loadgen and subscribe --control work with the keys from
    KVPUBD_CURVE_KEY / KVPUBD_SERVER_KEY (reset with --curve-key / --server-key); without
    them each fails in one line that hints at CURVE, exit 1."""
    control = ["--control", curve_daemon.control_endpoint]
    subscribe = [
        "subscribe",
        "--endpoint",
        curve_daemon.events_endpoint,
        "--replay",
        "",  # without replay, the control snapshot is what catches the subscriber up
        *control,
        "--count",
        "1",
    ]
    commands = [
        ["ping", *control],
        ["stats", *control],
        ["loadgen", *control, "--duration", "0.5", "--rate", "20"],
    ]
    env = {
        **ENV,
        "KVPUBD_CURVE_KEY": str(keys["client_secret"]),
        "KVPUBD_SERVER_KEY": str(keys["server_public"]),
    }
    # The subscriber prints only what is published after it caught up (said on stderr): the
    # store comes then, not from the loadgen, which may be done by the time it is up.
    follower = subprocess.Popen(
        [sys.executable, "-m", "kvpubd", *subscribe],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        for command, result in zip(commands, kvpubd_all(*commands, env=env), strict=True):
            assert result.returncode == 0, (command, result.stderr)
            assert result.stdout, command
        assert follower.stderr is not None
        caught_up = follower.stderr.readline()
        assert "mirror rebuilt" in caught_up, caught_up
        with curve_daemon.client() as client:
            client.store("after", prompt(1, 1))
            client.release("after")
        out, err = follower.communicate(timeout=30)
        assert follower.returncode == 0, err
        assert out, "subscribe printed nothing"
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.communicate()
    flags = ["--curve-key", str(keys["client_secret"]), "--server-key", str(keys["server_public"])]
    (authorised,) = kvpubd_all(["reset", *control, *flags])
    assert authorised.returncode == 0, authorised.stderr
    assert authorised.stdout.startswith("rank 0: marker seq ")

    short = ["--timeout", "0.3"]
    refused = [[*c, *short] for c in [*commands[:3], ["reset", *control]]]
    for command, result in zip(refused, kvpubd_all(*refused), strict=True):
        assert result.returncode == 1, (command, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, (command, result.stderr)
        assert "daemon" in lines[0] and "--curve-key" in lines[0], lines[0]


def serve_exit(control: dict[str, str]) -> subprocess.CompletedProcess[str]:
    daemon = Daemon({"control": control})
    try:
        return subprocess.run(
            [sys.executable, "-m", "kvpubd", "serve", "--config", str(daemon.config_path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        daemon.cleanup()


@pytest.mark.parametrize(
    "content",
    ["garbage\n", 'curve\n    public-key = "tooshort"\n', 'curve\n    public-key = "' + "~" * 40],
)
def test_malformed_authorised_key_exits_2_naming_it(keys: dict[str, Path], content: str) -> None:
    """pyzmq skips a file it cannot read as a certificate: before, every client whose key was in
    it was locked out while the daemon logged `ready`."""
    bad = keys["allowed"] / "broken.key"
    bad.write_text(content)
    result = serve_exit(
        {
            "curve_secret_key": str(keys["server_secret"]),
            "curve_authorized_keys": str(keys["allowed"]),
        }
    )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("kvpubd: config error: control.curve_authorized_keys: ")
    assert str(bad) in line


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_secret_key_readable_by_others_exits_2(keys: dict[str, Path], mode: int) -> None:
    keys["server_secret"].chmod(mode)
    result = serve_exit(
        {
            "curve_secret_key": str(keys["server_secret"]),
            "curve_authorized_keys": str(keys["allowed"]),
        }
    )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert str(keys["server_secret"]) in line and f"mode {mode:04o}" in line


def test_rejected_clients_are_logged_rate_limited(
    curve_daemon: Daemon, keys: dict[str, Path]
) -> None:
    """A client with an unknown key is named in a warning, once per interval however often it
    retries; an authorised client is not."""
    intruder_key = zmq.auth.load_certificate(keys["intruder_secret"])[0].decode()
    for _ in range(5):
        curve = (keys["intruder_secret"], keys["server_public"])
        with (
            ControlClient(curve_daemon.control_endpoint, timeout=0.2, curve=curve) as outsider,
            pytest.raises(ControlTimeout),
        ):
            outsider.ping()
    with curve_daemon.client() as client:
        client.ping()
    wait_for(lambda: intruder_key in curve_daemon.log(), what="the rejection's log line")
    rejected = [line for line in curve_daemon.log().splitlines() if "rejected a CURVE" in line]
    assert len(rejected) == 1, rejected
    assert "WARNING" in rejected[0] and intruder_key in rejected[0]


def test_sighup_reloads_authorised_keys(curve_daemon: Daemon, keys: dict[str, Path]) -> None:
    curve = (keys["intruder_secret"], keys["server_public"])
    with (
        ControlClient(curve_daemon.control_endpoint, timeout=0.3, curve=curve) as newcomer,
        pytest.raises(ControlTimeout),
    ):
        newcomer.ping()
    public = keys["intruder_secret"].with_suffix(".key")
    (keys["allowed"] / "newcomer.key").write_bytes(public.read_bytes())
    assert curve_daemon.proc is not None
    curve_daemon.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "SIGHUP: reloaded" in curve_daemon.log(), what="the reload")
    assert "2 authorised CURVE client key(s)" in curve_daemon.log()
    with ControlClient(curve_daemon.control_endpoint, timeout=5, curve=curve) as newcomer:
        assert newcomer.ping().epoch == curve_daemon.epoch
    assert curve_daemon.alive()
    assert curve_daemon.stop() == 0


def test_a_revoked_key_cuts_off_a_client_already_connected(
    curve_daemon: Daemon, keys: dict[str, Path]
) -> None:
    """Revoking a key (remove its file, SIGHUP) stops its connection already established:
    every later request is refused ``unauthorized`` and changes nothing."""
    granted = keys["allowed"] / "newcomer.key"
    granted.write_bytes(keys["intruder_secret"].with_suffix(".key").read_bytes())
    assert curve_daemon.proc is not None
    curve_daemon.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "2 authorised CURVE client key(s)" in curve_daemon.log(), what="the grant")
    curve = (keys["intruder_secret"], keys["server_public"])
    with ControlClient(curve_daemon.control_endpoint, timeout=5, curve=curve) as revoked:
        assert revoked.ping().epoch == curve_daemon.epoch
        granted.unlink()
        curve_daemon.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "1 authorised CURVE client key(s)" in curve_daemon.log(), what="revoke")
        for attempt in (lambda: revoked.reset(), lambda: revoked.store("late", prompt(1, 2))):
            with pytest.raises(ControlError) as refused:
                attempt()
            assert refused.value.code == "unauthorized"
    with curve_daemon.client() as client:
        stats = client.stats().ranks[0]
        assert (stats.resets, stats.requests_open) == (0, 0)
