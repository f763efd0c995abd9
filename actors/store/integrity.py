"""Record checksums, the log's hash chain and the store file's length check.

Checksums. Every value the store keeps, in every database but ``meta``, ends with the CRC-32 of
its key and the bytes before it (4 bytes, big-endian): a record a damaged key moved under
another key (another user's, a bit away) fails it. A store of schema 5 sealed its values'
bytes alone: the migration to 6 seals them again at its first writable open, and until then
(verify, a restore of such a snapshot) they read as they were sealed. :class:`CheckedTxn` wraps an LMDB transaction so
that every write seals a value and every read checks and strips the seal: the store's readers
and writers go through it and nothing else, so no reader can see a damaged record as a value.
A value that fails its check raises :class:`StoreCorrupt` naming the database and the key.

Hash chain. Every log position ``lsn`` has a record in the ``chain`` database::

    chain[lsn] = digest (16) + content digest (16) + the lsns it removed from the log (8 each)
    content digest = blake2b-128(lsn + log entry + the record the entry names)
    digest         = blake2b-128(previous digest + lsn + content digest + removed lsns)

The writer appends it in the commit that logs ``lsn``, and keeps the chain's head, ``last lsn +
digest`` (+ an HMAC-SHA256 of both under ``Config.integrity_key``), in ``meta``. Chain records
are never changed or deleted, so forgetting does not break the chain: a forget deletes the log
entries and the records, and its own chain record lists the lsns it removed; a verifier accepts
a missing log entry only where a later chain record lists it. What stays of a forgotten record
is its 16-byte content digest (of the record *and* its random id and time stamp), never a byte of
it. Positions already missing when an older store was migrated carry :data:`ABSENT`.

File length. A ``data.mdb`` cut short makes LMDB's map reach past the end of the file and the
process die of SIGBUS on the first read there; :func:`check_file` compares the file's length
with the last page its meta pages name before anything maps it.

Lock file. LMDB makes a missing ``lock.mdb`` by lengthening an empty file and writing through a
map of it; on a full disk that write is SIGBUS too. :func:`ready_lock_file` writes one out
first, where it fails with ENOSPC.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import os
import struct
import zlib
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from ..base.errors import EngineBroken, StoreCorrupt, disk_full, store_denied
from .layout import HEAD_KEY, MAX_READERS
from .pages import in_use_fits

__all__ = ["CheckedTxn", "seal", "seal_all", "unseal", "check_file", "content_digest", "link",
           "chain_records", "ABSENT", "DIGEST", "ZERO", "Head", "encode_head", "decode_head",
           "head_mac", "HEAD_KEY"]

T = TypeVar("T")
SEAL = 4  # bytes of CRC-32 at the end of every sealed value
DIGEST = 16  # blake2b digest size: 128 bits, ample against accidental and forged collisions
ZERO = bytes(DIGEST)  # the digest before lsn 1
ABSENT = b"\xff" * DIGEST  # content digest of a position already missing when the chain began
_MAC_LABEL = b"engram chain head\x00"
_UNSEALED = frozenset({b"meta"})  # small integers and the model id, read raw by offline tools

_LMDB_MAGIC = 0xBEEFC0DE
_META_OFFSET = 16  # the page header before MDB_meta
_LAST_PAGE_OFFSET = 136  # mm_last_pg within a meta page (64-bit build): header 16 + 120


_crc = zlib.crc32
_pack_crc = struct.Struct(">I").pack  # SEAL bytes, big-endian


def seal(value: bytes, key: bytes = b"") -> bytes:
    """``value`` with the CRC-32 of ``key`` and ``value`` appended (CRC-32 of b"" is 0, so no
    key seals as values were sealed before keys were)."""
    return value + _pack_crc(_crc(value, _crc(key)))


def seal_all(values: Iterable[bytes], keys: Iterable[bytes]) -> Iterable[bytes]:
    """Each of ``values`` sealed under its key, lazily: :func:`seal` as one loop in C."""
    values = values if isinstance(values, list) else list(values)
    return map(bytes.__add__, values, map(_pack_crc, map(_crc, values, map(_crc, keys))))


def _fails(body: bytes, key: bytes, stored: int) -> bool:
    """Whether ``body`` fails the checksum ``stored``: of its key and itself, or (a value
    sealed before checksums took in the key) of itself."""
    return _crc(body, _crc(key)) != stored and _crc(body) != stored


def unseal(raw: bytes, database: bytes, key: bytes) -> bytes:
    """The value inside a sealed record.

    Raises:
        StoreCorrupt: the record fails its checksum.
    """
    body = raw[:-SEAL]
    if len(raw) < SEAL or _fails(body, key, int.from_bytes(raw[-SEAL:], "big")):
        raise StoreCorrupt(
            f"the store record {key!r} in database {database.decode()!r} fails its checksum "
            f"(expected a CRC-32 of its key and its {max(len(raw) - SEAL, 0)} bytes, found "
            "another); the "
            "store was damaged on disk or edited: run `engram-trio verify STORE` to see every "
            "damaged record, and restore from a snapshot", database.decode(), bytes(key))
    return body


class CheckedTxn:
    """An LMDB transaction whose values are sealed on write and checked on read.

    Deleting from the ``log`` database records the lsn in :attr:`removed`, so the writer can
    list in the chain what each op took out of the log.
    """

    __slots__ = ("raw", "_names", "removed")

    def __init__(self, txn: Any, names: dict[Any, bytes]) -> None:
        self.raw = txn
        self._names = names  # database handle -> name
        self.removed: list[int] = []

    def get(self, key: bytes, default: Any = None, db: Any = None) -> Any:
        raw = self.raw.get(key, db=db)
        if raw is None:
            return default
        name = self._names[db]
        return raw if name in _UNSEALED else unseal(raw, name, key)

    def getter(self, db: Any) -> Callable[[bytes], bytes | None]:
        """:meth:`get` of one database as a function of the key, for a loop over many keys:
        the same check, with the database's name and the CRC's primitives bound once and
        LMDB's get called with positional arguments (its keyword parsing cost as much as the
        CRC). Reads through it are checked exactly as through :meth:`get`."""
        raw_get = self.raw.get
        name = self._names[db]
        if name in _UNSEALED:
            return lambda key: raw_get(key, None, db)
        crc, number = _crc, int.from_bytes

        def get(key: bytes) -> bytes | None:
            raw = raw_get(key, None, db)
            if raw is None:
                return None
            body = raw[:-SEAL]
            if len(raw) < SEAL or crc(body, crc(key)) != number(raw[-SEAL:], "big"):
                unseal(raw, name, key)  # raises StoreCorrupt unless sealed without the key
            return body

        return get

    def put(self, key: bytes, value: bytes, db: Any = None, **kwargs: Any) -> bool:
        if self._names[db] not in _UNSEALED:
            value = seal(value, key)
        return self.raw.put(key, value, db=db, **kwargs)

    def delete(self, key: bytes, value: bytes = b"", db: Any = None) -> bool:
        gone = self.raw.delete(key, value, db=db)
        if gone and self._names[db] == b"log":
            self.removed.append(int.from_bytes(key, "big"))
        return gone

    def cursor(self, db: Any = None) -> CheckedCursor:
        return CheckedCursor(self.raw.cursor(db), self._names[db])

    def stat(self, db: Any) -> dict[str, int]:
        return self.raw.stat(db)

    def drop(self, db: Any, delete: bool = True) -> None:
        self.raw.drop(db, delete=delete)


class CheckedCursor:
    """An LMDB cursor whose values are checked on read and sealed on write (see CheckedTxn).
    Cursor deletes never touch the log, so they need no bookkeeping."""

    __slots__ = ("_cursor", "_name", "_sealed")

    def __init__(self, cursor: Any, name: bytes) -> None:
        self._cursor = cursor
        self._name = name
        self._sealed = name not in _UNSEALED

    @property
    def raw(self) -> Any:
        """The LMDB cursor underneath: values as stored, sealed."""
        return self._cursor

    def key(self) -> bytes:
        return self._cursor.key()

    def value(self) -> bytes:
        raw = self._cursor.value()
        return unseal(raw, self._name, self._cursor.key()) if self._sealed else raw

    def set_range(self, key: bytes) -> bool:
        return self._cursor.set_range(key)

    def set_key(self, key: bytes) -> bool:
        return self._cursor.set_key(key)

    def first(self) -> bool:
        return self._cursor.first()

    def last(self) -> bool:
        return self._cursor.last()

    def next(self) -> bool:
        return self._cursor.next()

    def prev(self) -> bool:
        return self._cursor.prev()

    def delete(self) -> bool:
        return self._cursor.delete()

    def put(self, key: bytes, value: bytes, **kwargs: Any) -> bool:
        return self._cursor.put(key, seal(value, key) if self._sealed else value, **kwargs)

    def putmulti(self, items: list[tuple[bytes, bytes]], **kwargs: Any) -> tuple[int, int]:
        if self._sealed:
            items = [(k, seal(v, k)) for k, v in items]
        return self._cursor.putmulti(items, **kwargs)

    def put_columns(self, keys: list[bytes], values: list[bytes],
                    **kwargs: Any) -> tuple[int, int]:
        """:meth:`putmulti` of ``keys[i] -> values[i]``: the pairs made one at a time as LMDB
        takes them, not built ahead."""
        return self._cursor.putmulti(zip(keys, seal_all(values, keys) if self._sealed
                                         else values, strict=True), **kwargs)

    def iternext(self, keys: bool = True, values: bool = True) -> Iterator[Any]:
        if not values or not self._sealed:
            yield from self._cursor.iternext(keys=keys, values=values)
            return
        name, crc, number = self._name, _crc, int.from_bytes
        for key, raw in self._cursor.iternext(keys=True, values=True):
            # unseal's check inline: a call less per value of a scan
            value = raw[:-SEAL]
            if len(raw) < SEAL or crc(value, crc(key)) != number(raw[-SEAL:], "big"):
                unseal(raw, name, key)  # raises StoreCorrupt unless sealed without the key
            yield (key, value) if keys else value

    def __iter__(self) -> Iterator[tuple[bytes, bytes]]:
        return self.iternext(keys=True, values=True)


_BLAKE = hashlib.blake2b(digest_size=DIGEST)  # copied: cheaper than parsing the parameters


def content_digest(lsn: bytes, entry: bytes, content: bytes) -> bytes:
    """The digest of one log position's entry and the record it names."""
    h = _BLAKE.copy()
    h.update(lsn + entry + content)  # one update of ~300 bytes: cheaper than three calls
    return h.digest()


