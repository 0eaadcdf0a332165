"""``Pending`` hands a result on inside ``resolve``: a chain of maps ends in the same step (an
asyncio future would take one loop turn per link, and a request read in between could be
answered first)."""

from __future__ import annotations

import pytest

from kvpubd.daemon.pending import Pending


def test_a_chain_settles_inside_resolve() -> None:
    first: Pending[int] = Pending()
    seen: list[tuple[object, object]] = []
    first.map(lambda n: n + 1).map(str).then(lambda value, error: seen.append((value, error)))
    assert seen == []
    first.resolve(41)
    assert seen == [("42", None)]
    first.resolve(0)  # settled once: later outcomes change nothing
    first.fail(RuntimeError("late"))
    assert seen == [("42", None)]


def test_errors_pass_down_the_chain_and_late_callbacks_run_at_once() -> None:
    first: Pending[int] = Pending()
    mapped = first.map(lambda n: 1 // n)
    failure = ZeroDivisionError("boom")
    first.fail(failure)
    seen: list[tuple[object, object]] = []
    mapped.then(lambda value, error: seen.append((value, error)))
    assert seen == [(None, failure)] and mapped.done
    converted: Pending[int] = Pending()
    broken = converted.map(lambda n: 1 // n)
    converted.resolve(0)  # the conversion itself raises: that is the chain's error
    broken.then(lambda value, error: seen.append((value, type(error))))
    assert seen[-1] == (None, ZeroDivisionError)


def test_a_failing_callback_is_logged_and_the_others_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    first: Pending[int] = Pending()
    seen: list[object] = []
    first.then(lambda value, error: 1 // 0)
    first.then(lambda value, error: seen.append(value))
    first.resolve(7)  # does not raise into the resolver (the store queue's task)
    assert seen == [7]
    assert "callback failed" in caplog.text


async def test_of_future_passes_on_a_result_an_error_and_a_cancel() -> None:
    import asyncio

    loop = asyncio.get_running_loop()
    seen: list[tuple[object, type | None]] = []
    futures = [loop.create_future() for _ in range(3)]
    for future in futures:
        Pending.of_future(future).then(
            lambda value, error: seen.append((value, type(error) if error else None))
        )
    futures[0].set_result("reply")
    futures[1].set_exception(KeyError("x"))
    futures[2].cancel()
    while len(seen) < 3:  # the futures' callbacks run on the next loop turn
        await asyncio.sleep(0)
    assert seen == [("reply", None), (None, KeyError), (None, asyncio.CancelledError)]
