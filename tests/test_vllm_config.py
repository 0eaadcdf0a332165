"""``kvpubd serve --kv-events-config``: vLLM's KVEventsConfig JSON mapped onto [events].

The mapping on its own (every field, every refusal), then real ``serve`` processes: a refused
config exits 2 with one line; an accepted one is what the running daemon binds and says, with
KVPUBD_* environment variables still above it and the JSON above the --config file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpubd.client import ControlClient, ControlTimeout
from kvpubd.daemon.settings import ConfigError
from kvpubd.daemon.vllm_config import load_kv_events_config, map_kv_events_config
from tests.daemon import Daemon, wait_for

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}

# What an operator passes to vLLM (every KVEventsConfig field).
VLLM = {
    "enable_kv_cache_events": True,
    "publisher": "zmq",
    "endpoint": "tcp://*:6557",
    "replay_endpoint": "tcp://*:6657",
    "buffer_steps": 500,
    "hwm": 1000,
    "max_queue_size": 50,
    "topic": "kv@pod-1@llama",
    # The snapshot protocol's fields (vLLM PR #57789).
    "snapshot_endpoint": "tcp://*:6559",
    "snapshot_max_blocks": 1_000_000,
    "snapshot_max_response_bytes": 256 << 20,
}


def test_every_field_maps_or_is_said_to_be_ignored() -> None:
    mapping = map_kv_events_config(VLLM)
    assert mapping.events == {
        "publisher": "zmq",
        "endpoint": "tcp://*:6557",
        "replay_endpoint": "tcp://*:6657",
        "buffer_steps": 500,
        "hwm": 1000,
        "topic": "kv@pod-1@llama",
        "snapshot_endpoint": "tcp://*:6559",
    }
    ignored = [note.split(" ")[0] for note in mapping.ignored]
    assert ignored == ["max_queue_size", "snapshot_max_blocks", "snapshot_max_response_bytes"]
    line = mapping.describe()
    assert "events.topic = 'kv@pod-1@llama'" in line and "ignored max_queue_size" in line


def test_absent_fields_leave_kvpubd_settings_and_null_replay_turns_it_off() -> None:
    assert map_kv_events_config({"topic": "t"}).events == {"topic": "t"}
    assert map_kv_events_config({}).describe().endswith("mapped nothing; ignored nothing")
    assert map_kv_events_config({"replay_endpoint": None}).events == {"replay_endpoint": ""}
    assert map_kv_events_config({"snapshot_endpoint": None}).events == {"snapshot_endpoint": ""}


def test_publisher_names_the_transport_and_null_leaves_kvpubd_s_own() -> None:
    """vLLM's ``publisher`` is events.publisher (which transports exist, only the daemon
    knows: ``kvpubd serve`` checks the name); JSON null is vLLM's default, kvpubd's own here."""
    assert map_kv_events_config({"publisher": "null"}).events == {"publisher": "null"}
    assert map_kv_events_config({"publisher": "nats"}).events == {"publisher": "nats"}
    assert map_kv_events_config({"publisher": None}).events == {}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"enable_kv_cache_events": False}, "enable_kv_cache_events is false"),
        ({"publisher": 7}, "publisher:"),
        ({"endpoint": "http://x"}, "endpoint:"),
        ({"buffer_steps": 0}, "buffer_steps:"),
        ({"hwm": "lots"}, "hwm:"),
        ({"topics": "x"}, "unknown key 'topics'"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_refusals_name_the_field(data: object, message: str) -> None:
    with pytest.raises(ConfigError, match=r"^kv-events-config: ") as raised:
        map_kv_events_config(data)
    assert message in str(raised.value)


def test_file_and_bad_json(tmp_path: Path) -> None:
    path = tmp_path / "kv.json"
    path.write_text(json.dumps({"topic": "from-file"}))
    assert load_kv_events_config(f"@{path}").events == {"topic": "from-file"}
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_kv_events_config("{topic:")
    with pytest.raises(ConfigError, match=r"kv-events-config: .*missing\.json"):
        load_kv_events_config(f"@{tmp_path / 'missing.json'}")


# -- a real serve -----------------------------------------------------------------------------


def serve_command(daemon: Daemon, kv_events_config: str) -> list[str]:
    config = ["--config", str(daemon.config_path), "--kv-events-config", kv_events_config]
    return [sys.executable, "-m", "kvpubd", "serve", *config]


def serve(daemon: Daemon, kv_events_config: str, env: dict[str, str] | None = None) -> Daemon:
    """``kvpubd serve --config <daemon's file> --kv-events-config ...``, waited for."""
    log = open(daemon.log_path, "wb")  # noqa: SIM115 - closed by daemon.stop()
    daemon._log = log
    daemon.proc = subprocess.Popen(
        serve_command(daemon, kv_events_config),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env or ENV,
    )

    def answers() -> bool:
        assert daemon.alive(), daemon.log()
        with daemon.client(timeout=0.2) as client:
            try:
                return bool(client.ping())
            except ControlTimeout:
                return False

    wait_for(answers, timeout=20, what="the daemon")
    return daemon


