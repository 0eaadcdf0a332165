"""A tool that starts its own daemon (`demo`, `bench`) ends on SIGTERM or Ctrl-C with one line
and leaves nothing behind: no `kvpubd serve` child, no shared memory segment, no temp dir;
killed outright, its daemon still goes with it. `loadgen` releases what it holds open."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest

from kvpubd.client import ControlClient, ControlTimeout
from kvpubd.daemon.pool import SHM_DIR, pool_segment_name
from kvpubd.daemon.settings import load_settings
from tests.daemon import Daemon, wait_for
from tests.test_cli import ENV

# Tools and their daemons, signalled: processes.
pytestmark = pytest.mark.daemon_process


@dataclass
class ChildDaemon:
    """The `kvpubd serve` a tool started, as found from outside."""

    pid: int
    directory: Path
    control_endpoint: str

    @property
    def segment(self) -> Path:
        return SHM_DIR / pool_segment_name(self.control_endpoint, 0)

    def answers(self) -> bool:
        try:
            with ControlClient(self.control_endpoint, timeout=0.2) as client:
                client.ping()
        except ControlTimeout:
            return False
        return True

    def gone(self) -> bool:
        return not Path(f"/proc/{self.pid}").exists() or _zombie(self.pid)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return False


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except FileNotFoundError:
        return []
    return [int(child) for child in text.split()]


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    except FileNotFoundError:
        return []


def _sigint_in(pid: int, mask: str) -> bool:
    """SIGINT is in the process's ``mask`` of /proc/PID/status (SigIgn: ignored, SigCgt:
    caught by a handler, SigBlk: blocked)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{mask}:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGINT - 1)))
    return False


def _find_daemon(tool: subprocess.Popen[str]) -> ChildDaemon | None:
    for pid in _children(tool.pid):
        args = _cmdline(pid)
        if "serve" in args and "--config" in args:
            config = Path(args[args.index("--config") + 1])
            endpoint = load_settings(config).control.endpoint
            return ChildDaemon(pid, config.parent, endpoint)
    return None


def _spawned_helpers(tool: subprocess.Popen[str]) -> list[int]:
    """The tool's multiprocessing children (bench's subscriber processes)."""
    return [pid for pid in _children(tool.pid) if any("spawn_main" in a for a in _cmdline(pid))]


@pytest.fixture
def tools() -> Iterator[list[subprocess.Popen[str]]]:
    """Tools started by a test; any still running at its end is killed with its group."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def _start(tools: list[subprocess.Popen[str]], *args: str) -> subprocess.Popen[str]:
    # A session of its own: Ctrl-C can be sent to its whole process group, as a terminal does.
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpubd", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        start_new_session=True,
    )
    tools.append(proc)
    return proc


def _assert_ended_cleanly(
    proc: subprocess.Popen[str],
    child: ChildDaemon,
    code: int,
    line: str,
    blank_lines: bool = False,
) -> None:
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    lines = [x for x in err.splitlines() if x] if blank_lines else err.splitlines()
    assert lines == [line], err
    assert child.gone(), "the tool's daemon outlived it"
    assert not child.segment.exists(), f"{child.segment} left behind"
    assert not child.directory.exists(), f"{child.directory} left behind"


@pytest.mark.parametrize(
    ("signum", "code", "line"),
    [(signal.SIGTERM, 143, "kvpubd: terminated"), (signal.SIGHUP, 129, "kvpubd: hung up")],
)
def test_demo_ends_on_a_signal_with_its_daemon(
    tools: list[subprocess.Popen[str]], signum: int, code: int, line: str
) -> None:
    """SIGTERM (a supervisor), SIGHUP (the terminal closing: it ended the tool at once, its
    temp dir left behind)."""
    demo = _start(tools, "demo", "--duration", "60")
    child = wait_for(lambda: _find_daemon(demo), timeout=30, what="the demo's daemon")
    wait_for(child.answers, timeout=30, what="the demo's daemon to answer")
    demo.send_signal(signum)
    _assert_ended_cleanly(demo, child, code, line)


def test_demo_ctrl_c_while_its_daemon_starts(tools: list[subprocess.Popen[str]]) -> None:
    """Ctrl-C to the tool alone, as soon as its daemon child exists (before it answers)."""
    demo = _start(tools, "demo", "--duration", "60")
    child = wait_for(lambda: _find_daemon(demo), timeout=30, what="the demo's daemon")
    demo.send_signal(signal.SIGINT)
    _assert_ended_cleanly(demo, child, 130, "kvpubd: interrupted")


@pytest.mark.bench
def test_bench_reset_ends_on_sigterm_with_its_daemon(tools: list[subprocess.Popen[str]]) -> None:
    bench = _start(tools, "bench", "reset", "--sizes", "1000", "--resets", "1000000")
    child = wait_for(lambda: _find_daemon(bench), timeout=60, what="the bench's daemon")
    wait_for(child.answers, timeout=30, what="the bench's daemon to answer")
    bench.send_signal(signal.SIGTERM)
    _assert_ended_cleanly(bench, child, 143, "kvpubd: terminated")


@pytest.mark.bench
def test_bench_throughput_ctrl_c_stops_its_processes(tools: list[subprocess.Popen[str]]) -> None:
    """Ctrl-C in a terminal reaches the whole group: the subscriber process the bench spawned
    prints no traceback, and the bench stops it and its daemon. (The daemon is held with
    SIGSTOP meanwhile, so that the bench is surely still running when Ctrl-C comes.)"""
    bench = _start(tools, "bench", "throughput", "--num-blocks", "4096")
    child = wait_for(lambda: _find_daemon(bench), timeout=60, what="the bench's daemon")
    (helper,) = wait_for(lambda: _spawned_helpers(bench), timeout=60, what="its subscriber")
    # Python in it is up (it has its own SIGINT handler): a KeyboardInterrupt there would show.
    wait_for(lambda: _sigint_in(helper, "SigCgt"), timeout=60, what="the subscriber to start")
    # Whenever Ctrl-C comes (also while it starts), the helper leaves it to the bench.
    assert _sigint_in(helper, "SigBlk")
    os.kill(child.pid, signal.SIGSTOP)
    try:
        os.killpg(bench.pid, signal.SIGINT)
    finally:
        os.kill(child.pid, signal.SIGCONT)
    _assert_ended_cleanly(bench, child, 130, "kvpubd: interrupted")
    assert not Path(f"/proc/{helper}").exists() or _zombie(helper)


@pytest.mark.bench
def test_bench_soak_ctrl_c_stops_its_processes(tools: list[subprocess.Popen[str]]) -> None:
    """Ctrl-C in a terminal, mid-soak: its loads and followers printed tracebacks (started
    where Ctrl-C reached them), its daemon stopped under it, and reading what it left pinned
    then failed: exit 1 after 14 s, the daemon's directory left behind."""
    bench = _start(tools, "bench", "soak", "--duration", "120", "--load", "small-stores")
    child = wait_for(lambda: _find_daemon(bench), timeout=60, what="the soak's daemon")
    wait_for(lambda: len(_spawned_helpers(bench)) >= 3, timeout=60, what="its load, followers")
    helpers = _spawned_helpers(bench)
    for helper in helpers:
        wait_for(partial(_sigint_in, helper, "SigCgt"), timeout=60, what="a helper to start")
    os.killpg(bench.pid, signal.SIGINT)
    # (its progress line, cleared, leaves an empty line before the tool's own)
    _assert_ended_cleanly(bench, child, 130, "kvpubd: interrupted", blank_lines=True)
    assert all(not Path(f"/proc/{h}").exists() or _zombie(h) for h in helpers)