def link(previous: bytes, lsn: bytes, content: bytes, removed: bytes) -> bytes:
    """The chain digest at ``lsn``: it covers the previous one, so no record can be changed,
    dropped, moved or added without changing every digest after it."""
    return hashlib.blake2b(previous + lsn + content + removed, digest_size=DIGEST).digest()


def chain_records(previous: bytes, lsns: list[bytes], entries: list[bytes],
                  contents: list[bytes]) -> tuple[list[bytes], bytes]:
    """The chain records (digest + content digest, nothing removed) of consecutive log
    positions, after the digest ``previous``: :func:`content_digest` and :func:`link` over a
    run, in one loop. Returns the records and the last digest."""
    records = []
    new = _BLAKE.copy
    for lsn, entry, content in zip(lsns, entries, contents, strict=True):
        h = new()
        h.update(lsn + entry + content)
        digest = h.digest()
        h = new()
        h.update(previous + lsn + digest)
        previous = h.digest()
        records.append(previous + digest)
    return records, previous


class Head(tuple):
    """The chain's head as stored: (lsn, digest, mac); mac is b"" in a store without a key."""

    __slots__ = ()

    @property
    def lsn(self) -> int:
        return self[0]

    @property
    def digest(self) -> bytes:
        return self[1]

    @property
    def mac(self) -> bytes:
        return self[2]