@pytest.fixture
def fresh() -> Iterator[Daemon]:
    daemon = Daemon({"events": {"topic": "file-topic"}})
    yield daemon
    if daemon.alive():
        daemon.stop()
    daemon.cleanup()


@pytest.mark.process
def test_serve_takes_the_json_over_the_file_and_says_so(fresh: Daemon) -> None:
    """The JSON's topic and buffer_steps beat the --config file's; the file's endpoints (not
    named in the JSON) stay; one log line says what was mapped and what was ignored."""
    config = json.dumps({"enable_kv_cache_events": True, "topic": "kv@p@m", "max_queue_size": 1})
    serve(fresh, config)
    with ControlClient(fresh.control_endpoint) as client:
        endpoints = client.ping().endpoints[0]
    assert endpoints.events == f"{fresh.events_endpoint}_dp0"
    with fresh.subscriber(topic="kv@p@m") as sub:
        assert sub.catch_up(), "nothing replayed under the JSON's topic"
    assert fresh.stop() == 0
    mapped = [line for line in fresh.log().splitlines() if "kv-events-config: mapped" in line]
    assert len(mapped) == 1
    assert "events.topic = 'kv@p@m'" in mapped[0] and "max_queue_size" in mapped[0]


@pytest.mark.process
def test_environment_beats_the_json(fresh: Daemon) -> None:
    serve(fresh, json.dumps({"topic": "json-topic"}), {**ENV, "KVPUBD_EVENTS__TOPIC": "env-topic"})
    with fresh.subscriber(topic="env-topic") as sub:
        assert sub.catch_up()


@pytest.mark.process
@pytest.mark.parametrize(
    ("config", "says"),
    [
        ('{"enable_kv_cache_events": false}', "enable_kv_cache_events is false"),
        ('{"publisher": "nats"}', "events.publisher: 'nats' is no transport kvpubd has"),
        ("not json", "not valid JSON"),
    ],
)
def test_serve_refuses_with_one_line_and_exit_2(fresh: Daemon, config: str, says: str) -> None:
    result = subprocess.run(
        serve_command(fresh, config),
        capture_output=True,
        text=True,
        timeout=30,
        env=ENV,
    )
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("kvpubd: config error: kv-events-config: ") and says in line


@pytest.mark.process
def test_serve_with_vllm_s_null_publisher_publishes_nowhere_and_still_counts(
    fresh: Daemon,
) -> None:
    """``publisher: "null"``: no events endpoint, no replay endpoint; seqs still count."""
    serve(fresh, json.dumps({"publisher": "null"}))
    with ControlClient(fresh.control_endpoint) as client:
        (endpoints,) = client.ping().endpoints
        before = client.stats().ranks[0]
        (marker,) = client.reset().markers
        after = client.stats().ranks[0]
    assert (endpoints.events, endpoints.replay) == ("", "")
    assert (after.endpoint, after.replay_endpoint) == ("", "")
    assert marker.seq == before.seq + 1 == after.seq
    assert after.batches_published == before.batches_published + 1
    assert fresh.stop() == 0
