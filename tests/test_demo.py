"""``kvpubd demo`` end to end, ``kvpubd loadgen`` against a real daemon, and the workload."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvpubd.tools.loadgen import DEFAULT_MIX, KINDS, Workload, parse_mix
from tests.daemon import Daemon


def kvpubd(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    # A wide terminal keeps rich from wrapping the summary's lines.
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "kvpubd", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.mark.process
def test_demo_completes_with_exit_0_and_a_summary() -> None:
    result = kvpubd("demo", "--duration", "3", "--rate", "150")
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    events = re.search(r"events seen\s*│ (\d+): (\d+) BlockStored", out)
    assert events and int(events.group(2)) > 0, out
    assert re.search(r"gaps repaired\s*│ \d+ gap\(s\), \d+ batches through replay", out), out
    assert re.search(r"reset latency\s*│ reply [\d.]+ ms, marker at the subscriber [\d.]+ ms", out)
    assert "the cache rebuilt from events equals the daemon's snapshot" in out


@pytest.mark.process
def test_loadgen_drives_a_running_daemon(daemon: Daemon) -> None:
    result = kvpubd(
        "loadgen",
        "--control",
        daemon.control_endpoint,
        "--rate",
        "100",
        "--duration",
        "1",
        "--hold",
        "0.01",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["requests"] > 0
    assert summary["sent"]["store"] == summary["requests"] + sum(
        n for code, n in summary["errors"].items() if code == "pool_exhausted"
    )
    assert summary["released"] == summary["requests"]
    assert 0 < summary["cached_tokens"] < summary["prompt_tokens"]  # prefixes are shared
    with daemon.client() as client:
        rank = client.stats().ranks[0]
    assert rank.requests_open == 0 and rank.blocks_pinned == 0  # all released


@pytest.mark.process
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["loadgen", "--prompt-mix", "chat=1,chat=2"], "--prompt-mix: prompt mix"),
        (["loadgen", "--prompt-mix", "chat=0"], "no kind has a positive weight"),
        (["loadgen", "--rate", "-1"], "--rate: -1.0 is not a positive number"),
        (["loadgen", "--hold", "nan"], "--hold: nan is not a number of seconds >= 0"),
        (["demo", "--duration", "1"], "--duration: 1.0 is not between 2 and 3600 seconds"),
    ],
)
def test_bad_options_exit_2_with_one_line(args: list[str], message: str) -> None:
    result = kvpubd(*args)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert message in result.stderr


@pytest.mark.process
def test_loadgen_without_a_daemon_says_so(tmp_path: Path) -> None:
    result = kvpubd(
        "loadgen", "--control", f"ipc://{tmp_path}/none", "--timeout", "0.3", "--duration", "1"
    )
    assert result.returncode == 1
    assert "is the daemon running?" in result.stderr


# -- the workload -------------------------------------------------------------------------------


def test_parse_mix_normalizes_weights() -> None:
    assert parse_mix("chat=3, doc=1") == {"chat": 0.75, "doc": 0.25}
    assert set(parse_mix(DEFAULT_MIX)) == set(KINDS)
    for bad in ("chat", "video=1", "chat=-1", "chat=inf", "chat=1,doc=x", ""):
        with pytest.raises(ValueError, match="prompt mix"):
            parse_mix(bad)


def test_workload_is_seeded_and_shares_prefixes() -> None:
    a, b = Workload(parse_mix(DEFAULT_MIX), seed=7), Workload(parse_mix(DEFAULT_MIX), seed=7)
    prompts = [a.next() for _ in range(300)]
    assert [p.tokens for p in prompts] == [b.next().tokens for _ in range(300)]
    assert {p.kind for p in prompts} == set(KINDS)

    last_turn: dict[int, list[int]] = {}
    for p in prompts:
        if p.kind == "chat":
            # A conversation's next turn extends its previous prompt, or starts over from a
            # shared system prompt.
            before = last_turn.get(p.key)
            assert (before is not None and p.tokens[: len(before)] == before) or any(
                p.tokens[: len(s)] == s for s in a.system_prompts
            )
            last_turn[p.key] = p.tokens
        elif p.kind == "doc":
            document = a.documents[p.key]
            assert p.tokens[: len(document)] == document and len(p.tokens) > len(document)