def head_mac(key: bytes, lsn: int, digest: bytes) -> bytes:
    """HMAC-SHA256 of the head under the integrity key."""
    return hmac.new(key, _MAC_LABEL + lsn.to_bytes(8, "big") + digest, hashlib.sha256).digest()


def encode_head(lsn: int, digest: bytes, key: bytes | None) -> bytes:
    mac = head_mac(key, lsn, digest) if key else b""
    return lsn.to_bytes(8, "big") + digest + mac


def decode_head(raw: bytes) -> Head | None:
    """The head, or None if ``raw`` has not the shape of one."""
    if len(raw) not in (8 + DIGEST, 8 + DIGEST + 32):
        return None
    return Head((int.from_bytes(raw[:8], "big"), raw[8:8 + DIGEST], raw[8 + DIGEST:]))


# Files the indexes write only once they hold records: a text segment's term index, a vector
# graph. Beside an empty data.mdb they say the store had records and lost them.
_INDEX_FILES = (("fulltext", "*.idx"), ("ann", "*.hnsw"))


def _named(files: list[Path]) -> str:
    return files[0].name + (f" and {len(files) - 1} more" if len(files) > 1 else "")


def _index_files(path: Path) -> list[Path]:
    return [file for folder, pattern in _INDEX_FILES for file in (path / folder).glob(pattern)]


