"""The errors Engram raises, split by who caused them.

- :class:`InvalidInput`: the caller passed something the engine will not store or answer.
  Nothing was written. :class:`NotFound`: an id named a record the user does not have.
  :class:`RecordRefused`: one record passed the checks and the store still could not write
  it; the rest of its batch was written.
- :class:`EngineClosed`: the caller used an engine after closing it (or while it closed).
- :class:`EngineBroken`: the engine failed underneath the caller (disk, native library, a bug).
  The original failure is chained as ``__cause__``.
- :class:`StoreIncompatible`: the store on disk was written by something this build cannot read
  as it is (a newer schema); :class:`ModelMismatch` when its vectors come from another model.
- :class:`ModelMissing`: the embedding model files are not where the engine looks for them.
- :class:`StoreCorrupt`: a record or file of the store fails its checksum or is cut short;
  :class:`StoreTampered` when the store's hash chain says it was edited outside the engine.
- :class:`StoreInUse`: another engine (in this process or another) owns the store.

Native exceptions (``lmdb.Error``, onnxruntime and tantivy errors) are translated into these at
the actor edge and chained with ``from``, so callers need to catch only :class:`EngineError`;
:func:`disk_full` tells which of them mean a full disk, the one failure that is the disk's
state and not the store's damage.
"""

from __future__ import annotations

import errno
import os

__all__ = [
    "EngineError",
    "InvalidInput",
    "NotFound",
    "ClockFailed",
    "RecordRefused",
    "EngineClosed",
    "EngineBroken",
    "StoreIncompatible",
    "ModelMismatch",
    "ModelMissing",
    "StoreCorrupt",
    "StoreTampered",
    "StoreInUse",
]


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidInput(EngineError, ValueError):
    """An argument was rejected before anything was written.

    Attributes:
        field: the name of the argument (or ``items[3].text`` within a batch) that was rejected.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class NotFound(InvalidInput):
    """An id named a record the user does not have (a memory, a note, a session, a tool):
    nothing was written. An :class:`InvalidInput` (the argument was wrong), so a caller
    catching that still does; the HTTP server answers it with 404."""


class ClockFailed(InvalidInput):
    """The engine's clock (given at open) raised when a call or a background step needed the
    time: nothing that needed it was written. A background step waits for the clock and runs
    again (up to 30 s; then what it was handling is kept as failures); an API call is the
    caller's to retry. A clock that reads a time no record holds is InvalidInput ``clock``."""


class RecordRefused(InvalidInput):
    """The store could not write one record (it passed the checks at the call, but LMDB or its
    encoding refused it). Only that record is missing: the rest of its group commit landed, its
    log position holds an empty tombstone, and the failure is listed by ``Engine.failures``.

    Attributes:
        lsn: the record's log sequence number (0 for a record outside the log).
        memory_id: the record's id (a turn's, a note's...), "" if it has none.
    """

    def __init__(self, lsn: int, message: str, memory_id: str = "") -> None:
        super().__init__("record", message)
        self.lsn = lsn
        self.memory_id = memory_id


class EngineClosed(EngineError):
    """The engine was closed by its owner; open a new one to go on."""


class EngineBroken(EngineError):
    """The engine failed underneath the caller; ``__cause__`` holds the failure.

    What was durably acknowledged before the failure is on disk; reopen the store to go on.
    """


class StoreIncompatible(EngineError):
    """The store on disk cannot be used by this build as it is; the message says what to run."""


class ModelMismatch(StoreIncompatible):
    """The store's vectors were made by another embedding model than the one configured.

    Attributes:
        stored: the model id recorded in the store.
        configured: the model id the engine was opened with.
    """

    def __init__(self, message: str, stored: str, configured: str) -> None:
        super().__init__(message)
        self.stored = stored
        self.configured = configured


class ModelMissing(EngineError):
    """The embedding model is not built or not found; the message names the command to build it."""


class StoreCorrupt(EngineError):
    """A record or file of the store is damaged: it fails its checksum, or the file is shorter
    than LMDB's own header says. The engine refuses to answer from it rather than answer wrong.

    Attributes:
        database: the LMDB database (``turns``, ``log``, ...) or the file (``data.mdb``).
        key: the record's key (bytes), or None for a whole file.
    """

    def __init__(self, message: str, database: str, key: bytes | None = None) -> None:
        super().__init__(message)
        self.database = database
        self.key = key


class StoreTampered(StoreCorrupt):
    """The store's hash chain does not match its records: something edited, removed, reordered
    or added records outside the engine (``engram-trio verify STORE`` lists every break).

    Attributes:
        lsn: the log position where the chain breaks (0 when it is the head itself).
    """

    def __init__(self, message: str, database: str, key: bytes | None = None,
                 lsn: int = 0) -> None:
        super().__init__(message, database, key)
        self.lsn = lsn


class StoreInUse(EngineError):
    """Another engine owns the store: one engine (one process) writes a store at a time.

    The owner holds an advisory lock on ``owner.lock`` in the store directory for as long as
    it runs; the kernel releases it when that process ends, even by ``kill -9``. Read a served
    store with ``Engine.open(path, read_only=True)`` (what ``engram stats``, ``inspect`` and
    ``snapshot`` do).

    Attributes:
        path: the store directory.
        pid: the owner's process id, or None if it could not be read (it was starting).
    """

    def __init__(self, message: str, path: str, pid: int | None) -> None:
        super().__init__(message)
        self.path = path
        self.pid = pid


def disk_full(error: BaseException) -> bool:
    """Whether a native error says the disk, or the user's quota, is full: an OSError's errno,
    or the text LMDB's DiskError and tantivy's StorageFull carry (their errors reach Python as
    text). Such a failure is EngineBroken saying so, never damage: nothing may be deleted or
    restored for it."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(error)
    return any(sign in text for sign in ("No space left on device", "Disk quota exceeded",
                                         "StorageFull"))


# Free bytes under which the disk is taken for full: a write that failed there failed for want
# of room (LMDB reports a short write as EIO, tantivy a writer it killed), and a commit is not
# tried again until there is this much.
LOW_ON_DISK = 16 << 20


def free_bytes(path: object) -> int | None:
    """The bytes free to this process on the disk holding ``path`` (None: not known)."""
    try:
        room = os.statvfs(path)
    except OSError:
        return None
    return room.f_bavail * room.f_frsize


def access_denied(error: BaseException) -> bool:
    """Whether a native error says this process may not open or write a file (EACCES, EPERM,
    EROFS): an OSError's errno, or the text LMDB's errors carry. The caller's permissions,
    never damage."""
    if isinstance(error, OSError) and error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return True
    text = str(error)
    return any(sign in text for sign in ("Permission denied", "Operation not permitted",
                                         "Read-only file system"))


def store_denied(path: object, error: BaseException) -> InvalidInput:
    """The InvalidInput for a store this process may not open (see :func:`access_denied`)."""
    return InvalidInput("path", f"expected a store this process may open, found {path} "
                                f"refused ({error}): LMDB's readers take a slot in its "
                                "lock.mdb, so even reading needs write access to that file; "
                                "open it as the user who owns it. Nothing of it was changed")


def out_of_descriptors(error: BaseException) -> bool:
    """Whether a native error says the process (EMFILE) or the system (ENFILE) has no file
    descriptor left: an OSError's errno, or the text tantivy's TooManyOpenFiles carries. A
    passing state (a flood of connections to the server holds them), never damage."""
    if isinstance(error, OSError) and error.errno in (errno.EMFILE, errno.ENFILE):
        return True
    text = str(error)
    return "Too many open files" in text or "TooManyOpenFiles" in text
