"""How a ``kvpubd`` tool ends on a signal.

SIGTERM (a CI cancel, a supervisor) and SIGHUP (the terminal closed) unwind the tool as Ctrl-C
does, so every ``with`` block that owns a child daemon, a temp dir or open requests cleans up;
the command then exits 143 or 129 instead of 130. ``serve`` keeps its own handlers (SIGINT and
SIGTERM are its normal stop, SIGHUP its reload)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from types import FrameType
from typing import Any

from kvpubd.exits import HUNG_UP, INTERRUPTED, TERMINATED

_received: list[int] = []  # the signals that unwound the tool, first first


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived. A KeyboardInterrupt, so that whatever cleans up after Ctrl-C (and
    whatever turns Ctrl-C into status 130) does the same for it; ``exit_status`` tells them
    apart afterwards."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    _received.append(signum)
    raise Terminated


def terminate_like_interrupt() -> None:
    """From here on SIGTERM and SIGHUP raise ``Terminated`` in the main thread. (A SIGHUP
    left to its default ended the tool at once: its temp dir stayed behind.)"""
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGHUP, _on_sigterm)


def exit_status() -> int:
    """130, or 143 (129) when SIGTERM (SIGHUP) was what stopped the tool."""
    if not _received:
        return INTERRUPTED
    return TERMINATED if _received[0] == signal.SIGTERM else HUNG_UP


def _restore(handlers: Mapping[int, Any]) -> None:
    for signum, handler in handlers.items():
        if handler is not None:  # None: set outside Python, cannot be put back from here
            signal.signal(signum, handler)


@contextmanager
def ignoring(*signums: int) -> Iterator[None]:
    """``signums`` ignored inside. Signal handlers belong to the main thread; in any other
    thread this does nothing. A child process started inside inherits the ignored signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in signums}
    try:
        yield
    finally:
        _restore(previous)


def interrupts_ignored() -> AbstractContextManager[None]:
    """A second Ctrl-C (or SIGTERM) must not cut short the cleanup the first one started:
    releasing requests, stopping a child daemon."""
    return ignoring(signal.SIGINT, signal.SIGTERM)


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM that arrive inside take effect when it ends: for a step that must
    not be cut in two, such as starting a child whose handle would otherwise be lost (a
    KeyboardInterrupt raised inside ``subprocess.Popen`` after the fork leaves a child no one
    can stop). Main thread only, as ``ignoring``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []

    def record(signum: int, frame: FrameType | None) -> None:
        arrived.append(signum)

    previous: dict[int, Any] = {
        signum: signal.signal(signum, record) for signum in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield
    finally:
        _restore(previous)
        if arrived:
            signal.raise_signal(arrived[0])  # now handled as it would have been


@contextmanager
def ctrl_c_kept_from_children() -> Iterator[None]:
    """For starting helper processes. Ctrl-C in a terminal reaches the whole process group,
    and only the tool should act on it (it stops its helpers; a helper that raised
    KeyboardInterrupt itself would print a traceback). Children started inside inherit
    SIGINT blocked, for life; here a Ctrl-C meanwhile takes effect at the end, not lost.
    Main thread only, as ``ignoring``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # multiprocessing starts its resource tracker with the first spawned child and unblocks
    # SIGINT after it (its own guard): start it first, or the children after it would not
    # inherit the block.
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    with interrupts_deferred():
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
