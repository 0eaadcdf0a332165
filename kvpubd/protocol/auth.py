"""Optional CURVE authentication of the control socket, with pyzmq's ``zmq.auth``.

Keys are ZeroMQ certificate files (``kvpubd keys`` writes them): the daemon loads its secret
certificate and accepts only clients whose public certificates lie in the authorised-keys
directory. A client that is not authorised never completes the handshake, so none of its
requests reach the daemon. Secret keys are never logged: only certificate paths and public
keys are."""

from __future__ import annotations

import errno
import logging
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger(__name__)


class AuthError(ValueError):
    """A key file or directory that cannot be used."""


def load_secret_certificate(path: Path) -> tuple[bytes, bytes]:
    """(public, secret) from a ``.key_secret`` certificate; AuthError when it has no secret."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise AuthError(f"{path}: not a readable ZeroMQ certificate ({exc})") from None
    if not secret:
        raise AuthError(f"{path}: holds no secret key (use the .key_secret file)")
    return public, secret


def load_public_certificate(path: Path) -> bytes:
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise AuthError(f"{path}: not a readable ZeroMQ certificate ({exc})") from None
    return public


class CurveServer:
    """Makes a socket a CURVE server that admits only the authorised clients."""

    def __init__(self, context: zmq.Context, secret_file: Path, authorized_dir: Path) -> None:
        self.public, self._secret = load_secret_certificate(secret_file)
        if not authorized_dir.is_dir():
            raise AuthError(f"{authorized_dir}: not a directory of client public keys")
        self._authenticator = ThreadAuthenticator(context, log=log)
        self._authenticator.start()
        self._authenticator.configure_curve(domain="*", location=str(authorized_dir))
        clients = sorted(authorized_dir.glob("*.key"))
        log.info(
            "control: CURVE on, server key %s, %d authorised client key(s) in %s",
            self.public.decode(),
            len(clients),
            authorized_dir,
        )

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_secretkey = self._secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def stop(self) -> None:
        self._authenticator.stop()


def apply_curve_client(sock: zmq.Socket, secret_file: Path, server_public_file: Path) -> None:
    """Make ``sock`` a CURVE client with its own certificate, trusting the server's key."""
    public, secret = load_secret_certificate(secret_file)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = load_public_certificate(server_public_file)


def check_curve_settings(control: Any) -> None:
    """Raise ConfigError naming the key when CURVE is configured with unusable files."""
    from kvpubd.protocol.config import ConfigError

    if not control.curve_secret_key:
        return
    try:
        load_secret_certificate(Path(control.curve_secret_key))
    except AuthError as exc:
        raise ConfigError(f"control.curve_secret_key: {exc}") from None
    if not Path(control.curve_authorized_keys).is_dir():
        raise ConfigError(
            f"control.curve_authorized_keys: {control.curve_authorized_keys} is not a directory"
        )


def create_keys(directory: Path, name: str, force: bool = False) -> tuple[Path, Path]:
    """Write ``name.key`` (public) and ``name.key_secret`` (owner-only) into ``directory``.
    Existing files raise FileExistsError unless ``force``: replacing the secret key locks out
    every client that trusts the old public key."""
    if not force:
        for existing in (directory / f"{name}.key", directory / f"{name}.key_secret"):
            if existing.exists():
                raise FileExistsError(errno.EEXIST, "exists", str(existing))
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(directory, name)
    Path(secret).chmod(0o600)
    return Path(public), Path(secret)
