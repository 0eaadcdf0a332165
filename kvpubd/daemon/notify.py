"""systemd's notify protocol (sd_notify(3)), without libsystemd.

Under ``Type=notify`` systemd passes ``NOTIFY_SOCKET``: a unix datagram socket, a path or an
abstract name written with a leading ``@``. Each message is one datagram of newline-separated
``KEY=VALUE`` assignments (``READY=1``, ``STOPPING=1``, ``WATCHDOG=1``, ``STATUS=...``).
With ``WatchdogSec=`` set, systemd also passes ``WATCHDOG_USEC`` (and ``WATCHDOG_PID``, the
process it expects the pings from).

Sending never blocks and never raises: a lost notification must not stop the daemon."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)


class Notifier:
    """Sends notifications to ``NOTIFY_SOCKET``; a no-op when it is unset."""

    def __init__(self, notify_socket: str | None) -> None:
        self.address = _address(notify_socket) if notify_socket else None
        self._sock: socket.socket | None = None
        self._failed = False
        if notify_socket and self.address is None:
            log.warning(
                "NOTIFY_SOCKET=%r is not a unix socket address; not notifying", notify_socket
            )

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> Notifier:
        return cls(environ.get("NOTIFY_SOCKET") or None)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *assignments: str) -> bool:
        """Send ``KEY=VALUE`` lines as one datagram; True if it was sent."""
        if self.address is None:
            return False
        message = "\n".join(assignments).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                # A full receive queue must not stall the event loop.
                self._sock.setblocking(False)
            self._sock.sendto(message, self.address)
        except OSError as exc:
            # Say it once: a watchdog ping every few seconds must not flood the log.
            if not self._failed:
                log.warning("cannot notify systemd at %s: %s", _display(self.address), exc)
            self._failed = True
            return False
        self._failed = False
        return True

    def ready(self, status: str | None = None) -> bool:
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def stopping(self, status: str | None = None) -> bool:
        return self.notify("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def watchdog_interval(
    environ: Mapping[str, str] = os.environ, pid: int | None = None
) -> float | None:
    """Seconds between watchdog pings (half of ``WATCHDOG_USEC``), or None when systemd expects
    none from this process: unset, not a positive integer, or ``WATCHDOG_PID`` names another."""
    usec = environ.get("WATCHDOG_USEC")
    if not usec:
        return None
    expected_pid = environ.get("WATCHDOG_PID")
    if expected_pid and expected_pid != str(os.getpid() if pid is None else pid):
        return None
    if not usec.isdigit() or int(usec) == 0:
        log.warning("WATCHDOG_USEC=%r is not a positive integer; not pinging the watchdog", usec)
        return None
    return int(usec) / 1e6 / 2


def _address(value: str) -> str | None:
    if value.startswith("@"):
        return "\0" + value[1:]  # the abstract namespace
    if value.startswith("/"):
        return value
    return None  # e.g. vsock: addresses, which only VMs' service managers use


def _display(address: str) -> str:
    return "@" + address[1:] if address.startswith("\0") else address
