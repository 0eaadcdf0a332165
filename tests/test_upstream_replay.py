"""The replay answer's messages, in both framings engines send."""

from __future__ import annotations

import pytest

from kvpubd.protocol.wire import END_SEQ, pack_seq
from kvpubd.upstream.replay import parse_replay_message


def test_both_framings_and_the_end_marker() -> None:
    assert parse_replay_message([b"", b"topic", pack_seq(7), b"p"]) == (7, b"p")
    assert parse_replay_message([b"", pack_seq(8), b"q"]) == (8, b"q")  # older SGLang
    assert parse_replay_message([b"", b"", END_SEQ, b""]) is None
    assert parse_replay_message([b"", END_SEQ, b""]) is None


@pytest.mark.parametrize(
    "frames",
    [[pack_seq(1), b"p"], [b"x", b"t", pack_seq(1), b"p"], [b"", b"t", b"\x01", b"p"], [b""] * 5],
)
def test_anything_else_is_refused(frames: list[bytes]) -> None:
    with pytest.raises(ValueError):
        parse_replay_message(frames)
