"""Files the engine writes beside the store (exports, Markdown mirrors): whole or not at all."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from actors.base.errors import InvalidInput
from actors.base.validate import MAX_DEPTH

# What a path the process cannot write at (or read from) raises: the caller's path, not a
# failure of the engine.
PATH_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.EACCES,
                         errno.EPERM, errno.EROFS, errno.ENAMETOOLONG, errno.ELOOP,
                         errno.EINVAL})


def resolved(field: str, path: Path) -> Path:
    """``path`` made absolute, its links followed.

    Raises:
        InvalidInput: naming ``field``: ``path`` holds a NUL or a lone surrogate, which no
            file name can, or bytes that are not UTF-8, which the store's libraries cannot
            open, nests more than MAX_DEPTH folders deep (as given or resolved), or goes through a loop of symbolic
            links.
    """
    name = str(path)
    if "\x00" in name:
        raise InvalidInput(field, f"expected a path, found a NUL character in {name!r}")
    _check_depth(field, name)
    try:
        os.fsencode(name)
    except UnicodeEncodeError:
        raise InvalidInput(field, f"expected a path, found a lone surrogate in {name!r}") from None
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        # A byte that is not UTF-8, as a command line's argument carries it: the file system
        # takes it, LMDB and the text index open UTF-8 paths only.
        raise InvalidInput(field, f"expected a path in UTF-8, found bytes that are not in "
                                  f"{os.fsencode(name)!r}") from None
    try:
        found = path.resolve()
    except (RuntimeError, OSError) as exc:
        # A loop of symbolic links: RuntimeError before Python 3.13, OSError (ELOOP) since.
        if isinstance(exc, OSError) and exc.errno != errno.ELOOP:
            raise
        raise InvalidInput(field, f"expected a path, found a loop of symbolic links in {name!r}; "
                                  "point it at a real directory") from exc
    _check_depth(field, str(found))  # a link may lead deeper than the path given
    return found


def _check_depth(field: str, name: str) -> None:
    depth = name.count("/")
    if depth > MAX_DEPTH:
        raise InvalidInput(field, f"expected a path at most {MAX_DEPTH} folders deep, found "
                                  f"one {depth} deep")


def refused(field: str, exc: OSError, expected: str) -> InvalidInput:
    """The caller's error for a path the system refused with one of :data:`PATH_ERRNOS`
    (any other, a full disk or an I/O error, is not the caller's path: re-raise it)."""
    return InvalidInput(field, f"expected {expected}, found {exc.strerror} for {exc.filename}")


@contextmanager
def one_disk_error() -> Iterator[None]:
    """Let a disk's error out of task groups alone. Files are copied and flushed a few at a
    time: a full disk or a failing device fails each of those tasks, and their nursery raises
    an ExceptionGroup of the same OSError where the caller (and the command line's one-line
    errors) expects the OSError. A group holding anything else passes unchanged."""
    try:
        yield
    except BaseExceptionGroup as group:
        if group.split(OSError)[1] is not None:
            raise
        first: BaseException = group
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None


NAME_MAX = 255  # bytes a file name may take (ext4, xfs, btrfs, tmpfs)


def _cut(name: str, room: int) -> str:
    """``name`` if its bytes fit in ``room``; else cut at a character and marked with a hash
    of the whole, in ``room`` bytes, so one name always gives one cut."""
    raw = os.fsencode(name)
    if len(raw) <= room:
        return name
    tail = f"~{hashlib.sha256(raw).hexdigest()[:16]}"
    return raw[: room - len(tail)].decode("utf-8", "ignore") + tail


def aside(path: Path, suffix: str) -> Path:
    """The sibling named ``path``'s name and ``suffix`` (a copy under way, a store set aside),
    within NAME_MAX bytes (:func:`_cut`): one path always gives one sibling (what a restore
    cut short left is found again) and a legal name never gets one past the limit."""
    return path.with_name(_cut(path.name, NAME_MAX - len(os.fsencode(suffix))) + suffix)


def exchange(a: Path, b: Path) -> bool:
    """Swap what the two paths name in one step (Linux's ``renameat2`` with
    ``RENAME_EXCHANGE``): no moment in which either name is free. False, and nothing done,
    where the system or the file system cannot.

    Raises:
        OSError: the swap failed for any other reason.
    """
    if sys.platform != "linux":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)  # glibc 2.28 and later
    if renameat2 is None:
        return False
    at_cwd, rename_exchange = -100, 2
    if renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader or a crash sees the old file or the new one,
    never a part: a temporary file in the same folder, fsynced, then renamed over ``path``."""
    # ".NAME." + mkstemp's 8 random characters + ".tmp": 14 bytes beside the name.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{_cut(path.name, NAME_MAX - 14)}.",
                               suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
