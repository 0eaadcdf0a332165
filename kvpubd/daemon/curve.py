"""Optional CURVE authentication of the control socket, the server side, with pyzmq's
``zmq.auth``: the daemon loads its secret certificate and accepts only clients whose public
certificates lie in the authorised-keys directory. A client that is not authorised never
completes the handshake, so none of its requests reach the daemon. Secret keys are never
logged: only certificate paths and public keys are."""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any

import zmq
import zmq.utils.z85
from zmq.auth.thread import ThreadAuthenticator

from kvpubd.daemon.settings import ConfigError, ControlConfig
from kvpubd.protocol.auth import AuthError, load_public_certificate, load_secret_certificate

log = logging.getLogger(__name__)


_Z85_CHARS = set(zmq.utils.z85.Z85CHARS)
# Key files read per loop turn on a reload: each costs tens of microseconds, so 2000 read in
# one step held a reset back for 0.1-0.2 s.
KEY_FILES_PER_TURN = 16
MAX_KEY_FILE_BYTES = 64 << 10


class CurveServer:
    """Makes a socket a CURVE server that admits only the authorised clients."""

    def __init__(
        self, context: zmq.Context[zmq.Socket[bytes]], secret_file: Path, authorized_dir: Path
    ) -> None:
        self.public, self._secret = load_secret_certificate(secret_file)
        if not authorized_dir.is_dir():
            raise AuthError(f"{authorized_dir}: not a directory of client public keys")
        self.authorized_dir = authorized_dir
        self._authenticator = _LoggingAuthenticator(context, log=log)
        self._authenticator.start()
        keys = authorized_keys(authorized_dir)
        self.authorize(keys)
        log.info(
            "control: CURVE on, server key %s, %d authorised client key(s) in %s",
            self.public.decode(),
            len(keys),
            authorized_dir,
        )

    def authorize(self, keys: list[bytes]) -> None:
        """Admit exactly these client keys. pyzmq's ``configure_curve`` would parse every
        file again; one assignment also means its thread sees the old set or the new one."""
        self._authenticator.allow_any = False
        self._authenticator.certs["*"] = dict.fromkeys(keys, True)

    async def reload(self) -> int:
        """Read the authorised keys again (SIGHUP), ``KEY_FILES_PER_TURN`` directory entries
        per loop turn (the listing too: thousands of entries take milliseconds), then admit
        them; returns how many there are. AuthError leaves the keys loaded before in force."""
        keys = []
        try:
            with os.scandir(self.authorized_dir) as entries:
                for seen, entry in enumerate(entries, 1):
                    if entry.name.endswith(".key"):
                        keys.append(read_authorized_key(Path(entry.path)))
                    if seen % KEY_FILES_PER_TURN == 0:
                        await asyncio.sleep(0)
        except OSError as exc:
            raise AuthError(f"{self.authorized_dir}: {exc.strerror}") from None
        self.authorize(keys)
        return len(keys)

    def admits(self, user_id: str | None) -> bool:
        """Whether a request's ``User-Id`` (the client's public key, z85, which the
        authenticator gives every connection it admits) is still authorised: a key removed
        since the client connected, and reloaded, no longer reaches anything."""
        if user_id is None:
            return False
        admitted = self._authenticator.certs.get("*", {})
        return user_id.encode() in admitted

    def apply(self, sock: zmq.Socket[bytes]) -> None:
        sock.curve_secretkey = self._secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def stop(self) -> None:
        self._authenticator.stop()


# At most one "rejected" line per interval; the rest are counted into the next one.
REJECT_LOG_INTERVAL_S = 10.0


class _LoggingAuthenticator(ThreadAuthenticator):
    """pyzmq's authenticator, warning about clients whose key is not authorised
    (rate-limited: a client retrying in a loop must not flood the log)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()
        self._next_log = 0.0
        self._suppressed = 0

    def _authenticate_curve(self, domain: str, client_key: bytes) -> Any:
        # A coroutine in recent pyzmq, a plain result in older ones: pass on whichever it is.
        result = super()._authenticate_curve(domain, client_key)
        if not inspect.isawaitable(result):
            return self._checked(result, client_key)

        async def checked() -> tuple[bool, bytes]:
            return self._checked(await result, client_key)

        return checked()

    def _checked(self, result: tuple[bool, bytes], client_key: bytes) -> tuple[bool, bytes]:
        if not result[0]:
            self._rejected(zmq.utils.z85.encode(client_key).decode())
        return result

    def _rejected(self, client_key: str) -> None:
        with self._lock:
            now = time.monotonic()
            if now < self._next_log:
                self._suppressed += 1
                return
            suppressed, self._suppressed = self._suppressed, 0
            self._next_log = now + REJECT_LOG_INTERVAL_S
        more = f" (and {suppressed} more since the last such line)" if suppressed else ""
        log.warning(
            "control: rejected a CURVE client whose key %s is not authorised%s", client_key, more
        )


def check_curve_settings(control: ControlConfig) -> None:
    """Raise ConfigError naming the key when CURVE is configured with unusable files."""
    if not control.curve_secret_key:
        return
    try:
        load_secret_certificate(Path(control.curve_secret_key))
    except AuthError as exc:
        raise ConfigError(f"control.curve_secret_key: {exc}") from None
    secret = Path(control.curve_secret_key)
    mode = secret.stat().st_mode
    if mode & 0o077:
        raise ConfigError(
            f"control.curve_secret_key: {secret} is open to group or others (mode "
            f"{stat.S_IMODE(mode):04o}); chmod 600 {secret}"
        )
    authorized = Path(control.curve_authorized_keys)
    if not authorized.is_dir():
        raise ConfigError(f"control.curve_authorized_keys: {authorized} is not a directory")
    try:
        authorized_keys(authorized)
    except AuthError as exc:
        raise ConfigError(f"control.curve_authorized_keys: {exc}") from None


def authorized_keys(directory: Path) -> list[bytes]:
    """The public keys of every ``*.key`` certificate in ``directory``; AuthError naming the
    first file that is not one (pyzmq would skip it, and lock its client out silently)."""
    return [read_authorized_key(path) for path in authorized_key_files(directory)]


def authorized_key_files(directory: Path) -> list[Path]:
    """The ``*.key`` files of ``directory``, sorted."""
    try:
        with os.scandir(directory) as entries:
            names = [entry.name for entry in entries if entry.name.endswith(".key")]
    except OSError as exc:
        raise AuthError(f"{directory}: {exc.strerror}") from None
    return [directory / name for name in sorted(names)]


def read_authorized_key(path: Path) -> bytes:
    """The public key of one client certificate; AuthError unless it is a regular file of at
    most ``MAX_KEY_FILE_BYTES`` holding a 40-character Z85 key (a FIFO would block the
    reading loop until a writer came)."""
    try:
        info = path.stat()
    except OSError as exc:
        raise AuthError(f"{path}: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise AuthError(f"{path}: not a regular file")
    if info.st_size > MAX_KEY_FILE_BYTES:
        raise AuthError(f"{path}: {info.st_size} bytes; a certificate is under 1 KiB")
    public = load_public_certificate(path)
    if len(public) != 40 or not set(public) <= _Z85_CHARS:
        raise AuthError(f"{path}: its public key is not a 40-character Z85 CURVE key")
    return public
