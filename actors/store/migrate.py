"""Schema migrations: ``MIGRATIONS[n](txn, dbs)`` turns a store of schema ``n`` into one of
``n + 1``, inside the write transaction that opens it (:meth:`Store._check_schema`)."""

from __future__ import annotations

import logging
import zlib
from array import array
from collections.abc import Callable
from typing import Any

import lmdb

from .chain import content_of
from .integrity import (ABSENT, SEAL, ZERO, CheckedTxn, content_digest, encode_head, link,
                        seal)
from .layout import (
    _EMBEDDED_KEY,
    _LAST_LSN_KEY,
    DB_NAMES,
    EMBED_BACKLOG_KEY,
    HEAD_KEY,
    LOG_FACT,
    LOG_NOTE,
    _int,
    lsn_key,
    user_prefix,
)
from .replay import searchable_at

log = logging.getLogger("engram.store")

PROGRESS_FROM = 100_000  # records from which a migration logs its progress (below: seconds)


def _vectors_to_float16(txn: lmdb.Transaction, dbs: dict[bytes, Any]) -> None:
    """Schema 1 -> 2: stored vectors go from float32 to float16 (the 16-byte header stays)."""
    import numpy as np

    cursor = txn.cursor(dbs[b"vectors"])
    for key, value in list(cursor.iternext(keys=True, values=True)):
        vector = np.frombuffer(value[16:], dtype="<f4").astype("<f2")
        txn.put(key, value[:16] + vector.tobytes(), db=dbs[b"vectors"])


# Migrations from schema N to N + 1, each run inside the write transaction that opens an old


# store: ``MIGRATIONS[n](txn, dbs)`` where ``dbs`` maps database names to handles.


def _long_term_databases(txn: lmdb.Transaction, dbs: dict[bytes, Any]) -> None:
    """Schema 2 -> 3: the long-term layer's databases, created empty when the store opens.
    Nothing to convert; the version moves so that an older build refuses the store instead of
    ignoring its episodes and facts."""


def _backlog_unembedded(txn: lmdb.Transaction, dbs: dict[bytes, Any]) -> None:
    """Schema 3 -> 4: stores written before notes and facts were embedded (the writer matched
    their log entries against the wrong bytes and dropped every vector) hold notes and active
    facts without vectors behind the embedding watermark. Their lsns go to the embedding
    backlog, which the embedder works off first (``Embedder.follow``)."""
    meta, vectors = dbs[b"meta"], dbs[b"vectors"]
    watermark = _int(txn.get(_EMBEDDED_KEY, db=meta)) or 0
    missing = array("Q")
    for key, entry in txn.cursor(dbs[b"log"]):
        lsn = int.from_bytes(key, "big")
        if lsn > watermark:
            break
        if entry[:1] not in (LOG_NOTE, LOG_FACT):
            continue
        record = searchable_at(txn, dbs, lsn, entry)
        if record is not None and txn.get(user_prefix(record.user_id) + key, db=vectors) is None:
            missing.append(lsn)
    if missing:
        missing.byteswap()
        txn.put(EMBED_BACKLOG_KEY, bytes(txn.get(EMBED_BACKLOG_KEY, db=meta) or b"")
                + missing.tobytes(), db=meta)


def _seal_and_chain(txn: lmdb.Transaction, dbs: dict[bytes, Any]) -> None:
    """Schema 4 -> 5: every value gets its checksum, and the log its hash chain. Positions
    already missing from the log get the ABSENT content digest: what removed them is not known
    any more, and the chain vouches for the store as it is from here on. Progress goes to the
    ``engram.store`` logger (a large store takes a while: one pass over every record)."""
    names = [name for name in DB_NAMES if name not in (b"meta", b"chain")]
    last = _int(txn.get(_LAST_LSN_KEY, db=dbs[b"meta"])) or 0
    progress = _Progress("sealing records", sum(txn.stat(dbs[n])["entries"] for n in names))
    for name in names:
        cursor = txn.cursor(dbs[name])
        moved = cursor.first()
        while moved:
            cursor.put(cursor.key(), seal(cursor.value(), cursor.key()))
            progress.step()
            moved = cursor.next()
    checked = CheckedTxn(txn, {handle: name for name, handle in dbs.items()})
    progress = _Progress("building the hash chain", last)
    digest = ZERO
    records = []
    for lsn in range(1, last + 1):
        key = lsn_key(lsn)
        entry = checked.get(key, db=dbs[b"log"])
        content = ABSENT if entry is None else content_digest(
            key, entry, content_of(checked, dbs, entry) or b"")
        digest = link(digest, key, content, b"")
        records.append((key, digest + content))
        progress.step()
    checked.cursor(dbs[b"chain"]).putmulti(records, append=True)
    txn.put(HEAD_KEY, encode_head(last, digest, None), db=dbs[b"meta"])


def _seal_with_keys(txn: lmdb.Transaction, dbs: dict[bytes, Any]) -> None:
    """Schema 5 -> 6: every value's checksum takes in its key (``integrity``'s docstring), so
    a record a damaged key moved under another key (another user's, a bit away) fails it. A
    value sealed with its bytes alone is sealed again; one that fails both checksums is left
    as it is, for verify to name. The version moves so that a build of schema 5, whose check
    would call every record edited, refuses the store as newer. Progress goes to the
    ``engram.store`` logger (one pass over every record)."""
    names = [name for name in DB_NAMES if name != b"meta"]
    progress = _Progress("sealing records with their keys",
                         sum(txn.stat(dbs[n])["entries"] for n in names))
    crc = zlib.crc32
    for name in names:
        cursor = txn.cursor(dbs[name])
        moved = cursor.first()
        while moved:
            key, raw = cursor.key(), cursor.value()
            body, stored = raw[:-SEAL], int.from_bytes(raw[-SEAL:], "big")
            if len(raw) >= SEAL and crc(body, crc(key)) != stored and crc(body) == stored:
                cursor.put(key, seal(body, key))
            progress.step()
            moved = cursor.next()


class _Progress:
    """Logs how far a long migration got, every tenth of the way (when there is much to do)."""

    def __init__(self, what: str, total: int) -> None:
        self._what = what
        self._total = total
        self._done = 0
        self._every = max(total // 10, 1) if total >= PROGRESS_FROM else 0

    def step(self) -> None:
        self._done += 1
        if self._every and (self._done % self._every == 0 or self._done == self._total):
            log.info("store migration: %s, %d of %d (%.0f%%)", self._what, self._done,
                     self._total, 100 * self._done / self._total)


MIGRATIONS: dict[int, Callable[[lmdb.Transaction, dict[bytes, Any]], None]] = {
    1: _vectors_to_float16,
    2: _long_term_databases,
    3: _backlog_unembedded,
    4: _seal_and_chain,
    5: _seal_with_keys,
}
