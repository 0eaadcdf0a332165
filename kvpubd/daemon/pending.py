"""A result that arrives on a later loop turn and is handed on at once.

An asyncio future runs its callbacks on a later turn of the loop, one turn per link of a
chain. A store done in slices passes its result through the pipeline, the operations and the
control server before its reply is sent: as futures, requests read in between (a reset) could
take effect and be answered first, and the reply would describe blocks the reset had already
removed. A ``Pending`` runs its callbacks inside ``resolve``/``fail``: the reply goes out in
the same step in which the store finishes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
U = TypeVar("U")


class Pending(Generic[T]):
    def __init__(self) -> None:
        self._callbacks: list[Callable[[T | None, BaseException | None], object]] = []
        self._outcome: tuple[T | None, BaseException | None] | None = None

    @classmethod
    def of_future(cls, future: asyncio.Future[T]) -> Pending[T]:
        """The outcome of an asyncio future (a cancel as CancelledError), when it comes."""
        pending: Pending[T] = cls()

        def settle(done: asyncio.Future[T]) -> None:
            if done.cancelled():
                pending.fail(asyncio.CancelledError())
            elif (error := done.exception()) is not None:
                pending.fail(error)
            else:
                pending.resolve(done.result())

        future.add_done_callback(settle)
        return pending

    @property
    def done(self) -> bool:
        return self._outcome is not None

    def resolve(self, value: T) -> None:
        self._finish(value, None)

    def fail(self, error: BaseException) -> None:
        self._finish(None, error)

    def settle_as(self, value: T | None, error: BaseException | None) -> None:
        """Take another result's outcome (a callback for its ``then``): its error, or its
        value (none, and no error: cancelled)."""
        if error is not None or value is None:
            self.fail(error or asyncio.CancelledError())
        else:
            self.resolve(value)

    def then(self, callback: Callable[[T | None, BaseException | None], object]) -> None:
        """Call ``callback(value, error)`` when done (at once if it is already)."""
        if self._outcome is not None:
            callback(*self._outcome)
        else:
            self._callbacks.append(callback)

    def map(self, convert: Callable[[T], U]) -> Pending[U]:
        """The converted value, or the same error; resolved in the same step as this one."""
        mapped: Pending[U] = Pending()

        def pass_on(value: T | None, error: BaseException | None) -> None:
            if error is not None:
                mapped.fail(error)
                return
            try:
                converted = convert(value)  # type: ignore[arg-type]
            except Exception as exc:
                mapped.fail(exc)
            else:
                mapped.resolve(converted)

        self.then(pass_on)
        return mapped

    def _finish(self, value: T | None, error: BaseException | None) -> None:
        if self._outcome is not None:
            return  # resolved once; a later cancel of a finished store changes nothing
        if error is not None:
            # Receivers want the error, not where it was raised. Its traceback holds the
            # raising frames, whose locals (the request, megabytes of its tokens) hold this
            # result: a cycle only a full collection would free, and those are rare here.
            error.__traceback__ = None
        self._outcome = (value, error)
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback(value, error)
            except Exception:  # a bug in one receiver: logged, the resolver goes on
                log.exception("a pending result's callback failed")
