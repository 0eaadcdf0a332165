"""The daemon's service hosted on a thread of the test process: the same sockets, the same
endpoints and the same client API as a ``kvpubd serve`` child, without a process to start.

For tests whose contract is on the sockets (what a client or a subscriber sees). A test that
needs a process (exit statuses, signals, logs, kill -9, restarts, resource limits) uses
``tests.daemon.Daemon``; ``ServiceThread`` has no ``proc`` and no ``log``, so a test that
reaches for them fails at once instead of quietly testing less.
"""

from __future__ import annotations

import asyncio
import gc
import shutil
import threading
from typing import Any

from kvpubd.daemon.service import Service
from kvpubd.daemon.settings import Settings
from tests.daemon import Daemon

START_TIMEOUT_S = 20.0


class ServiceThread(Daemon):
    """``start()`` runs ``Service`` startup, main loop and shutdown on a thread with its own
    asyncio loop, and returns once the service answers on its control socket."""

    def __init__(self, overrides: dict[str, dict[str, Any]] | None = None) -> None:
        super().__init__(overrides)
        self.service: Service | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Event()
        self._failure: BaseException | None = None

    def start(self, timeout: float = START_TIMEOUT_S, preexec_fn: Any = None) -> ServiceThread:
        assert preexec_fn is None, "a service thread has no process to prepare"
        self.service = Service(Settings.model_validate(self.settings))
        self._started.clear()
        self._thread = threading.Thread(target=self._run, name="kvpubd-service", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise RuntimeError("the service thread did not start")
        if self._failure is not None:
            raise RuntimeError(f"the service failed to start: {self._failure!r}")
        self.epoch = self.service.epoch
        return self

    def _run(self) -> None:
        assert self.service is not None
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            # The daemon's own lifetime, as `kvpubd serve` runs it (less the signal handlers).
            loop.run_until_complete(self.service.lifetime(started=self._started.set))
        except BaseException as exc:  # reported by start() or stop()
            self._failure = exc
        finally:
            self._started.set()
            loop.close()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, sig: int = 0, timeout: float = 20.0) -> int:
        """Ask the service to exit as SIGTERM would; 0 after a clean shutdown, else 1."""
        assert sig == 0, "a service thread takes no signals: use tests.daemon.Daemon"
        thread, loop, service = self._thread, self._loop, self.service
        if thread is None or loop is None or service is None:
            return 0
        if thread.is_alive():
            loop.call_soon_threadsafe(service.request_exit)
            thread.join(timeout)
            if thread.is_alive():
                raise RuntimeError("the service thread did not stop")
        self._thread = None
        gc.unfreeze()  # start-up froze the test process's objects along with the service's
        return 0 if self._failure is None else 1

    def cleanup(self) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    @property
    def proc(self) -> Any:
        raise AttributeError("a service thread has no process: use tests.daemon.Daemon")

    @proc.setter
    def proc(self, value: Any) -> None:
        if value is not None:
            raise AttributeError("a service thread has no process")

    def log(self) -> str:
        raise AttributeError("a service thread has no log file: use tests.daemon.Daemon")
