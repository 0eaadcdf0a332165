"""The helper processes of the store benches (subscribers, senders, fillers, paced loads):
each spawned (a fresh interpreter, no state forked from the bench) with a pipe to the bench,
and stopped when the bench's ``with`` block ends, however it ends."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from kvpubd.interrupts import ctrl_c_kept_from_children
from kvpubd.tools.launcher import tied

# How long a child that finished its work gets to exit by itself after a complete run.
EXIT_GRACE_S = 10.0


def start_child(stack: ExitStack, target: Callable[..., None], *args: Any) -> Any:
    """Start ``target(*args, pipe)`` in a spawned process; returns the bench's end of the
    pipe. The process is a daemon process: a failed run never waits on a child that waits
    for a command."""
    spawn = multiprocessing.get_context("spawn")
    ours, theirs = spawn.Pipe()
    child = spawn.Process(**tied(target, (*args, theirs)), daemon=True)
    with ctrl_c_kept_from_children():  # Ctrl-C is the bench's to handle: it stops the child
        child.start()
    stack.push(_stopper(child))
    return ours


def _stopper(child: Any) -> Callable[..., None]:
    """An exit callback: after a complete run the child reports and ends by itself; after
    a failure or Ctrl-C it may wait for a command that never comes, so it is stopped at once."""

    def stop(exc_type: type[BaseException] | None, *_: object) -> None:
        child.join(EXIT_GRACE_S if exc_type is None else 0)
        if child.is_alive():
            child.terminate()
            child.join()

    return stop


def answer(pipe: Any, what: str, timeout_s: float = 120.0) -> Any:
    """The next message from a child; TimeoutError naming ``what`` if none comes in time."""
    if not pipe.poll(timeout_s):
        raise TimeoutError(f"{what} did not answer within {timeout_s:g} s")
    return pipe.recv()
