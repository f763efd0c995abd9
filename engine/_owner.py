"""One owner per store: an advisory lock that the serving engine holds for its lifetime.

Two engines writing one store break it: LMDB tolerates a second writer process, but the text
index has one writer, the ANN graphs are saved by whoever closes last, and the session
counters live in one process's RAM. So ``Engine.open`` and every command that rewrites a store
(``compact``, ``restore --overwrite``, ``reindex``) first take an exclusive ``flock`` on
``owner.lock`` in the store directory, without waiting. ``flock`` locks belong to an open file,
so a second open in the same process is refused like one from another process, and the kernel
drops the lock when the owner's process ends however it ends (``kill -9`` included): a lock
file left behind by a crash never blocks anyone.

The file holds the owner's pid and what it is doing, for the message a refused caller gets.
Readers (``Engine.open(read_only=True)``) take no lock: LMDB serves readers of other processes
while one writes, and the text index is read as its owner last committed it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
from pathlib import Path

import msgspec

from actors.base.errors import EngineBroken, InvalidInput, StoreInUse

from ._files import PATH_ERRNOS, aside, refused, resolved

__all__ = ["OwnerLock", "LOCK_NAME", "SNAPSHOT_DATA", "SNAPSHOT_STORE", "MANIFEST_NAME",
           "alone_in_lmdb", "claim_in_process", "in_a_snapshot", "release_in_process"]

LOCK_NAME = "owner.lock"
# A snapshot's layout: its manifest, and the store's data.mdb in a folder of this name.
MANIFEST_NAME = "manifest.json"
SNAPSHOT_STORE = "store"
SNAPSHOT_DATA = f"{SNAPSHOT_STORE}/data.mdb"  # the one file every snapshot has

# Store directories (device, inode) that an engine of this process has open, owner or reader:
# LMDB must not have one environment open twice in a process (closing either would drop the
# other's locks on lock.mdb), so a second engine on a store here is refused before LMDB opens.
_OPEN_HERE: dict[tuple[int, int], str] = {}

# The owner locks' descriptors this process holds. A child forked meanwhile (a pre-forking
# server, a pool's worker) inherits them, and an flock lives while any descriptor of it is
# open: the child closes its copies at once, or the parent could not open its own store
# again until the child exited. The same for the text index's writer lock, which tantivy
# takes with flock on a file of its own (LMDB's locks are fcntl's, which a child never has).
_HELD: set[int] = set()
_TANTIVY_LOCKS = ("/.tantivy-writer.lock", "/.tantivy-meta.lock")


def _drop_in_child() -> None:
    for fd in _HELD:
        with contextlib.suppress(OSError):
            os.close(fd)
    if _HELD:
        with contextlib.suppress(OSError):
            for name in os.listdir("/proc/self/fd"):
                with contextlib.suppress(OSError, ValueError):
                    if os.readlink(f"/proc/self/fd/{name}").endswith(_TANTIVY_LOCKS):
                        os.close(int(name))
    _HELD.clear()


os.register_at_fork(after_in_child=_drop_in_child)


def in_a_snapshot(path: Path) -> bool:
    """Whether ``path`` is the copy of a store inside a snapshot: ``<snapshot>/store`` beside
    a manifest that lists its data.mdb (another program's manifest.json beside a store
    folder of that name is no snapshot's)."""
    if path.name != SNAPSHOT_STORE:
        return False
    try:
        manifest = msgspec.json.decode((path.parent / MANIFEST_NAME).read_bytes())
    except (OSError, msgspec.DecodeError):
        return False
    files = manifest.get("files") if isinstance(manifest, dict) else None
    return (isinstance(files, dict) and SNAPSHOT_DATA in files
            and "schema_version" in manifest)


class OwnerLock:
    """The exclusive lock on a store; :meth:`acquire` it, :meth:`release` it when done.

    Args:
        store: the store directory (created if missing).
        purpose: what the owner does, shown to whoever is refused (``serving``, ``compact``).
    """

    def __init__(self, store: Path, purpose: str) -> None:
        self.store = store
        self.purpose = purpose
        self._file: int | None = None  # the locked descriptor while held
        self._pid = 0  # the process that took it

    def acquire(self) -> OwnerLock:
        """Take the lock now or raise.

        Raises:
            InvalidInput: ``store`` is a file, no path (a NUL, a lone surrogate), or a place
                this process cannot create or write.
            StoreInUse: another engine or command holds it (its pid is in the message).
        """
        path = resolved("path", self.store)
        if in_a_snapshot(path):
            # Written to, its data.mdb would no longer match the manifest, and the snapshot
            # (maybe the only backup) would not restore.
            raise InvalidInput("path", f"expected a store, found the copy of one inside the "
                                       f"snapshot {path.parent}; restore the snapshot to a "
                                       "new directory and open that, or open this one with "
                                       "read_only=True")
        try:
            if self.store.exists() and not self.store.is_dir():
                raise InvalidInput("path", f"expected a store directory, found a file at "
                                           f"{self.store}")
            if not self.store.exists() and (replaced := aside(self.store, ".replaced")).exists():
                restoring = aside(self.store, ".restoring")
                raise InvalidInput("path", (
                    f"expected the store at {self.store}, found none there and {replaced} "
                    "beside it: a restore over it was cut short between its two renames. "
                    f"{restoring} holds the restored store if it is there: rename it to "
                    f"{self.store.name} (or {replaced.name} back, for the store as it was)"))
            self.store.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.store / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno not in PATH_ERRNOS:
                raise
            raise refused("path", exc, "a store directory this process can write") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 256).decode("utf-8", "replace").split()
            os.close(fd)
            pid = int(holder[0]) if holder and holder[0].isdigit() else None
            doing = " ".join(holder[1:]) or "starting"
            who = f"process {pid}" if pid is not None else "another process (it is starting)"
            mine = " (this process)" if pid == os.getpid() else ""
            raise StoreInUse(
                f"{self.store} is in use by {who}{mine}, {doing}; one engine owns a store at a "
                "time: close that engine first, or read the store without owning it with "
                "Engine.open(path, read_only=True) (engram stats, inspect and snapshot do)",
                str(self.store), pid) from None
        except BaseException:
            os.close(fd)
            raise
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {self.purpose}\n".encode(), 0)
        except BaseException as exc:
            os.close(fd)  # releases the lock: nothing is kept of an open that failed
            if isinstance(exc, OSError):
                raise EngineBroken(f"cannot write the owner lock of {self.store}: {exc}; free "
                                   "space (or fix the device) and open it again") from exc
            raise
        self._file, self._pid = fd, os.getpid()
        _HELD.add(fd)
        return self

    def release(self) -> None:
        """Give the lock up (closing the descriptor releases it). In a forked child, whose
        copy was closed at the fork, nothing: the number may name another file by now, even
        another lock the child took."""
        if self._file is not None:
            fd, self._file = self._file, None
            if self._pid == os.getpid():
                _HELD.discard(fd)
                os.close(fd)

    def __enter__(self) -> OwnerLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def alone_in_lmdb(store: Path, fd: int, doing: str) -> None:
    """Take LMDB's own exclusive lock on the store's lock file (``fd``: byte 0, where every
    process that has the environment open holds a shared lock for as long as it does), or
    raise. While it is held no other process has the store open, readers included, and one
    that opens it waits. LMDB's close in this process releases it (fcntl's locks are the
    process's), as does closing ``fd``.

    Raises:
        StoreInUse: another process has the store open; the message names it.
    """
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0, os.SEEK_SET)
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EAGAIN):
            raise
        pid = _lmdb_holder(fd)
        who = f"process {pid}" if pid is not None else "another process"
        raise StoreInUse(
            f"{store} is open in {who}: a read-only engine, or engram stats, inspect, snapshot "
            f"or verify. {doing.capitalize()} replaces the store's file under its readers: "
            f"run it once that process has closed the store", str(store), pid) from None


