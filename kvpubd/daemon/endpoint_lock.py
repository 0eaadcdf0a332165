"""One daemon per control endpoint, decided by an ``flock`` taken before anything is bound.

The lock file of an ipc endpoint lies beside its socket file (``control.sock.lock``); an
abstract ipc name (``ipc://@name``) or a tcp endpoint is keyed by the endpoint in the runtime
directory. The file holds the owner's pid, so the refusal can name it. The kernel drops the
lock when its holder dies, however it dies: no stale lock is ever mistaken for a live daemon,
and no live daemon for a stale one (a ping can time out on a busy daemon)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import stat
import tempfile
from pathlib import Path

import zmq


class EndpointInUse(RuntimeError):
    def __init__(self, endpoint: str, pid: int | None, what: str = "control endpoint") -> None:
        owner = f" (pid {pid})" if pid is not None else ""
        super().__init__(f"{what} {endpoint} is in use by a running daemon{owner}")
        self.pid = pid


class UnsafeDirectory(RuntimeError):
    """A directory whose name others can predict is not this user's alone."""


def check_owner_only(directory: Path) -> None:
    """Raise UnsafeDirectory unless ``directory`` is a directory of this user that no one else
    may write to. The default runtime directory's name is predictable (/tmp/kvpubd-<uid>): a
    user who made it first could replace the control socket in it with their own."""
    info = directory.lstat()
    if not stat.S_ISDIR(info.st_mode):
        problem = "is not a directory (a symlink?)"
    elif info.st_uid != os.getuid():
        problem = f"belongs to uid {info.st_uid}, not this user"
    elif info.st_mode & 0o022:
        problem = f"may be written by others (mode {stat.S_IMODE(info.st_mode):o})"
    else:
        return
    raise UnsafeDirectory(
        f"runtime directory {directory} {problem}: remove it, or set XDG_RUNTIME_DIR or "
        "control.endpoint"
    )


def ipc_path(endpoint: str) -> Path | None:
    """The socket file of an ipc endpoint; None for tcp, inproc, abstract names and
    ``ipc://*`` (a fresh path libzmq picks)."""
    if not endpoint.startswith("ipc://"):
        return None
    address = endpoint.removeprefix("ipc://")
    return None if address.startswith("@") or address == "*" else Path(address)


def bind_ipc_safely(sock: zmq.Socket[bytes], endpoint: str) -> None:
    """Bind; for an abstract name, from an empty directory: libzmq unlinks the path it is
    given before binding, and would remove a file named ``@name`` in the working directory."""
    if not endpoint.startswith("ipc://@"):
        sock.bind(endpoint)
        return
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="kvpubd-bind-") as empty:
        os.chdir(empty)  # start-up: the loop runs nothing else that could see the change
        try:
            sock.bind(endpoint)
        finally:
            os.chdir(cwd)


def _beside(socket_file: Path) -> Path:
    """The lock file of an ipc socket file: next to it (``control.sock.lock``)."""
    return socket_file.with_name(socket_file.name + ".lock")


def lock_path(endpoint: str, runtime_dir: Path) -> Path | None:
    """Where the lock of ``endpoint`` lives; None for inproc (one process, nothing to share)."""
    if endpoint.startswith("inproc://"):
        return None
    path = ipc_path(endpoint)
    if path is not None:
        return _beside(path)
    digest = hashlib.sha256(endpoint.encode()).hexdigest()[:16]
    return runtime_dir / f"control-{digest}.lock"


class EndpointLock:
    """Held from ``acquire`` until ``release`` (or the process's death)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, endpoint: str, path: Path, what: str = "control endpoint") -> EndpointLock:
        """Take the lock at ``path``; EndpointInUse naming the holder's pid if another has it."""
        while True:
            # O_NOFOLLOW: in a shared directory (an events socket in /tmp), a symlink put
            # where the lock goes must not make the pid write truncate someone's file.
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = _read_pid(fd)
                os.close(fd)
                raise EndpointInUse(endpoint, pid, what) from None
            except BaseException:
                os.close(fd)
                raise
            # The holder before us may have unlinked the file after we opened it: a lock on a
            # removed file guards nothing, so take the one on the path as it is now.
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                return cls(path, fd)
            os.close(fd)

    def release(self) -> None:
        if self._fd is None:
            return
        # Unlink while still holding the lock, so no one can lock the file we are removing.
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None


def lock_socket_files(endpoints: list[tuple[str, str]]) -> list[EndpointLock]:
    """Lock the socket file of each ``(what, endpoint)`` that has one, before it is bound:
    libzmq binds an ipc path by removing whatever socket is there, so a second daemon on the
    same path would silently take the first one's subscribers (and remove its socket when it
    stops). tcp and abstract names need no lock: their bind fails while another holds them.
    A path whose directory is missing is left to the bind, which names it."""
    locks: list[EndpointLock] = []
    try:
        for what, endpoint in endpoints:
            path = ipc_path(endpoint)
            if path is not None and path.parent.is_dir():
                locks.append(EndpointLock.acquire(endpoint, _beside(path), what))
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return locks


def _read_pid(fd: int) -> int | None:
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return int(text) if text.isdigit() else None


def make_parents(path: Path) -> list[Path]:
    """Create ``path``'s missing parent directories (owner-only); returns those it created,
    deepest first, so that a daemon removes what it made and nothing else."""
    missing = []
    parent = path.parent
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=0o700)
        except FileExistsError:
            missing.remove(directory)  # someone else made it meanwhile: theirs to remove
    return missing


def remove_dirs(directories: list[Path]) -> None:
    """Remove directories made by ``make_parents`` if they are empty now."""
    for directory in directories:
        try:
            directory.rmdir()
        except OSError:
            return  # not empty (someone else's files): leave it and its parents
