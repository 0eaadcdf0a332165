"""CURVE keys both sides use: the certificate files (``kvpubd keys`` writes them with
``create_keys``), loading them, and making a socket a CURVE client. The server side (the
daemon's authenticator and its authorised-keys directory) is ``kvpubd.daemon.curve``. Secret
keys are never logged: only certificate paths and public keys are."""

from __future__ import annotations

import errno
from pathlib import Path

import zmq
import zmq.auth


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


def apply_curve_client(
    sock: zmq.Socket[object], secret_file: Path, server_public_file: Path
) -> None:
    """Make ``sock`` a CURVE client with its own certificate, trusting the server's key."""
    public, secret = load_secret_certificate(secret_file)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = load_public_certificate(server_public_file)


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
