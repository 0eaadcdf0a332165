"""One daemon per control endpoint, decided by a lock: a second daemon on the same config exits 1
with one line naming the first's pid and touches nothing of it (sockets, socket file, pool
segment), however busy or deaf to it (CURVE) the first is. Abstract ipc control names work; a
failed start leaves no directory behind and does not log `stopped`."""

from __future__ import annotations

import itertools
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvpubd.client import ControlClient
from kvpubd.daemon.pool import pool_segment_name
from kvpubd.protocol.auth import create_keys
from kvpubd.protocol.wire import decode_batch
from kvpubd.tools.launcher import free_tcp_ports
from tests.daemon import Daemon, wait_for, write_config
from tests.streams import prompt

# A second daemon beside a first: processes.
pytestmark = pytest.mark.process


def serve(config: Path, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvpubd", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def published_after(daemon: Daemon, client: ControlClient) -> bool:
    """A subscriber connected now receives the batch of a store made now."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.subscribe(b"")
    sub.connect(f"{daemon.events_endpoint}_dp0")
    try:
        attempts = itertools.count()

        def stored() -> bool:
            # A new prompt each time: a stored one would be a cache hit and publish nothing,
            # so a first batch missed by the joining SUB would never be followed by another.
            client.store("probe", prompt(7 + next(attempts), 1))
            client.release("probe")
            if not sub.poll(200):
                return False
            return bool(decode_batch(sub.recv_multipart()[-1]).events)

        return wait_for(stored, what="a batch from the first daemon")
    finally:
        sub.close()


@pytest.mark.parametrize("first", ["curve", "busy"])
def test_second_daemon_refuses_and_touches_nothing(tmp_path: Path, first: str) -> None:
    overrides: dict[str, dict[str, Any]] = {}
    curve = None
    if first == "curve":
        # The first daemon cannot answer an unauthenticated ping: a ping probe calls it dead.
        _, server_secret = create_keys(tmp_path / "server", "server")
        client_public, client_secret = create_keys(tmp_path / "client", "client")
        allowed = tmp_path / "allowed"
        allowed.mkdir()
        (allowed / "client.key").write_bytes(client_public.read_bytes())
        overrides["control"] = {
            "curve_secret_key": str(server_secret),
            "curve_authorized_keys": str(allowed),
        }
        curve = (client_secret, tmp_path / "server" / "server.key")
    daemon = Daemon(overrides, curve=curve)
    try:
        daemon.start()
        assert daemon.proc is not None
        control_file = Path(daemon.control_endpoint.removeprefix("ipc://"))
        segment = Path("/dev/shm") / pool_segment_name(daemon.control_endpoint, 0)
        assert control_file.exists() and segment.exists()
        with daemon.client() as client:
            if first == "busy":
                # A loop that does not answer for a while (stopped here, so for as long as the
                # second daemon takes): a ping probe would call it dead.
                daemon.proc.send_signal(signal.SIGSTOP)
            try:
                second = serve(daemon.config_path)
            finally:
                daemon.proc.send_signal(signal.SIGCONT)
            assert second.returncode == 1, second.stderr
            assert second.stderr.strip().splitlines() == [
                f"kvpubd: cannot start: control endpoint {daemon.control_endpoint} is in use "
                f"by a running daemon (pid {daemon.proc.pid})"
            ]
            # Nothing of the first was touched: it answers, its files exist, it publishes.
            assert daemon.alive()
            assert client.ping().epoch == daemon.epoch
            assert control_file.exists() and segment.exists()
            assert published_after(daemon, client)
        assert "removed stale" not in daemon.log()
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()


def test_second_daemon_on_a_tcp_control_endpoint_refuses(tmp_path: Path) -> None:
    events, replay, control = free_tcp_ports(3)
    daemon = Daemon({"control": {"endpoint": f"tcp://127.0.0.1:{control}"}})
    try:
        daemon.control_endpoint = f"tcp://127.0.0.1:{control}"
        daemon.start()
        # Other PUB and replay ports: only the lock can stop this one.
        config = tmp_path / "second.toml"
        write_config(
            config,
            {
                **daemon.settings,
                "events": {
                    "endpoint": f"tcp://127.0.0.1:{events}",
                    "replay_endpoint": f"tcp://127.0.0.1:{replay}",
                },
            },
        )
        second = serve(config)
        assert second.returncode == 1
        assert daemon.proc is not None
        assert f"is in use by a running daemon (pid {daemon.proc.pid})" in second.stderr
        with daemon.client() as client:
            assert client.ping().epoch == daemon.epoch
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()


@pytest.mark.parametrize("shared", ["events", "replay"])
def test_second_daemon_on_another_control_endpoint_keeps_off_the_ipc_sockets(
    tmp_path: Path, shared: str
) -> None:
    """Its own control endpoint, but the first one's ipc events (or replay) socket: libzmq
    would bind it by removing the first one's socket file, stealing its subscribers and
    leaving it unreachable once the second stops. The lock beside the socket file refuses
    the second, naming the rank, the endpoint and the first's pid."""
    daemon = Daemon({"cache": {"data_parallel_size": 2}})
    try:
        daemon.start()
        settings = {section: dict(values) for section, values in daemon.settings.items()}
        settings["control"]["endpoint"] = f"ipc://{tmp_path}/second.sock"
        # Rank 1 alone, from rank 1: only that rank's socket is shared.
        settings["cache"].update(data_parallel_start_rank=1, data_parallel_size=1)
        other = f"ipc://{tmp_path}/own"
        if shared == "events":
            settings["events"]["replay_endpoint"] = other
        else:
            settings["events"]["endpoint"] = other
        config = tmp_path / "second.toml"
        write_config(config, settings)
        second = serve(config)
        assert second.returncode == 1, second.stderr
        base = daemon.events_endpoint if shared == "events" else daemon.replay_endpoint
        assert daemon.proc is not None
        # The process that holds rank 1's sockets: the daemon's, or (ranks in worker
        # processes, the default for two ranks) its worker's.
        pid = daemon.proc.pid
        workers = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1, lines
        named = lines[0].rpartition("(pid ")[2].rstrip(")")
        assert named in (str(pid), *workers), (named, pid, workers)
        assert lines[0] == (
            f"kvpubd: cannot start: rank 1 {shared} endpoint {base}_dp1 is in use by a running "
            f"daemon (pid {named})"
        )
        assert Path(f"{base.removeprefix('ipc://')}_dp1").exists()
        with daemon.client() as client:
            assert client.ping().epoch == daemon.epoch
            assert published_after(daemon, client)
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()


def test_abstract_ipc_control_endpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`ipc://@name` binds an abstract socket: no file named `@name` is made, chmod-ed or
    removed (a file of that name in the working directory survives), and the lock holds."""
    monkeypatch.chdir(tmp_path)
    name = f"@kvpubd-test-{secrets.token_hex(6)}"
    bystander = tmp_path / name
    bystander.write_text("not the daemon's")
    daemon = Daemon({"control": {"endpoint": f"ipc://{name}"}})
    daemon.control_endpoint = f"ipc://{name}"
    try:
        daemon.start()
        with daemon.client() as client:
            assert client.reset().markers[0].rank == 0
        second = serve(daemon.config_path)
        assert second.returncode == 1
        assert f"control endpoint ipc://{name} is in use" in second.stderr
        assert daemon.stop() == 0
        assert bystander.read_text() == "not the daemon's"
        assert sorted(p.name for p in tmp_path.iterdir()) == [name]
        # And it can start again on the same name once the first is gone.
        daemon2 = Daemon({"control": {"endpoint": f"ipc://{name}"}})
        daemon2.control_endpoint = f"ipc://{name}"
        try:
            daemon2.start()
            assert daemon2.stop() == 0
        finally:
            daemon2.cleanup()
    finally:
        daemon.cleanup()


def test_failed_start_leaves_no_directory_and_logs_no_stopped(tmp_path: Path) -> None:
    """A start that fails after the control socket's directory was made (its PUB port is
    taken) removes that directory again and does not log `stopped`."""
    blocker: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
    blocker.setsockopt(zmq.LINGER, 0)
    port = blocker.bind_to_random_port("tcp://127.0.0.1")
    try:
        control_dir = tmp_path / "run" / "kvpubd"
        config = tmp_path / "kvpubd.toml"
        write_config(
            config,
            {
                "events": {"endpoint": f"tcp://127.0.0.1:{port}", "replay_endpoint": ""},
                "control": {"endpoint": f"ipc://{control_dir}/control.sock"},
                "cache": {"num_blocks": 16, "num_layers": 1, "num_kv_heads": 1, "head_dim": 8},
            },
        )
        result = serve(config)
    finally:
        blocker.close()
    assert result.returncode == 1
    assert "kvpubd: cannot start:" in result.stderr
    assert "stopped" not in result.stderr
    assert not (tmp_path / "run").exists()
    assert not list(
        Path("/dev/shm").glob(pool_segment_name(f"ipc://{control_dir}/control.sock", 0))
    )


def test_a_symlink_where_a_socket_lock_goes_is_refused_and_its_target_untouched(
    tmp_path: Path,
) -> None:
    """An events socket in a directory others can write to: a symlink planted where its lock
    file goes stops the start with one line, and the file it points to keeps its content (the
    lock's pid write would have truncated it)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (shared / "events_dp0.lock").symlink_to(victim)
    daemon = Daemon({"events": {"endpoint": f"ipc://{shared}/events"}})
    try:
        write_config(daemon.config_path, daemon.settings)
        result = serve(daemon.config_path)
        assert result.returncode == 1, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kvpubd: cannot start: cannot lock"), lines
        assert "events_dp0.lock" in lines[0]
        assert victim.read_text() == "precious\n"
        assert not (shared / "events_dp0").exists()
    finally:
        daemon.cleanup()


@pytest.mark.parametrize("made_by", ["this user, writable by all", "another user"])
def test_a_runtime_directory_others_control_is_refused(tmp_path: Path, made_by: str) -> None:
    """The default runtime directory's name is predictable (/tmp/kvpubd-<uid> without
    XDG_RUNTIME_DIR): one that someone else made first, or that others may write to, could
    have the control socket swapped under the daemon. The start stops with one line naming
    it, before anything is bound or written there."""
    if made_by == "another user" and os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    runtime = tmp_path / "xdg" / "kvpubd"
    runtime.mkdir(parents=True)
    if made_by == "another user":
        runtime.chmod(0o700)
        os.chown(runtime, 65534, 65534)
        problem = "belongs to uid 65534, not this user"
    else:
        runtime.chmod(0o777)
        problem = "may be written by others (mode 777)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPUBD_")}
    env.update(
        XDG_RUNTIME_DIR=str(tmp_path / "xdg"),
        KVPUBD_EVENTS__ENDPOINT=f"ipc://{tmp_path}/events",
        KVPUBD_EVENTS__REPLAY_ENDPOINT=f"ipc://{tmp_path}/replay",
    )
    result = subprocess.run(
        [sys.executable, "-m", "kvpubd", "serve"],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"kvpubd: cannot start: runtime directory {runtime} {problem}: remove it, or set "
        "XDG_RUNTIME_DIR or control.endpoint"
    ]
    assert list(runtime.iterdir()) == []
    assert not any(tmp_path.glob("events*"))