def test_a_killed_tool_takes_its_daemon_along(tools: list[subprocess.Popen[str]]) -> None:
    """SIGKILL leaves the tool no chance to clean up: its daemon still stops (and removes its
    segment), because it gets SIGTERM when its parent dies."""
    demo = _start(tools, "demo", "--duration", "60")
    child = wait_for(lambda: _find_daemon(demo), timeout=30, what="the demo's daemon")
    wait_for(child.answers, timeout=30, what="the demo's daemon to answer")
    demo.kill()
    demo.communicate(timeout=30)
    try:
        wait_for(child.gone, timeout=30, what="the orphaned daemon to stop")
        assert not child.segment.exists()
    finally:
        if not child.gone():
            os.kill(child.pid, signal.SIGKILL)
        subprocess.run(["rm", "-rf", str(child.directory)], check=True)


def _requests_open(daemon: Daemon) -> int:
    with daemon.client() as client:
        return client.stats().ranks[0].requests_open


def test_loadgen_releases_its_requests_on_sigterm(
    daemon: Daemon, tools: list[subprocess.Popen[str]]
) -> None:
    load = _start(
        tools, "loadgen", "--control", daemon.control_endpoint, "--duration", "60", "--hold", "60"
    )
    wait_for(lambda: _requests_open(daemon) > 0, timeout=30, what="open requests")
    load.send_signal(signal.SIGTERM)
    out, err = load.communicate(timeout=30)
    assert load.returncode == 143, err
    assert err.strip().splitlines()[-1] == "kvpubd: terminated"
    assert "Traceback" not in err
    assert "stores sent" in out
    assert _requests_open(daemon) == 0


def test_loadgen_ignores_a_second_ctrl_c_while_releasing(
    daemon: Daemon, tools: list[subprocess.Popen[str]]
) -> None:
    """The daemon is stopped (SIGSTOP) so the releases wait; a second Ctrl-C sent while they
    do (loadgen then ignores SIGINT) must not leave requests open."""
    load = _start(
        tools, "loadgen", "--control", daemon.control_endpoint, "--duration", "60", "--hold", "60"
    )
    wait_for(lambda: _requests_open(daemon) > 0, timeout=30, what="open requests")
    assert daemon.proc is not None
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        load.send_signal(signal.SIGINT)
        wait_for(lambda: _sigint_in(load.pid, "SigIgn"), timeout=30, what="loadgen to release")
        load.send_signal(signal.SIGINT)
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    _, err = load.communicate(timeout=30)
    assert load.returncode == 130, err
    assert err.strip().splitlines()[-1] == "kvpubd: interrupted"
    assert "Traceback" not in err
    assert _requests_open(daemon) == 0
