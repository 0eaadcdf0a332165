"""The Python examples of README.md and of every page in docs/ run exactly as printed, against
a daemon started the way the quick start starts it: `kvpubd serve` with the defaults (events
on tcp port 5557, replay on 5657), its control socket in a private runtime directory
(XDG_RUNTIME_DIR, which the examples' default `ControlClient()` follows as well)."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpubd.client import ControlClient, ControlTimeout
from tests.daemon import Daemon, wait_for
from tests.mirrors import snapshot_blocks, store_released, unique_prompt

REPO = Path(__file__).resolve().parent.parent
# README first, then the docs pages by name: the order the examples run in.
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
EXAMPLES = [
    (f"{page.relative_to(REPO)}:{number}", code)
    for page in PAGES
    for number, code in enumerate(
        re.findall(r"^```python\n(.*?)^```", page.read_text(), re.S | re.M)
    )
]
# Examples for a daemon that serves snapshots (tcp://*:5559) run against one of their own.
SNAPSHOT_PORT = re.compile(r"tcp://(?:localhost|127\.0\.0\.1):5559")
EVENTS_PORT = re.compile(r"tcp://(?:localhost|127\.0\.0\.1):5557")
QUICK_START = [(name, code) for name, code in EXAMPLES if not SNAPSHOT_PORT.search(code)]
SNAPSHOTS = [(name, code) for name, code in EXAMPLES if SNAPSHOT_PORT.search(code)]
# The default ports are machine-wide: runs of this test in other checkouts take turns.
LOCK = Path("/tmp/kvpubd-readme-examples.lock")


@pytest.fixture(scope="module")
def quick_start_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    runtime = tmp_path_factory.mktemp("run")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPUBD_")}
    env.update(XDG_RUNTIME_DIR=str(runtime), PYTHONUNBUFFERED="1")
    log = runtime / "daemon.log"
    with open(LOCK, "w") as lock, open(log, "wb") as output:
        fcntl.flock(lock, fcntl.LOCK_EX)
        daemon = subprocess.Popen(
            [sys.executable, "-m", "kvpubd", "serve"], stdout=output, stderr=output, env=env
        )
        try:
            endpoint = f"ipc://{runtime}/kvpubd/control.sock"

            def answers() -> bool:
                assert daemon.poll() is None, f"kvpubd serve exited:\n{log.read_text()}"
                try:
                    with ControlClient(endpoint, timeout=0.2) as client:
                        return bool(client.ping())
                except ControlTimeout:
                    return False

            wait_for(answers, timeout=30, what="the quick start's daemon")
            yield env
        finally:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()


def test_readme_has_the_examples() -> None:
    """Control, Subscriber, AsyncSubscriber and map_pool each have a runnable example, and the
    README one of its own (the engine's side)."""
    assert any(name.startswith("README.md:") for name, _ in EXAMPLES)
    text = "\n".join(code for _, code in EXAMPLES)
    for name in ("ControlClient(", "Subscriber(", "AsyncSubscriber(", "map_pool(", ".batch."):
        assert name in text, name


def _run_example(name: str, code: str, env: dict[str, str]) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert result.returncode == 0, f"example {name}:\n{code}\n{result.stderr}"
    assert result.stdout.strip(), f"example {name} printed nothing"
    print(result.stdout)  # shown with -s: what a reader of the page would see
    return result.stdout


@pytest.mark.process
@pytest.mark.parametrize(("name", "code"), QUICK_START, ids=[name for name, _ in QUICK_START])
def test_readme_example_runs(quick_start_env: dict[str, str], name: str, code: str) -> None:
    _run_example(name, code, quick_start_env)


@pytest.mark.daemon_process
@pytest.mark.parametrize(("name", "code"), SNAPSHOTS, ids=[name for name, _ in SNAPSHOTS])
def test_snapshot_example_runs(name: str, code: str) -> None:
    """As printed, but on a daemon of its own (free ports for the example's 5557 and 5559,
    its control endpoint where ``ControlClient()`` looks) that serves snapshots and holds
    blocks: what the router example prints is what that daemon holds."""
    runtime = Path(tempfile.mkdtemp(prefix="kvx", dir="/tmp"))  # short: an ipc path
    control = f"ipc://{runtime}/kvpubd/control.sock"  # where ControlClient() looks
    daemon = Daemon(
        {"events": {"snapshot_endpoint": True}, "control": {"endpoint": control}},
        transport="tcp",
    )
    try:
        daemon.start()
        with daemon.client() as client:
            store_released(client, unique_prompt(3))
            held = len(snapshot_blocks(client.snapshot(0)))
            seq = client.stats().ranks[0].seq
        ported = SNAPSHOT_PORT.sub(daemon.snapshot_endpoint, code)
        ported = EVENTS_PORT.sub(daemon.events_endpoint, ported)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVPUBD_")}
        env.update(PYTHONUNBUFFERED="1", XDG_RUNTIME_DIR=str(runtime))
        printed = _run_example(name, ported, env)
        if "rank 0 holds" in printed:  # docs/routers.md's router of its own
            assert f"rank 0 holds {held} blocks as of seq " in printed
            assert int(printed.split("as of seq ")[1].split()[0]) >= seq
    finally:
        daemon.cleanup()
        shutil.rmtree(runtime, ignore_errors=True)