def _newest_txnid(data: Path) -> int | None:
    """The transaction id of the newer of ``data``'s two meta pages (None: not LMDB's)."""
    with data.open("rb") as f:
        first = f.read(4096)
        if len(first) < _LAST_PAGE_OFFSET + 16:
            return None
        f.seek(struct.unpack_from("<I", first, _META_OFFSET + 24)[0])
        second = f.read(_LAST_PAGE_OFFSET + 16)
    found = [struct.unpack_from("<QQ", meta, _LAST_PAGE_OFFSET)[1] for meta in (first, second)
             if len(meta) >= _LAST_PAGE_OFFSET + 16
             and struct.unpack_from("<I", meta, _META_OFFSET)[0] == _LMDB_MAGIC]
    return max(found, default=None)


# A lock file of zeros, as long as LMDB's at MAX_READERS slots of 64 bytes and its header
# (a few cache lines) or longer: LMDB's first opener initialises one it finds, and takes one
# longer than it needs as it is, its reader table the longer for it.
LOCK_FILE_BYTES = 3 * 4096
assert LOCK_FILE_BYTES >= 64 * (MAX_READERS + 8)


def ready_lock_file(path: Path) -> None:
    """Give the store at ``path`` a ``lock.mdb`` if it has none (after a restore, or a copy of
    data.mdb alone), every byte of it written, before LMDB opens it with its lock. LMDB would
    make it by lengthening an empty file and writing through a map of it, and on a full disk
    that write is SIGBUS: the process killed without a word. Made whole under another name and
    linked into place, so no other opener meets it half written.

    Any failure but a full disk is left for LMDB to meet and say, as it would without this (a
    folder this process may not write to: a reader, say).

    Raises:
        EngineBroken: the disk is full.
    """
    lock = path / "lock.mdb"
    if os.path.lexists(lock) or not path.is_dir():
        return
    part = path / f".lock.mdb.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    try:
        with open(part, "xb") as f:
            f.write(bytes(LOCK_FILE_BYTES))
        os.link(part, lock)
    except FileExistsError:
        pass  # another opener made it meanwhile: theirs is whole too
    except OSError as exc:
        if disk_full(exc):
            raise EngineBroken(f"cannot open the store at {path}: its lock file cannot be "
                               f"written ({exc}): the disk is full; free space and open it "
                               "again (nothing of the store was changed)") from exc
    finally:
        with contextlib.suppress(OSError):
            part.unlink()


OPENING_LOCK = "opening.lock"


@contextlib.contextmanager
def opening(path: Path, exclusive: bool = False) -> Iterator[None]:
    """Hold the store's opening lock (an ``flock`` on ``opening.lock``): shared while an LMDB
    environment of the store is opened by anyone but its owner (a reader, a model lookup,
    verify), exclusive while compact swaps data.mdb. LMDB opens data.mdb before it takes its
    own lock on lock.mdb, so a reader between the two is invisible to that lock: let through
    while compact swaps the file, it would hold the old one and then, first to lock, set the
    lock file's state from it, and the next owner would read the new file by the old one's
    transaction id (an empty store). A reader holds it only until LMDB has its lock.

    The owner's open makes the file, and compact does (``exclusive``); a reader never makes
    one (it leaves no file in a folder it only reads, another program's included) and holds
    nothing where there is none: no compact has had a store there to swap.
    """
    lock = path / OPENING_LOCK
    try:
        fd = (os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644) if exclusive
              else os.open(lock, os.O_RDONLY | os.O_CLOEXEC))
    except OSError:
        if exclusive:
            raise
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # drops the flock


def open_reader(path: Path, **options: Any) -> lmdb.Environment:
    """LMDB's environment of the store at ``path`` for anyone but its owner, with LMDB's lock
    (a reader in the reader table is safe from another process's writer reusing its pages):
    its lock file made whole first (:func:`ready_lock_file`), and the opening lock held until
    LMDB has its own (:func:`opening`). ``options`` go to ``lmdb.open``."""
    ready_lock_file(path)
    with opening(path):
        return lmdb.open(str(path), lock=True, **options)


# Growths of the map by another process in a row that a reader adopts before it gives up.
MAP_GROWTHS = 16


