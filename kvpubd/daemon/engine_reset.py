"""The engine's own reset (``upstream.reset_url``), called on a thread of its own per rank.

A reset on the control socket publishes its marker at once and then asks the engine to clear
(vLLM's ``POST /reset_prefix_cache``). The loop never waits for the engine: calls go to one
thread, in order. However slow or broken the engine's HTTP server, that stays one thread and at
most ``MAX_WAITING`` calls waiting; a reset past them, or one the thread cannot be started for,
is not passed on (one log line: the fence after the reset then ends at its timeout), and
whatever a call meets is one log line.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import urllib.request

log = logging.getLogger(__name__)

MAX_WAITING = 16
TIMEOUT_S = 10.0  # of each socket operation (connect, each read)


class EngineResetCaller:
    def __init__(self, url: str, timeout: float = TIMEOUT_S) -> None:
        self.url = url
        self.timeout = timeout
        # True: a call; False: the thread's end (close).
        self._waiting: queue.Queue[bool] = queue.Queue(MAX_WAITING)
        self._thread: threading.Thread | None = None
        self._closed = False

    def call(self) -> bool:
        """Ask the engine to reset, on the caller's thread; False if the call was not passed
        on."""
        try:
            self._waiting.put_nowait(True)
        except queue.Full:
            log.warning(
                "upstream: %d calls of the engine's reset %s are waiting already; "
                "this reset does not call it",
                MAX_WAITING,
                self.url,
            )
            return False
        if self._thread is None:
            thread = threading.Thread(target=self._run, name="kvpubd engine reset", daemon=True)
            try:
                thread.start()
            except RuntimeError as exc:  # no thread to be had (a pid or memory limit)
                self._waiting.get_nowait()
                log.warning("upstream: the engine's reset %s not called: %s", self.url, exc)
                return False
            self._thread = thread
        return True

    def close(self) -> None:
        """End the thread, with no more calls (it does not outlive its daemon's pipeline, in
        a process that runs several); never waits, whatever the engine holds it in."""
        self._closed = True
        if self._thread is not None:
            with contextlib.suppress(queue.Full):  # full: it ends after the call it makes
                self._waiting.put_nowait(False)
            self._thread = None

    def _run(self) -> None:
        while self._waiting.get() and not self._closed:
            self._post()

    def _post(self) -> None:
        try:
            request = urllib.request.Request(self.url, data=b"", method="POST")
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                log.info("upstream: %s answered %d", self.url, response.status)
        except Exception as exc:  # whatever the engine's server does: one line, no traceback
            log.warning("upstream: the engine's reset %s failed: %r", self.url, exc)