def _lmdb_holder(fd: int) -> int | None:
    """The pid of a process holding a lock on byte 0 of the lock file ``fd`` (Linux's struct
    flock), or None."""
    probe = struct.pack("hhqqi", fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0)
    try:
        kind, _, _, _, pid = struct.unpack("hhqqi", fcntl.fcntl(fd, fcntl.F_GETLK, probe))
    except (OSError, struct.error):
        return None
    return pid if kind != fcntl.F_UNLCK and pid > 0 else None


def claim_in_process(store: Path, how: str) -> tuple[int, int] | None:
    """Note that an engine of this process opens ``store``; None if it does not exist yet.

    Raises:
        InvalidInput: ``store`` is no path (a NUL, a lone surrogate, a name too long, a path
            through a file).
        StoreInUse: an engine of this process has it open already.
    """
    resolved("path", store)
    try:
        info = store.stat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno not in PATH_ERRNOS:
            raise
        raise refused("path", exc, "a store directory") from exc
    key = (info.st_dev, info.st_ino)
    if key in _OPEN_HERE:
        raise StoreInUse(
            f"{store} is in use by process {os.getpid()} (this process), {_OPEN_HERE[key]}; "
            "one engine per store per process: use the engine that has it open",
            str(store), os.getpid())
    _OPEN_HERE[key] = how
    return key


def release_in_process(key: tuple[int, int] | None) -> None:
    """Forget a claim made by :func:`claim_in_process`."""
    if key is not None:
        _OPEN_HERE.pop(key, None)