def grown_along(env: lmdb.Environment, read: Callable[[], T]) -> T:
    """``read()``, whose transactions are its own on ``env``, a reader's: again each time
    another process grew the store past this handle's map since it was opened (LMDB refuses a
    transaction then, MDB_MAP_RESIZED, until the handle adopts the new size). No transaction
    of ``env`` may be open around the call."""
    for _ in range(MAP_GROWTHS):
        try:
            return read()
        except lmdb.MapResizedError:
            env.set_mapsize(0)  # 0: the size the file has now
    return read()


def check_file(path: Path, extend: bool = False, _tries: int = 8) -> None:
    """Refuse a ``data.mdb`` shorter than its own meta pages say, before LMDB maps it, unless
    every page in use lies inside it (``extend``: then lengthen it to what they say).

    LMDB keeps two meta pages and uses the one with the higher transaction id; its
    ``mm_last_pg`` is the last page the store uses, so the file needs ``(last + 1) * page``
    bytes. Reading past the end of a mapped file is SIGBUS, not an error, so this is checked
    with plain reads first.

    Raises:
        StoreCorrupt: the file is shorter than that, or its meta pages are not LMDB's, or it
            is empty or missing beside index files that hold records.
    """
    data = path / "data.mdb"
    if not data.exists():
        if indexed := _index_files(path):
            # The same loss as an emptied file (below): LMDB would start an empty store.
            raise StoreCorrupt(
                f"{data} is missing, but the indexes beside it hold data ({_named(indexed)}): "
                "the store's records are lost (a copy that stopped, a file deleted); restore the "
                "store from a snapshot. Opening it would start an empty store and drop those "
                "indexes", "data.mdb")
        return
    if data.is_dir():
        raise StoreCorrupt(f"expected data.mdb to be LMDB's data file, found a folder at {data}; "
                           "point Engine.open at an Engram store or an empty directory",
                           "data.mdb")
    try:
        f = data.open("rb")
    except PermissionError as exc:
        raise store_denied(path, exc) from None
    with f:
        first = f.read(4096)
        if len(first) < _LAST_PAGE_OFFSET + 16:
            needed = None
        else:
            page = struct.unpack_from("<I", first, _META_OFFSET + 24)[0]
            f.seek(page)
            second = f.read(_LAST_PAGE_OFFSET + 16)
            best = None
            for meta in (first, second):
                if len(meta) < _LAST_PAGE_OFFSET + 16:
                    continue
                magic = struct.unpack_from("<I", meta, _META_OFFSET)[0]
                last, txnid = struct.unpack_from("<QQ", meta, _LAST_PAGE_OFFSET)
                if magic == _LMDB_MAGIC and (best is None or txnid > best[1]):
                    best = (last, txnid)
            needed = None if best is None or page < 512 else (best[0] + 1) * page
        # Measured after the meta pages were read: a live owner only ever writes a transaction's
        # pages before its meta page, so the length taken now covers the meta read above; taken
        # before, a commit in between looked like a file cut short.
        size = os.fstat(f.fileno()).st_size
    if size == 0:
        indexed = _index_files(path)
        if indexed:
            raise StoreCorrupt(
                f"{data} is empty, but the indexes beside it hold data ({_named(indexed)}): "
                "the store's records are lost (a copy that stopped, a truncation); restore the "
                "store from a snapshot. Opening it would start an empty store and drop those "
                "indexes", "data.mdb")
        return  # a file LMDB created and never wrote (a first open that stopped): initialised
    if needed is None:
        raise StoreCorrupt(
            f"{data} is not an LMDB file (expected two meta pages with LMDB's magic number at "
            f"the start, found {size} bytes without them); restore the store from a snapshot",
            "data.mdb")
    if size < needed:
        if in_use_fits(data):
            # Short only of free pages a commit took and gave back (pages.in_use_fits): what
            # LMDB reads is all there. The owner gives the file its full length, so that a
            # walk of every page (the scrub) finds them; a reader leaves it as it is.
            if extend:
                os.truncate(data, needed)
            return
        if _newest_txnid(data) != best[1]:
            # A live owner committed while the trees were walked (a reader's check: the
            # owner reuses free pages meanwhile): look again at the file as it is now. An
            # owner committing through every walk is a live store, not a lost end: LMDB
            # maps it and its owner reads it, so it is taken as it is.
            if _tries > 1:
                return check_file(path, extend, _tries - 1)
            return
        raise StoreCorrupt(
            f"{data} is cut short: its meta page says the store uses {needed:,} bytes, the file "
            f"has {size:,}; the end of the store is lost (a copy that stopped early, or a full "
            "disk). Restore it from a snapshot; opening it would crash the process (SIGBUS)",
            "data.mdb")
