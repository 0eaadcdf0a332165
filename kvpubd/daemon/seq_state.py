"""The last seq a rank may have sent, kept in a small file so that the next run continues the
seq space (``seq_origin = "continue"``): its first batch, ``AllBlocksCleared``, is the old
run's last seq + 1, which every consumer applies in order, whatever it keeps of the old run.

The file is written with one ``pwrite`` before each batch goes out: the kernel holds the
write in its page cache, so a kill -9 cannot lose it, and no fsync is paid per batch (one at
start and one at a clean stop). ``pwrite`` rather than a mapping: a file truncated under a
mapping kills the process with SIGBUS. A second daemon on the same file is refused (flock).

Layout, 24 bytes: magic, the seq, the seq's complement (a bad pair is a corrupt file).
"No seq yet" is ``ff`` x 8, which is never a seq.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from kvpubd.daemon.endpoint_lock import make_parents

log = logging.getLogger("kvpubd")

MAGIC = b"kvpseq1\n"
_PAIR = struct.Struct(">QQ")
_MASK = (1 << 64) - 1
NO_SEQ = _MASK  # ff x 8: nothing sent yet
SEQ_OFFSET = len(MAGIC)
FILE_SIZE = SEQ_OFFSET + _PAIR.size


class SeqStateInUse(RuntimeError):
    """Another daemon holds the file: it publishes on the same events endpoint."""


def default_state_dir() -> Path:
    """Where the files live unless ``events.seq_state_dir`` says: systemd's StateDirectory
    ($STATE_DIRECTORY), else $XDG_STATE_HOME/kvpubd, else ~/.local/state/kvpubd. On disk, not
    in the runtime directory: a reboot must not lose it (routers outlive the machine's boot)."""
    systemd = os.environ.get("STATE_DIRECTORY")
    if systemd:
        return Path(systemd.split(":")[0])
    base = os.environ.get("XDG_STATE_HOME")
    if not base:
        try:
            base = str(Path.home() / ".local" / "state")
        except RuntimeError:  # no $HOME and no passwd entry (a container's bare uid)
            raise OSError("no home directory to keep it in") from None
    return Path(base) / "kvpubd"


def state_path(directory: Path, rank: int, events_endpoint: str) -> Path:
    """One file per rank's events endpoint (what consumers know the stream by): a rank served
    by another daemon, or another daemon's rank 0, has its own."""
    digest = hashlib.sha256(events_endpoint.encode()).hexdigest()[:16]
    return directory / f"rank{rank}-{digest}.seq"


@dataclass(slots=True)
class Loaded:
    """What the file said: the last seq the previous run may have sent (None: no run sent
    anything, or no usable file), and why it was not usable, if it was not."""

    last_seq: int | None
    problem: str | None = None


class SeqState:
    """An open, locked state file; ``record(seq)`` before each batch is sent."""

    def __init__(self, path: Path, fd: int, loaded: Loaded) -> None:
        self.path = path
        self.loaded = loaded
        self._fd = fd  # -1 once closed
        self._write_failed = False

    @classmethod
    def open(cls, path: Path) -> SeqState:
        """Open (creating it and its directory if missing), lock and read ``path``; the file
        then says "nothing sent yet by this run", i.e. the previous run's value, made durable
        once. SeqStateInUse if another daemon holds it; OSError if it cannot be used."""
        make_parents(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise SeqStateInUse(f"seq state file {path} is in use by another daemon") from None
            loaded = _parse(os.pread(fd, FILE_SIZE + 1, 0))
            keep = NO_SEQ if loaded.last_seq is None else loaded.last_seq
            os.pwrite(fd, MAGIC + _PAIR.pack(keep, keep ^ _MASK), 0)
            os.ftruncate(fd, FILE_SIZE)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, loaded)

    def record(self, seq: int) -> None:
        """Keep ``seq`` as the last one that may have been sent (the hot path: one pwrite)."""
        try:
            os.pwrite(self._fd, _PAIR.pack(seq, seq ^ _MASK), SEQ_OFFSET)
        except OSError as exc:
            if not self._write_failed:  # once: every batch would say it again
                self._write_failed = True
                log.warning(
                    "seq state file %s: %s; a restart may not continue this run's seqs",
                    self.path,
                    exc,
                )

    def close(self) -> None:
        """Make the last seq durable (a clean stop, then a power loss, still continues)."""
        if self._fd < 0:
            return
        try:
            os.fsync(self._fd)
        except OSError as exc:
            log.warning("seq state file %s: %s", self.path, exc)
        os.close(self._fd)
        self._fd = -1


def _parse(data: bytes) -> Loaded:
    if not data:
        return Loaded(None)  # a new file: the first run
    if len(data) != FILE_SIZE or not data.startswith(MAGIC):
        return Loaded(None, f"not a seq state file ({len(data)} bytes)")
    seq, check = _PAIR.unpack_from(data, SEQ_OFFSET)
    if seq ^ check != _MASK:
        return Loaded(None, "its seq does not match its check")
    return Loaded(None if seq == NO_SEQ else seq)


def open_seq_state(directory: str, rank: int, events_endpoint: str) -> SeqState | None:
    """The rank's state file, its problems logged; None where no file can be kept (a
    read-only or full disk, a directory this user may not write): the run then starts at 0,
    as a first run does. SeqStateInUse propagates: two daemons must not share one stream."""
    path: Path | str = directory or "(default directory)"
    try:
        base = Path(directory) if directory else default_state_dir()
        path = state_path(base, rank, events_endpoint)
        state = SeqState.open(path)
    except OSError as exc:
        log.warning(
            "rank %d: seq state file %s: %s; seqs start at 0 and a restart will not continue "
            "them (set events.seq_state_dir)",
            rank,
            path,
            exc.strerror or exc,
        )
        return None
    loaded = state.loaded
    if loaded.problem is not None:
        log.warning(
            "rank %d: seq state file %s is corrupt (%s): seqs start at 0, as in a first run",
            rank,
            path,
            loaded.problem,
        )
    elif loaded.last_seq is None:
        log.info("rank %d: no earlier run in %s: seqs start at 0", rank, path)
    else:
        log.info("rank %d: continuing after seq %d (%s)", rank, loaded.last_seq, path)
    return state
