"""Store actor: LMDB, the single source of truth.

Layout (named databases; every key that belongs to a user starts with ``user_id + NUL`` so one
user's records are contiguous and a prefix scan finds all of them):

=========  ======================================  ===========================================
database   key                                     value
=========  ======================================  ===========================================
meta       ``schema`` / ``last_lsn`` /             8-byte big-endian integers
           ``embedded_lsn``
meta       ``model``                               ModelInfo (msgpack): id and dimension
meta       ``embed_backlog``                       8-byte lsns behind ``embedded_lsn`` still
                                                   without a vector (schema 4's migration)
meta       ``scrub_pending``                       msgpack list of the key prefixes of users
                                                   deleted from since the last scrub
sessions   user NUL session                        SessionInfo (msgpack)
turns      user NUL session NUL seq(8 bytes)       Turn (msgpack)
ids        user NUL turn_id                        the turn's key in ``turns``
log        lsn (8 bytes, big-endian)               ``T`` + turn key; ``N`` + replaced lsn +
                                                   notes key; ``D`` + deleted lsns; ``E``, ``F``
vectors    user NUL lsn(8 bytes)                   ANN header + the embedding, float32 bytes
links      user NUL from NUL to / user NUL to NUL  Link (msgpack), once per direction
           from
notes      user NUL note_id                        Note (msgpack), its latest version
summaries  user NUL session                        SummaryState (msgpack)
episodes   user NUL session NUL first seq(8)       Episode (msgpack)
facts      user NUL category NUL key NUL lsn(8)    Fact (msgpack), every version kept
entities   user NUL lower-case name                Entity (msgpack)
reviews    user NUL memory id                      ReviewState (msgpack): FSRS after reviews
pending    user NUL conversation id                PendingReview (msgpack)
chain      lsn (8 bytes, big-endian)               chain digest + content digest + removed lsns
failures   lsn(8) actor                            Failure (msgpack): a record a part skipped
=========  ======================================  ===========================================

Every value but ``meta``'s ends with a CRC-32 of the rest, sealed and checked in one place
(:class:`actors.integrity.CheckedTxn`): a damaged record is ``StoreCorrupt``, never a value. The
``chain`` database is the log's hash chain, its head in ``meta`` under ``chain_head`` (see
``actors/integrity.py``); opening a store checks the chain's tail against the head.

Entity names, a fact's category and key, and both ends of a link go through ``keys.fit`` when
the key would pass LMDB's 511 bytes: a readable head, 0xFF, a digest (the full value is in the
record). Ids a caller chooses are at most 250 bytes (checked at the call).

``ids`` maps ``user NUL id`` of a turn, an episode or a fact to its key (in ``turns``, or
after the tag ``NUL E`` / ``NUL F`` in ``episodes`` / ``facts``). Log entries: ``E`` + episode key; ``F`` + count(2) + the lsns that
left the indexes with it (8 bytes each) + fact key.

The log is what derived views (the ANN and full-text indexes) replay from their watermark.
A deletion leaves a tombstone that lists the deleted sequence numbers and nothing of the user.

Concurrency (py-lmdb: a write transaction is bound to the thread that began it):

- Writes are group-committed: everything queued while one commit runs becomes the next batch,
  and each batch is one write transaction begun and committed inside one ``to_thread.run_sync``
  call. The queue is appended to synchronously on the trio thread, so log order is call order
  and a cancelled caller can never leave a hole in the sequence; backpressure happens *before*
  a sequence number is taken (:meth:`Store.reserve`).
- Reads run in worker threads through :meth:`Store.read`, each in its own read transaction.
  Growing the map and closing the environment need no transaction open in the process, so both
  wait for in-flight reads to finish and hold new ones back meanwhile.
"""

from __future__ import annotations

import heapq
import hmac
import itertools
import logging
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import lmdb
import msgspec
import trio

from .base.config import Config
from .base.records import (
    SCHEMA_VERSION,
    Entity,
    Episode,
    Fact,
    Failure,
    Link,
    Note,
    PendingReview,
    ReviewState,
    SessionInfo,
    SummaryState,
    Turn,
)
from .base.errors import (
    EngineBroken,
    EngineClosed,
    EngineError,
    InvalidInput,
    ModelMismatch,
    RecordRefused,
    StoreIncompatible,
    StoreTampered,
)

from .integrity import (
    ABSENT,
    DIGEST,
    HEAD_KEY,
    ZERO,
    CheckedCursor,
    CheckedTxn,
    check_file,
    content_digest,
    decode_head,
    encode_head,
    head_mac,
    link,
    seal,
    unseal,
)

from .base.keys import MAX_KEY_BYTES, fit, is_fitted

from .base.messages import (
    AppendTurn,
    DeleteNote,
    Forget,
    PutEpisode,
    PutFact,
    PutLink,
    PutNote,
    PutState,
    PutVectors,
    ScrubFreePages,
    Searchable,
    StoreOp,
    WriteSummary,
)

__all__ = ["Store", "LogFollower", "MIGRATIONS", "user_prefix", "session_prefix", "lsn_key", "fact_key",
           "episode_key", "entity_key", "failure_put", "read_failures"]

log = logging.getLogger("engram.store")

QUEUE_LIMIT = 16_384  # queued turns before callers wait: ~4 full batches means the disk is behind
BATCH_MAX = 4_096  # ops per write transaction, so one commit (and the waiters behind it) stays short
READ_THREADS = 2  # concurrent read transactions: one per core; the writer has its own limiter
MAX_DBS = 32  # named databases LMDB reserves room for; later layers add theirs
TAIL_CHECK = 64  # log positions whose chain opening a store recomputes: the last writes
PROGRESS_FROM = 100_000  # records from which a migration logs its progress (below: seconds)
SCRUB_RETRY = 0.05  # seconds between looks while a reader pins the pages a scrub must reuse
MAX_READERS = 126  # LMDB reader slots: the default, far above the threads we use
COMMIT_TIME_STEP = 0.1  # seconds one commit-time sample covers: how precise a lag in seconds is
COMMIT_TIMES = 100_000  # samples kept: ~2.8 hours of constant commits at one per step

DB_NAMES = (b"meta", b"sessions", b"turns", b"ids", b"log", b"vectors", b"links", b"notes",
            b"summaries", b"episodes", b"facts", b"entities", b"reviews", b"pending", b"chain",
            b"failures")
# Errors of one op (a key LMDB cannot hold, a value that cannot be encoded): the op is refused
# alone and the rest of its batch commits. Any other lmdb.Error is the disk's and breaks the store.
_OP_ERRORS = (lmdb.BadValsizeError, ValueError, TypeError, OverflowError, msgspec.MsgspecError)
REFUSALS_KEPT = 1024  # refused lsns remembered for their waiters
# Databases a store of the current schema may lack (written before they were added; an engine
# that owns the store creates them at open, a read-only one reads them as empty).
OPTIONAL_DBS = frozenset({b"failures"})
LOG_TURN = b"T"
LOG_NOTE = b"N"  # + the lsn this version replaces (8 bytes, 0: none) + the notes key
LOG_TOMBSTONE = b"D"
LOG_EPISODE = b"E"  # + the episodes key
LOG_FACT = b"F"  # + count (2 bytes) + lsns that left the indexes (8 bytes each) + the facts key
# ``ids`` values: a turn's key as is; an episode's or a fact's behind a tag no turn key starts
# with (a turn key starts with its non-empty user id).
IDS_EPISODE = b"\x00E"
IDS_FACT = b"\x00F"

_SCHEMA_KEY = b"schema"
_LAST_LSN_KEY = b"last_lsn"
_EMBEDDED_KEY = b"embedded_lsn"
_MODEL_KEY = b"model"
# Records behind the embedding watermark that still need a vector (8-byte lsns): what a
# migration found missing; the embedder embeds them before following the log.
EMBED_BACKLOG_KEY = b"embed_backlog"
# Set in the transaction of every forget, cleared once the free pages were overwritten: a
# crash in between leaves it, and the next engine scrubs again.
SCRUB_KEY = b"scrub_pending"
_SCRUB_FILL = b"\xffscrub"  # + 8-byte counter: the zero values a fill writes, in meta
SCRUB_VALUE = 4_000  # bytes of each fill value: alone on one overflow page of 4 KiB
SCRUB_MAX_PAGES = 32_768  # pages one fill transaction takes (LMDB caps dirty pages per txn)
SCRUB_TOUCH_MAX = 50_000  # records a touch rewrites per transaction (LMDB caps dirty pages)
SCRUB_BEFORE = 256  # records before a deleted user's keys whose pages a scrub rewrites too:
# a page that split keeps copies of the records it gave its right sibling in its free space
SCRUB_DBS = (b"turns", b"vectors", b"notes", b"summaries", b"episodes", b"facts", b"entities",
             b"pending", b"reviews", b"links", b"sessions")  # values that hold text or vectors
_decode_prefixes = msgspec.msgpack.Decoder(list[bytes]).decode

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


def open_databases(env: lmdb.Environment, txn: Any = None) -> dict[bytes, Any]:
    """Every named database of an existing store, for readers that create nothing; one of
    OPTIONAL_DBS that the store does not have yet is left out (read it as empty).

    Raises:
        lmdb.NotFoundError: a database every store of this schema has is missing.
    """
    dbs = {}
    for name in DB_NAMES:
        try:
            dbs[name] = env.open_db(name, txn=txn, create=False)
        except lmdb.NotFoundError:
            if name not in OPTIONAL_DBS:
                raise
    return dbs


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
            cursor.put(cursor.key(), seal(cursor.value()))
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
}

T = TypeVar("T")
log = logging.getLogger("engram.store")

_encode = msgspec.msgpack.Encoder().encode
_decode_session = msgspec.msgpack.Decoder(SessionInfo).decode
_decode_turn = msgspec.msgpack.Decoder(Turn).decode


class _TurnHead(msgspec.Struct, array_like=True):
    """The leading fields of a stored Turn: what deletion needs, without decoding the text."""

    lsn: int
    turn_id: str


_decode_head = msgspec.msgpack.Decoder(_TurnHead).decode
_decode_link = msgspec.msgpack.Decoder(Link).decode
_decode_note = msgspec.msgpack.Decoder(Note).decode
_decode_summary = msgspec.msgpack.Decoder(SummaryState).decode
decode_episode = msgspec.msgpack.Decoder(Episode).decode
decode_fact = msgspec.msgpack.Decoder(Fact).decode
decode_entity = msgspec.msgpack.Decoder(Entity).decode
decode_review = msgspec.msgpack.Decoder(ReviewState).decode
decode_pending = msgspec.msgpack.Decoder(PendingReview).decode
decode_failure = msgspec.msgpack.Decoder(Failure).decode
_IDS_TARGETS = {IDS_EPISODE: (b"episodes", decode_episode), IDS_FACT: (b"facts", decode_fact)}


def user_prefix(user_id: str) -> bytes:
    return user_id.encode() + b"\x00"


def session_prefix(user_id: str, session_id: str) -> bytes:
    return user_id.encode() + b"\x00" + session_id.encode() + b"\x00"


def lsn_key(lsn: int) -> bytes:
    return lsn.to_bytes(8, "big")


def fact_key(fact: Fact) -> bytes:
    """user NUL category NUL key NUL lsn; category and key shortened (keys.fit) if long."""
    prefix = user_prefix(fact.user_id)
    name = fit(fact.category.encode() + b"\x00" + fact.key.encode(),
               MAX_KEY_BYTES - len(prefix) - 9)
    return prefix + name + b"\x00" + lsn_key(fact.lsn)


def entity_key(user_id: str, name: str) -> bytes:
    """user NUL lower-case name; the name shortened (keys.fit) if long."""
    prefix = user_prefix(user_id)
    return prefix + fit(name.encode(), MAX_KEY_BYTES - len(prefix))


def failure_key(lsn: int, actor: str) -> bytes:
    """lsn, actor: one failure per record and actor; writes outside the log (lsn 0) add the
    time, so that each is kept."""
    key = lsn_key(lsn) + actor.encode()
    return key if lsn else key + b"\x00" + time.time_ns().to_bytes(8, "big")


def _printable(text: str) -> str:
    """Text that encodes whatever it holds (a lone surrogate becomes its escape)."""
    return text.encode("utf-8", "backslashreplace").decode()


def failure_put(lsn: int, actor: str, user_id: str, memory_id: str,
                error: BaseException) -> tuple[bytes, bytes, bytes, int]:
    """A PutState put that records a failure, guarded by its record (a record forgotten
    meanwhile leaves no failure behind)."""
    failure = Failure(lsn, actor, _printable(user_id), _printable(memory_id),
                      _printable(f"{type(error).__name__}: {error}")[:1000],
                      datetime.now(timezone.utc))
    return (b"failures", failure_key(lsn, actor), _encode(failure), lsn)


def episode_key(episode: Episode) -> bytes:
    return session_prefix(episode.user_id, episode.session_id) + lsn_key(episode.first_seq)


def _fact_entry_lsns(entry: bytes) -> tuple[list[int], bytes]:
    """The lsns an ``F`` log entry retired, and the fact's key."""
    n = int.from_bytes(entry[1:3], "big")
    retired = [int.from_bytes(entry[3 + 8 * i: 11 + 8 * i], "big") for i in range(n)]
    return retired, entry[3 + 8 * n:]


def _fact_core(fact: Fact) -> bytes:
    """The fields of a fact version that never change: use counts, confidence, status and
    validity are rewritten in place, so the chain covers what the version says, not those."""
    return _encode((fact.lsn, fact.fact_id, fact.user_id, fact.category, fact.key, fact.value,
                    fact.text, fact.keywords, fact.session_id, fact.valid_at, fact.created_at,
                    fact.origin))


def content_of(txn: CheckedTxn, dbs: dict[bytes, Any], entry: bytes) -> bytes | None:
    """What the hash chain covers of the record a log entry names, besides the entry itself
    (None: that record is missing; b"" for a tombstone, which is all entry)."""
    kind = entry[:1]
    if kind == LOG_TURN:
        return txn.get(entry[1:], db=dbs[b"turns"])
    if kind == LOG_NOTE:
        return txn.get(entry[9:], db=dbs[b"notes"])
    if kind == LOG_EPISODE:
        return txn.get(entry[1:], db=dbs[b"episodes"])
    if kind == LOG_FACT:
        raw = txn.get(_fact_entry_lsns(entry)[1], db=dbs[b"facts"])
        return None if raw is None else _fact_core(decode_fact(raw))
    return b""


def _chain_in(txn: CheckedTxn, dbs: dict[bytes, Any], lsn: int, previous: bytes) -> bytes:
    """Append the chain record of the op just applied at ``lsn`` (writer thread); it lists the
    log entries the op removed. Returns its digest."""
    key = lsn_key(lsn)
    entry = txn.get(key, db=dbs[b"log"])
    if entry is None:
        raise AssertionError(f"the op at lsn {lsn} left no log entry")
    content = content_digest(key, entry, content_of(txn, dbs, entry) or b"")
    removed = b"".join(map(lsn_key, txn.removed))
    digest = link(previous, key, content, removed)
    txn.put(key, digest + content + removed, db=dbs[b"chain"], append=True)
    return digest


def _chain_turns(txn: CheckedTxn, dbs: dict[bytes, Any], log_entries: list[tuple[bytes, bytes]],
                 values: list[bytes], previous: bytes) -> bytes:
    """Append the chain records of appended turns (their log keys and entries, and their
    values); returns the last digest."""
    records = []
    for (key, entry), value in zip(log_entries, values, strict=True):
        content = content_digest(key, entry, value)
        previous = link(previous, key, content, b"")
        records.append((key, previous + content))
    txn.cursor(dbs[b"chain"]).putmulti(records, append=True)
    return previous


def _tombstone_in(txn: CheckedTxn, dbs: dict[bytes, Any], lsn: int, previous: bytes) -> bytes:
    """An empty tombstone at the log position of an op the writer refused, chained: the log
    keeps no gap."""
    txn.removed = []
    txn.put(lsn_key(lsn), LOG_TOMBSTONE, db=dbs[b"log"], append=True)
    return _chain_in(txn, dbs, lsn, previous)


def check_chain(txn: CheckedTxn, dbs: dict[bytes, Any], first: int, last: int,
                head: bytes | None) -> list[tuple[int, str]]:
    """Recompute the chain over log positions [first, last] against the records, and check
    that it ends in ``head``'s digest (if given) with nothing logged or chained after ``last``.

    A missing log entry passes only where a chain record in the range lists it as removed, so
    the range must run to the head (removals are always listed later).

    Returns:
        (lsn, what is wrong) for every problem found, in lsn order; empty if none.
    """
    problems: list[tuple[int, str]] = []
    raw, log, chain = txn.raw, dbs[b"log"], dbs[b"chain"]
    digest = ZERO
    if first > 1:
        before = raw.get(lsn_key(first - 1), db=chain)
        try:
            digest = None if before is None else unseal(before, b"chain", lsn_key(first - 1))
        except EngineError:
            digest = None
        digest = None if digest is None else digest[:DIGEST]
        if digest is None:
            problems.append((first - 1, "its chain record is missing or damaged"))
    removed: list[int] = []
    covered: set[int] = set()
    cursor = raw.cursor(chain)
    expected = first
    found = cursor.set_range(lsn_key(first))
    while found:
        key, value = cursor.item()
        lsn = int.from_bytes(key, "big")
        if lsn > last:
            problems.append((lsn, f"the chain goes on past its head ({last})"))
            break
        if lsn != expected:
            problems.append((expected, f"the chain records of {expected}..{lsn - 1} are missing"))
            digest = None  # the links across the hole cannot be checked; pick up after it
        expected = lsn + 1
        found = cursor.next()
        try:
            record = unseal(value, b"chain", key)
        except EngineError:
            problems.append((lsn, "its chain record fails its checksum"))
            digest = None
            continue
        mine, content, gone = record[:DIGEST], record[DIGEST:2 * DIGEST], record[2 * DIGEST:]
        if len(content) != DIGEST or len(gone) % 8:
            problems.append((lsn, "its chain record has not the shape of one"))
            digest = None
            continue
        if digest is not None and link(digest, key, content, gone) != mine:
            problems.append((lsn, "the hash chain breaks: its record, or the one before it, "
                                  "was changed"))
        digest = mine
        covered.update(int.from_bytes(gone[i:i + 8], "big") for i in range(0, len(gone), 8))
        try:
            entry = txn.get(key, db=log)
            if entry is None:
                if content != ABSENT:
                    removed.append(lsn)
                continue
            if content == ABSENT:
                problems.append((lsn, "a log entry is where the chain says there was none"))
                continue
            record_bytes = content_of(txn, dbs, entry)
        except EngineError as exc:
            problems.append((lsn, f"a record it names is damaged: {exc}"))
            continue
        if record_bytes is None:
            problems.append((lsn, "the record its log entry names is missing"))
        elif content_digest(key, entry, record_bytes) != content:
            problems.append((lsn, "its record differs from what was written (the content "
                                  "digest in the chain does not match)"))
    if expected <= last:
        problems.append((expected, f"the chain records of {expected}..{last} are missing"))
    elif head is not None and digest is not None and digest != head:
        problems.append((last, "the chain's last digest is not the head's"))
    cursor = raw.cursor(log)
    if cursor.last() and int.from_bytes(cursor.key(), "big") > last:
        problems.append((int.from_bytes(cursor.key(), "big"),
                         f"the log goes on past the chain's head ({last}): records were added "
                         "outside the engine"))
    problems.extend((lsn, "its log entry was removed, and no later record lists it as removed "
                          "(deleted outside the engine)") for lsn in removed if lsn not in covered)
    problems.sort()
    return problems


def _check_content(txn: CheckedTxn, dbs: dict[bytes, Any], key: bytes, entry: bytes,
                   content: bytes) -> None:
    """Refuse a record that is not what the chain says was written at its log position.

    Raises:
        StoreTampered: the record or its chain record was changed outside the engine.
    """
    record = txn.get(key, db=dbs[b"chain"])
    if record is None or record[DIGEST:2 * DIGEST] != content_digest(key, entry, content):
        lsn = int.from_bytes(key, "big")
        raise StoreTampered(
            f"the record at log position {lsn} is not what the engine wrote there (its content "
            "digest does not match the store's hash chain): the store was edited outside the "
            "engine; run `engram-trio verify STORE` and restore from a snapshot", "log", key, lsn)


def _check_logged(txn: CheckedTxn, dbs: dict[bytes, Any], key: bytes, entry: bytes) -> None:
    """:func:`_check_content` for the record a log entry names, read again.

    The followers of the log (indexes, the long-term layer) do not check: they read what the
    writer just wrote (open checked the tail before them), five of them per record, and
    checking there cost bulk ingest a quarter of its throughput. What recall serves is
    checked (:func:`read_records`), so a record edited in place never reaches a caller."""
    _check_content(txn, dbs, key, entry, content_of(txn, dbs, entry) or b"")


def _wipe(cursor: CheckedCursor) -> bool:
    """Delete the cursor's record, its value overwritten with zeros first; returns whether
    the cursor is still on a record (the next one).

    LMDB deletes a record by moving the page's other records over it, which can leave its
    bytes in the page's free space; a value of the same size is rewritten in place, so what
    remains there is zeros. (The page's older copy is a free page: see ScrubFreePages.) The
    raw value is overwritten: a damaged record is forgotten like any other."""
    raw = cursor.raw
    raw.put(raw.key(), bytes(len(raw.value())))
    return cursor.delete()


def _wipe_key(txn: CheckedTxn, key: bytes, db: Any) -> bool:
    """:func:`_wipe` by key; False if there was no such record."""
    cursor = txn.cursor(db)
    return cursor.set_key(key) and (_wipe(cursor) or True)


def _delete_prefix(txn: lmdb.Transaction, db: Any, prefix: bytes) -> None:
    cursor = txn.cursor(db)
    if cursor.set_range(prefix):
        while cursor.key().startswith(prefix):
            if not _wipe(cursor):
                break


def _delete_links_of(txn: lmdb.Transaction, db: Any, user_id: str, memory_id: str) -> None:
    """Every link touching one memory, in both directions."""
    found = [value for prefix in link_prefixes(user_id, memory_id)
             for _, value in _scan(txn, db, prefix)]
    for value in found:
        for key in link_keys(user_id, _decode_link(value)):
            _wipe_key(txn, key, db)


def _reader_txnids(env: lmdb.Environment) -> list[int]:
    """The snapshots that read transactions (of any process) hold open, by transaction id."""
    out = []
    for line in env.readers().splitlines()[1:]:
        fields = line.split()
        if len(fields) == 3 and fields[2].isdigit():
            out.append(int(fields[2]))
    return out


def _int(raw: bytes | None) -> int | None:
    return None if raw is None else int.from_bytes(raw, "big")


def entry_record_key(entry: bytes) -> bytes:
    """The key of the record a log entry names (in turns, notes, episodes or facts; it starts
    with the user's prefix), or b"" for a tombstone."""
    kind = entry[:1]
    if kind == LOG_NOTE:
        return entry[9:]
    if kind == LOG_FACT:
        return _fact_entry_lsns(entry)[1]
    if kind == LOG_TOMBSTONE:
        return b""
    return entry[1:]


class _Puts:
    """One run of appends between deletions, grouped per database for ``putmulti``."""

    __slots__ = ("turns", "ids", "log", "sessions", "ops")

    def __init__(self) -> None:
        self.ops: list[AppendTurn] = []  # for writing them one by one if the run fails
        self.turns: list[tuple[bytes, bytes]] = []
        self.ids: list[tuple[bytes, bytes]] = []
        self.log: list[tuple[bytes, bytes]] = []
        self.sessions: list[tuple[bytes, bytes]] = []


class ModelInfo(msgspec.Struct, frozen=True, array_like=True):
    """The embedding model whose vectors a store holds."""

    id: str
    dim: int


_decode_model = msgspec.msgpack.Decoder(ModelInfo).decode


def link_keys(user_id: str, link: Link) -> tuple[bytes, bytes]:
    """The link's key from its source, and from its target (for walking it backwards): user
    NUL one end NUL the other, both ends shortened (keys.fit) when that is too long."""
    prefix = user_prefix(user_id)
    a, b = link.from_id.encode(), link.to_id.encode()
    if len(prefix) + len(a) + 1 + len(b) > MAX_KEY_BYTES:
        room = (MAX_KEY_BYTES - len(prefix) - 1) // 2
        a, b = fit(a, room), fit(b, room)
    return prefix + a + b"\x00" + b, prefix + b + b"\x00" + a


def link_prefixes(user_id: str, memory_id: str) -> set[bytes]:
    """The key prefixes of the links from a memory: with its id whole, and shortened (the
    form a link takes when both ends together are too long)."""
    prefix = user_prefix(user_id)
    whole = memory_id.encode()
    short = fit(whole, (MAX_KEY_BYTES - len(prefix) - 1) // 2)
    return {prefix + whole + b"\x00", prefix + short + b"\x00"}


def _plan(ops: list[StoreOp]) -> list[Any]:
    """Cut a batch into runs of appends and other ops, in order. Runs on the trio thread."""
    segments: list[Any] = []
    puts = _Puts()
    latest: dict[bytes, AppendTurn] = {}

    def close_run() -> None:
        for key, op in latest.items():
            t = op.turn
            info = SessionInfo(t.user_id, t.session_id, op.started_at, t.at, t.seq + 1)
            puts.sessions.append((key, _encode(info)))
        segments.append(puts)

    for op in ops:
        if type(op) is AppendTurn:
            t = op.turn
            puts.ops.append(op)
            puts.turns.append((op.key, op.value))
            puts.ids.append((op.id_key, op.key))
            puts.log.append((lsn_key(t.lsn), LOG_TURN + op.key))
            latest[op.key[:-9]] = op  # the turn key less NUL + seq is the sessions key
        else:
            if puts.turns:
                close_run()
                puts, latest = _Puts(), {}
            segments.append(op)
    if puts.turns:
        close_run()
    return segments


def _put_run(txn: lmdb.Transaction, dbs: dict[bytes, Any], seg: _Puts) -> None:
    """A run of appends, one putmulti per database."""
    added = txn.cursor(dbs[b"turns"]).putmulti(seg.turns)[1]
    txn.cursor(dbs[b"ids"]).putmulti(seg.ids)
    txn.cursor(dbs[b"sessions"]).putmulti(seg.sessions)
    logged = txn.cursor(dbs[b"log"]).putmulti(seg.log, append=True)[1]
    if added != len(seg.turns) or logged != len(seg.log):
        raise AssertionError(
            f"store invariant broken: {len(seg.turns)} turns to write, "
            f"{added} new keys, {logged} of {len(seg.log)} log entries appended"
        )


def _put_one(txn: lmdb.Transaction, dbs: dict[bytes, Any], op: AppendTurn) -> None:
    """One append on its own (a run that failed is written again turn by turn)."""
    t = op.turn
    txn.put(op.key, op.value, db=dbs[b"turns"])
    txn.put(op.id_key, op.key, db=dbs[b"ids"])
    txn.put(lsn_key(t.lsn), LOG_TURN + op.key, db=dbs[b"log"])
    info = SessionInfo(t.user_id, t.session_id, op.started_at, t.at, t.seq + 1)
    txn.put(op.key[:-9], _encode(info), db=dbs[b"sessions"])


def _op_identity(op: Any) -> tuple[str, str]:
    """(user id, memory id) of an op, as far as it names them, for its failure record."""
    match op:
        case AppendTurn():
            return op.turn.user_id, op.turn.turn_id
        case PutNote():
            return op.note.user_id, op.note.note_id
        case PutEpisode():
            return op.episode.user_id, op.episode.episode_id
        case PutFact():
            return op.user_id, op.fact.fact_id if op.fact is not None else ""
        case DeleteNote():
            return op.user_id, op.note_id
    return getattr(op, "user_id", None) or "", ""


class Store:
    """The LMDB store. Start with ``await nursery.start(store.run)``; stop with :meth:`close`.

    Args:
        path: the store directory (created if missing).
        config: the engine's config.
        model: the embedding model the engine runs; a store made with another is refused.
        reembed: adopt ``model`` even if the store's vectors came from another one, dropping
            those vectors so that everything is embedded again.
        read_only: open an existing store for reading only, as another process's engine may
            be writing it (LMDB's lock file keeps its readers safe); every write is refused.
    """

    def __init__(self, path: Path, config: Config, model: ModelInfo | None = None,
                 reembed: bool = False, read_only: bool = False) -> None:
        self.path = path
        self._config = config
        self._model = model
        self._reembed = reembed
        self.read_only = read_only  # readers of a store another process may be writing
        self.embedded_lsn = 0  # the persisted embedding watermark, as read at open
        self.embed_backlog: list[int] = []  # lsns behind it still without a vector, at open
        self.scrub_pending = False  # a forget's freed pages may still hold its bytes (at open)
        # The last transaction that freed pages holding deleted records: a reader holding a
        # snapshot from before it keeps LMDB from reusing (and so overwriting) those pages.
        self._freed_txnid = 0
        self._touched: list[bytes] = []  # the users' key prefixes the last touch rewrote
        self._touch_plan: list[tuple[bytes, bytes]] | None = None  # (prefix, db) left to touch
        self._touch_from: bytes | None = None  # where the touch of the plan's first resumes
        self._env: lmdb.Environment | None = None
        self._dbs: dict[bytes, Any] = {}
        self._names: dict[Any, bytes] = {}  # database handle -> name, for CheckedTxn
        key = config.integrity_key
        self._key = None if key is None else key.encode()
        self._head = (0, ZERO)  # the chain's last lsn and digest, as committed
        self._queue: deque[StoreOp] = deque()
        self._queued = 0  # ops taken and not yet committed (queued or in the writer)
        self._next_lsn = 1
        self._committed_lsn = 0
        self._waiters: list[tuple[int, int, trio.Event]] = []  # heap of (lsn, tiebreak, event)
        self._tiebreak = 0
        self._failure: BaseException | None = None  # why the commit loop died, if it did
        # Ops the writer refused alone (their batch committed without them): by lsn for their
        # waiters, by id() for unlogged ops whose writer waits on ``done``.
        self._refused: dict[int, RecordRefused] = {}
        self._refused_ops: dict[int, RecordRefused] = {}
        self._unreported: dict[int, RecordRefused] = {}  # refused lsns no flush has raised yet
        self._closing = False
        self._readers = 0
        self._exclusive = False  # set while the map grows or the env closes: reads wait
        # Parked: the commit loop, while the queue is empty.
        self._wakeup = trio.lowlevel.ParkingLot()
        # Parked: callers waiting for queue room (backpressure).
        self._room = trio.lowlevel.ParkingLot()
        # Parked: readers waiting out an exclusive section, and the section waiting for readers.
        self._gate = trio.lowlevel.ParkingLot()
        # Parked: followers of the log (the embedder) waiting for the next commit.
        self._commits = trio.lowlevel.ParkingLot()
        self._submitted = 0  # ops ever queued, logged or not
        self._written = 0  # ops ever committed: the queue is FIFO, so the first _written of them
        # Parked: callers of wait_written, until the next batch commits.
        self._batches = trio.lowlevel.ParkingLot()
        # Shielded from close() on, so queued turns reach the disk even when the body failed.
        self._drain_scope = trio.CancelScope()
        # How the writer applies each kind of op other than appends (batched apart, see _plan),
        # inside the batch's write transaction; what it returns goes to the op's ``committed``.
        self._appliers: dict[type, Callable[[lmdb.Transaction, Any], Any]] = {
            Forget: self._forget_in, PutVectors: self._put_vectors_in, PutNote: self._put_note_in,
            DeleteNote: self._delete_note_in, WriteSummary: self._write_summary_in,
            PutEpisode: self._put_episode_in, PutFact: self._put_fact_in,
            PutState: self._put_state_in, PutLink: self._put_link_in,
            ScrubFreePages: self._scrub_in,
        }
        self._write_limiter = trio.CapacityLimiter(1)
        self._read_limiter = trio.CapacityLimiter(READ_THREADS)
        # (lsn, trio time): every lsn above the previous sample's and up to this one was
        # committed within COMMIT_TIME_STEP after this time; how far behind a follower is.
        self._commit_times: deque[tuple[int, float]] = deque(maxlen=COMMIT_TIMES)

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Open the environment, then commit queued ops until closed and drained."""
        self._env = await trio.to_thread.run_sync(
            self._open_env_read_only if self.read_only else self._open_env)
        self._commit_times.append((self._committed_lsn, trio.current_time()))
        task_status.started()
        try:
            with self._drain_scope:
                await self._commit_loop()
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            with trio.CancelScope(shield=True):
                await self._close_env()

    def close(self) -> None:
        """Stop taking ops; the loop commits what is queued and ends.

        The drain is shielded from cancellation and bounded by work, not by a timer: at most
        QUEUE_LIMIT turns, a few commits. A timer could not tell a slow fsync from a dead disk,
        and giving up would lose turns that callers were told are in memory.
        """
        self._closing = True
        self._drain_scope.shield = True
        self._wakeup.unpark_all()
        self._room.unpark_all()
        self._commits.unpark_all()

    def _open_env(self) -> lmdb.Environment:
        if self.path.exists() and not self.path.is_dir():
            raise InvalidInput("path", f"expected a store directory, found a file at {self.path}")
        self.path.mkdir(parents=True, exist_ok=True)
        check_file(self.path)
        try:
            env = lmdb.open(
                str(self.path),
                map_size=self._config.initial_map_bytes,
                max_dbs=MAX_DBS,
                max_readers=MAX_READERS,
                sync=self._config.fsync,
                metasync=self._config.fsync,
                writemap=False,
                map_async=False,
            )
        except lmdb.Error as exc:
            raise StoreIncompatible(f"cannot open an LMDB store at {self.path}: {exc}") from exc
        try:
            with env.begin(write=True) as txn:
                self._dbs = {name: env.open_db(name, txn=txn) for name in DB_NAMES}
                self._names = {handle: name for name, handle in self._dbs.items()}
                self._check_schema(txn)
                self._check_model(txn)
                self._check_chain(txn)
                meta = self._dbs[b"meta"]
                self._next_lsn = (_int(txn.get(_LAST_LSN_KEY, db=meta)) or 0) + 1
                self.embedded_lsn = _int(txn.get(_EMBEDDED_KEY, db=meta)) or 0
                self.scrub_pending = txn.get(SCRUB_KEY, db=meta) is not None
                self._freed_txnid = txn.id()
                backlog = array("Q", txn.get(EMBED_BACKLOG_KEY, db=meta) or b"")
                backlog.byteswap()
                self.embed_backlog = backlog.tolist()
        except BaseException:
            env.close()
            raise
        self._committed_lsn = self._next_lsn - 1
        return env

    def _open_env_read_only(self) -> lmdb.Environment:
        """The environment for reading only; nothing is created, migrated or adopted."""
        if not (self.path / "data.mdb").exists():
            raise InvalidInput("path", f"expected an Engram store, found no data.mdb in "
                                       f"{self.path}")
        check_file(self.path)
        try:
            # lock=True: this reader takes a slot in LMDB's reader table, so a writer in
            # another process never reuses the pages it reads.
            env = lmdb.open(str(self.path), readonly=True, lock=True, max_dbs=MAX_DBS,
                            max_readers=MAX_READERS)
        except lmdb.Error as exc:
            raise StoreIncompatible(f"cannot open an LMDB store at {self.path}: {exc}") from exc
        try:
            try:
                # Each opened in its own transaction (a handle opened inside a read-only
                # transaction of py-lmdb dies with it).
                self._dbs = open_databases(env)
            except lmdb.NotFoundError:
                self._dbs = {}
            self._names = {handle: name for name, handle in self._dbs.items()}
            with env.begin() as txn:
                meta = self._dbs.get(b"meta")
                stored = None if meta is None else _int(txn.get(_SCHEMA_KEY, db=meta))
                if stored != SCHEMA_VERSION:
                    raise StoreIncompatible(
                        f"{self.path} has schema version {stored} and this build reads "
                        f"{SCHEMA_VERSION}; a read-only engine migrates nothing: open it once "
                        "with Engine.open(path) (not read_only) when nobody serves it")
                raw = txn.get(_MODEL_KEY, db=meta)
                stored_model = None if raw is None else _decode_model(raw)
                if (self._model is not None and stored_model is not None
                        and stored_model != self._model):
                    raise ModelMismatch(
                        f"{self.path} holds vectors from {stored_model.id} and this engine runs "
                        f"{self._model.id}; open it read-only with the model it was built with",
                        stored_model.id, self._model.id)
                self._next_lsn = (_int(txn.get(_LAST_LSN_KEY, db=meta)) or 0) + 1
                self.embedded_lsn = _int(txn.get(_EMBEDDED_KEY, db=meta)) or 0
                if self._next_lsn > 1:  # an empty store has no chain to check
                    self._check_chain(txn)
        except BaseException:
            env.close()
            raise
        self._committed_lsn = self._next_lsn - 1
        return env

    def _check_schema(self, txn: lmdb.Transaction) -> None:
        meta = self._dbs[b"meta"]
        stored = _int(txn.get(_SCHEMA_KEY, db=meta))
        if stored is None:
            if txn.stat(self._dbs[b"log"])["entries"] or txn.stat(meta)["entries"]:
                raise StoreIncompatible(
                    f"{self.path} holds LMDB data without an Engram schema version; "
                    "point Engine.open at an empty directory or an Engram store"
                )
            txn.put(_SCHEMA_KEY, SCHEMA_VERSION.to_bytes(8, "big"), db=meta)
            return
        if stored > SCHEMA_VERSION:
            raise StoreIncompatible(
                f"{self.path} has schema version {stored}, newer than this build reads "
                f"({SCHEMA_VERSION}); upgrade engram to open it"
            )
        for version in range(stored, SCHEMA_VERSION):
            if version not in MIGRATIONS:
                raise StoreIncompatible(
                    f"{self.path} has schema version {stored} and this build has no migration "
                    f"from {version} to {version + 1}"
                )
            MIGRATIONS[version](txn, self._dbs)
        if stored != SCHEMA_VERSION:
            txn.put(_SCHEMA_KEY, SCHEMA_VERSION.to_bytes(8, "big"), db=meta)

    def _check_chain(self, txn: lmdb.Transaction) -> None:
        """Check the chain's head (and its MAC, with a key) and recompute its last TAIL_CHECK
        links: a cut, a forged append or an edit among the latest writes refuses the store."""
        meta = self._dbs[b"meta"]
        last = _int(txn.get(_LAST_LSN_KEY, db=meta)) or 0
        raw = txn.get(HEAD_KEY, db=meta)
        if raw is None and not last and not txn.stat(self._dbs[b"log"])["entries"]:
            txn.put(HEAD_KEY, encode_head(0, ZERO, self._key), db=meta)  # a new store
            return
        head = None if raw is None else decode_head(raw)
        if head is None:
            raise StoreTampered(
                f"{self.path} has a log of {last} entries but {'no' if raw is None else 'a broken'}"
                f" hash-chain head (meta {HEAD_KEY!r}); it was edited outside the engine: run "
                f"`engram-trio verify {self.path}` and restore from a snapshot", "meta", HEAD_KEY)
        if self._key is None and head.mac:
            raise StoreIncompatible(
                f"{self.path} is sealed with an integrity key (its chain head carries a MAC); "
                "open it with Config(integrity_key=...) set to that key")
        if self._key is not None and not head.mac:
            if head.lsn:
                raise StoreIncompatible(
                    f"{self.path} was written without an integrity key, so nothing vouches for "
                    f"what it holds so far; check it and seal it with `engram-trio verify {self.path} "
                    "--seal` (the key in ENGRAM_INTEGRITY_KEY), then open it with the key")
            txn.put(HEAD_KEY, encode_head(0, ZERO, self._key), db=meta)
            head = decode_head(encode_head(0, ZERO, self._key))
        if self._key is not None and not hmac.compare_digest(
                head.mac, head_mac(self._key, head.lsn, head.digest)):
            raise StoreTampered(
                f"{self.path}: the MAC of the hash-chain head does not match under the "
                "configured integrity_key: the store was edited by someone without the key, or "
                "the key is not the one it was written with", "meta", HEAD_KEY)
        if head.lsn != last:
            raise StoreTampered(
                f"{self.path}: the hash chain ends at log position {head.lsn} and the store "
                f"says its log ends at {last}: records were cut or added outside the engine; "
                f"run `engram-trio verify {self.path}`", "meta", _LAST_LSN_KEY, min(head.lsn, last))
        problems = check_chain(CheckedTxn(txn, self._names), self._dbs,
                               max(1, last - TAIL_CHECK + 1), last, head.digest)
        if problems:
            lsn, what = problems[0]
            raise StoreTampered(
                f"{self.path}: at log position {lsn}, {what} ({len(problems)} problem(s) in the "
                f"last {min(TAIL_CHECK, last)} positions); run `engram-trio verify {self.path}` for "
                "every break, and restore from a snapshot", "log", lsn_key(lsn), lsn)
        self._head = (last, head.digest)

    def _check_model(self, txn: lmdb.Transaction) -> None:
        if self._model is None:
            return
        meta = self._dbs[b"meta"]
        raw = txn.get(_MODEL_KEY, db=meta)
        stored = None if raw is None else _decode_model(raw)
        if stored == self._model:
            return
        if stored is not None and not self._reembed:
            raise ModelMismatch(
                f"{self.path} holds vectors from {stored.id} (dimension {stored.dim}) and this "
                f"engine runs {self._model.id} (dimension {self._model.dim}); re-embed the store "
                f"with `engram-trio reindex {self.path} --model <name>` (or "
                "Engine.open(..., reembed=True)), or open it with the model it was built with",
                stored.id, self._model.id,
            )
        if stored is not None:
            txn.drop(self._dbs[b"vectors"], delete=False)
            txn.put(_EMBEDDED_KEY, lsn_key(0), db=meta)
        txn.put(_MODEL_KEY, _encode(self._model), db=meta)

    async def _close_env(self) -> None:
        await self._enter_exclusive()
        try:
            if self._env is not None:
                self._env.close()
                self._env = None
        finally:
            self._leave_exclusive()
        self._wake_all_waiters()

    # -- writes ------------------------------------------------------------------------------

    @property
    def next_lsn(self) -> int:
        """The sequence number the next queued op will get."""
        return self._next_lsn

    @property
    def committed_lsn(self) -> int:
        """Every op up to this sequence number is committed."""
        return self._committed_lsn

    @property
    def queued(self) -> int:
        return self._queued

    def committed_since(self, lsn: int) -> float:
        """How long ago (trio time, seconds) ``lsn`` was committed, to within COMMIT_TIME_STEP;
        0 if it is not committed yet. An lsn committed before this process opened the store
        counts from the open; past COMMIT_TIMES samples, from the oldest kept."""
        times = self._commit_times
        if lsn > self._committed_lsn or not times:
            return 0.0
        low, high = 0, len(times) - 1
        while low < high:  # the first sample covering lsn
            mid = (low + high) // 2
            if times[mid][0] < lsn:
                low = mid + 1
            else:
                high = mid
        return trio.current_time() - times[low][1]

    def check_usable(self) -> None:
        """Raise if ops can no longer be taken.

        Raises:
            EngineBroken: the store failed.
            EngineClosed: the store is closing.
        """
        if self._failure is not None:
            raise EngineBroken("the store failed; reopen it to go on") from self._failure
        if self._closing:
            raise EngineClosed("the engine is closed; open a new one with Engine.open(path)")

    def usable(self) -> bool:
        """Whether ops can still be taken (see :meth:`check_usable`)."""
        return self._failure is None and not self._closing

    async def reserve(self, n: int) -> None:
        """Wait until ``n`` more ops fit in the queue. Cancel-safe: nothing is taken yet.

        Returns at once, without a checkpoint, when there is room: this is the hot path.
        """
        while self._queued and self._queued + n > QUEUE_LIMIT:
            self.check_usable()
            await self._room.park()
        self.check_usable()
        if self.read_only:
            raise _read_only_error()

    def has_room(self, n: int) -> bool:
        """Whether ``n`` more ops fit in the queue now: :meth:`reserve` would not wait.

        Raises:
            EngineBroken / EngineClosed: as :meth:`check_usable`.
        """
        self.check_usable()
        return not (self._queued and self._queued + n > QUEUE_LIMIT)

    def submit(self, op: StoreOp) -> None:
        """Queue an op whose lsn is :attr:`next_lsn`, or a derived op with none. Synchronous, so
        queue order is lsn order."""
        if self.read_only:
            raise _read_only_error()
        if op.lsn is not None:
            if op.lsn != self._next_lsn:
                raise AssertionError(f"op lsn {op.lsn} submitted, expected {self._next_lsn}")
            self._next_lsn += 1
        self._queue.append(op)
        self._queued += 1
        self._submitted += 1
        if self._wakeup:
            self._wakeup.unpark_all()

    async def wait_committed(self, lsn: int) -> None:
        """Return once every op up to ``lsn`` is committed.

        Raises:
            EngineBroken: the store failed before committing it.
            EngineClosed: the engine closed before committing it.
        """
        if lsn <= self._committed_lsn:
            await trio.lowlevel.checkpoint()
            if lsn in self._refused:
                raise self._refused[lsn]
            return
        if self._failure is not None or self._env is None:
            raise self._not_committed_error()
        self._tiebreak += 1
        event = trio.Event()  # set once the commit covering lsn lands, or the store fails
        heapq.heappush(self._waiters, (lsn, self._tiebreak, event))
        await event.wait()
        if lsn > self._committed_lsn:
            raise self._not_committed_error()
        if lsn in self._refused:
            raise self._refused[lsn]

    def _not_committed_error(self) -> EngineError:
        if self._failure is None:
            return EngineClosed("the engine closed before this turn was committed")
        error = EngineBroken("the store failed before committing this turn; reopen it to go on")
        error.__cause__ = self._failure
        return error

    def take_refused(self, upto: int) -> list[RecordRefused]:
        """The refusals of logged ops up to ``upto`` that no earlier call returned (for
        ``Engine.flush``, which promises everything acknowledged before it is on disk)."""
        taken = [lsn for lsn in self._unreported if lsn <= upto]
        return [self._unreported.pop(lsn) for lsn in taken]

    async def wait_written(self) -> None:
        """Return once every op queued before the call is committed, whether it took a log
        position or not (vectors, links, derived state).

        Raises:
            EngineBroken: the store failed first.
            EngineClosed: the store closed first.
        """
        target = self._submitted
        while self._written < target:
            if self._failure is not None or self._env is None:
                raise self._not_committed_error()
            await self._batches.park()
        await trio.lowlevel.checkpoint()

    async def wait_commit_beyond(self, lsn: int) -> None:
        """Return once the committed log passes ``lsn`` (at once if it already has).

        Raises:
            EngineClosed: the store closed first.
        """
        while self._committed_lsn <= lsn:
            if self._closing:
                raise EngineClosed("the store is closing")
            await self._commits.park()
        await trio.lowlevel.checkpoint()

    async def write_unlogged(self, op: PutVectors | PutLink | WriteSummary | PutState) -> None:
        """Queue an op that takes no log position and wait for its commit.

        Raises:
            RecordRefused: the store could not write this op (the rest of its batch landed).
            EngineBroken / EngineClosed: the store failed or closed first.
        """
        self.check_usable()
        self.submit(op)
        await op.done.wait()
        refused = self._refused_ops.pop(id(op), None)
        if refused is not None:
            raise refused
        if self._failure is not None:
            raise self._not_committed_error()

    async def forget(self, user_id: str, session_id: str | None,
                     committed: Callable[[list[int]], None] | None = None) -> None:
        """Delete a session or a user and wait until that is committed. ``committed`` gets the
        deleted lsns on the trio thread, in commit order with every other op."""
        await self.reserve(1)
        lsn = self._next_lsn
        self.submit(Forget(lsn, user_id, session_id, committed))
        await self.wait_committed(lsn)

    async def _commit_loop(self) -> None:
        while True:
            if not self._queue:
                if self._closing:
                    return
                await self._wakeup.park()
                continue
            n = min(len(self._queue), BATCH_MAX)
            ops = [self._queue.popleft() for _ in range(n)]
            segments = _plan(ops)
            last = max((op.lsn for op in ops if op.lsn is not None), default=None)
            while (written := await trio.to_thread.run_sync(
                self._write, segments, last, limiter=self._write_limiter
            )) is None:
                await self._grow_map()
            results, refused = written
            for op, error in refused:
                self._refuse(op, error)
            self._queued -= n
            self._written += n
            if self._room:
                self._room.unpark_all()
            if self._batches:
                self._batches.unpark_all()
            # Derived views learn of each op here, on the trio thread and in commit order, so
            # none can apply a deletion before the write it deletes.
            for op, result in results:
                committed = getattr(op, "committed", None)
                if committed is not None:
                    committed(result)
                done = getattr(op, "done", None)
                if done is not None:
                    done.set()
            if last is None:
                continue
            self._committed_lsn = last
            now, times = trio.current_time(), self._commit_times
            if now - times[-1][1] < COMMIT_TIME_STEP:
                times[-1] = (last, times[-1][1])
            else:
                times.append((last, now))
            waiters = self._waiters
            while waiters and waiters[0][0] <= last:
                heapq.heappop(waiters)[2].set()
            if self._commits:
                self._commits.unpark_all()

    def _refuse(self, op: StoreOp, error: BaseException) -> None:
        """Tell the op's caller (trio thread): its waiter raises RecordRefused, nobody else."""
        lsn = op.lsn or 0
        user_id, memory_id = _op_identity(op)
        named = f" {memory_id!r} of user {user_id!r}" if memory_id else ""
        refusal = RecordRefused(lsn, f"the store refused the record at lsn {lsn}{named} "
                                     f"({type(op).__name__}): {type(error).__name__}: {error}; "
                                     "the rest of its batch was written", memory_id)
        log.warning("%s", refusal)
        if op.lsn is not None:
            self._refused[op.lsn] = refusal
            self._unreported[op.lsn] = refusal
            while len(self._refused) > REFUSALS_KEPT:
                del self._refused[next(iter(self._refused))]
            while len(self._unreported) > REFUSALS_KEPT:
                del self._unreported[next(iter(self._unreported))]
        elif getattr(op, "done", None) is not None:
            self._refused_ops[id(op)] = refusal
            op.done.set()

    def _write(self, segments: list[Any], last_lsn: int | None
               ) -> tuple[list[tuple[Any, Any]], list[tuple[Any, BaseException]]] | None:
        """One write transaction (worker thread). If one op cannot be written, the batch is
        written again with each op in a nested transaction, so only that op is left out.

        Returns:
            ((op, result) for every op that is not an append, in order; (op, error) for every
            op refused); None if the map was full and nothing was written.
        """
        try:
            try:
                return self._write_batch(segments, last_lsn, False)
            except _OP_ERRORS:
                pass  # some op of the batch cannot be written: find it, write the others
            return self._write_batch(segments, last_lsn, True)
        except lmdb.MapFullError:
            return None
        except lmdb.Error as exc:
            raise EngineBroken(f"writing to the store at {self.path} failed: {exc}") from exc

    def _write_batch(self, segments: list[Any], last_lsn: int | None, isolate: bool
                     ) -> tuple[list[tuple[Any, Any]], list[tuple[Any, BaseException]]]:
        """The batch in one transaction; with ``isolate``, each op (or run of appends, then
        each append of a run that fails) in a nested one, and a refused op's log position
        gets an empty tombstone, chained like any entry."""
        dbs = self._dbs
        results: list[tuple[Any, Any]] = []
        refused: list[tuple[Any, BaseException]] = []
        digest = self._head[1]
        with self._env.begin(write=True) as raw_txn:
            txn = CheckedTxn(raw_txn, self._names)
            for seg in segments:
                if type(seg) is _Puts:
                    if not isolate:
                        _put_run(txn, dbs, seg)
                    elif self._nested(txn, _put_run, dbs, seg)[1] is not None:
                        for op in seg.ops:
                            error = self._nested(txn, _put_one, dbs, op)[1]
                            if error is None:
                                digest = _chain_turns(txn, dbs, [(lsn_key(op.lsn), LOG_TURN
                                                                  + op.key)], [op.value], digest)
                            else:
                                refused.append((op, error))
                                digest = _tombstone_in(txn, dbs, op.lsn, digest)
                        continue
                    # The chain, here in the writer thread: hashing stays off the loop.
                    digest = _chain_turns(txn, dbs, seg.log, [v for _, v in seg.turns], digest)
                    continue
                txn.removed = []
                if not isolate:
                    result, error = self._appliers[type(seg)](txn, seg), None
                else:
                    result, error = self._nested(txn, self._appliers[type(seg)], seg)
                if error is not None:
                    refused.append((seg, error))
                    if seg.lsn is not None:
                        digest = _tombstone_in(txn, dbs, seg.lsn, digest)
                    continue
                results.append((seg, result))
                if seg.lsn is not None:
                    digest = _chain_in(txn, dbs, seg.lsn, digest)
                elif txn.removed:
                    raise AssertionError(f"{type(seg).__name__} took no log position and "
                                         f"removed log entries {txn.removed}")
            for op, error in refused:
                _, key, value, _ = failure_put(op.lsn or 0, "store", *_op_identity(op), error)
                txn.put(key, value, db=dbs[b"failures"])
            if last_lsn is not None:
                txn.put(_LAST_LSN_KEY, lsn_key(last_lsn), db=dbs[b"meta"])
                txn.put(HEAD_KEY, encode_head(last_lsn, digest, self._key), db=dbs[b"meta"])
        if last_lsn is not None:
            self._head = (last_lsn, digest)
        return results, refused

    def _nested(self, txn: CheckedTxn, apply: Callable[..., Any], *args: Any
                ) -> tuple[Any, BaseException | None]:
        """``apply(child, *args)`` in a transaction nested in ``txn``: kept if it succeeds,
        rolled back alone if it raises one op's error."""
        child = CheckedTxn(self._env.begin(write=True, parent=txn.raw), self._names)
        try:
            result = apply(child, *args)
        except _OP_ERRORS as exc:
            child.raw.abort()
            return None, exc
        except BaseException:
            child.raw.abort()
            raise
        child.raw.commit()
        txn.removed.extend(child.removed)
        return result, None

    def _forget_in(self, txn: lmdb.Transaction, op: Forget) -> list[int]:
        dbs = self._dbs
        uprefix = user_prefix(op.user_id)
        if op.session_id is None:
            tprefix = uprefix
        else:
            tprefix = session_prefix(op.user_id, op.session_id)
        deleted = array("Q")
        ids, log, vectors = dbs[b"ids"], dbs[b"log"], dbs[b"vectors"]
        cursor = txn.cursor(dbs[b"turns"])
        if cursor.set_range(tprefix):
            while cursor.key().startswith(tprefix):
                head = _decode_head(cursor.value())
                deleted.append(head.lsn)
                txn.delete(uprefix + head.turn_id.encode(), db=ids)
                txn.delete(lsn_key(head.lsn), db=log)
                _wipe_key(txn, uprefix + lsn_key(head.lsn), vectors)
                if op.session_id is not None:
                    _delete_links_of(txn, dbs[b"links"], op.user_id, head.turn_id)
                if not _wipe(cursor):
                    break
        self._mark_scrub(txn, uprefix)
        if op.session_id is not None:
            for name in (b"sessions", b"summaries", b"pending"):
                _wipe_key(txn, tprefix[:-1], dbs[name])
            self._forget_session_derived(txn, op, deleted)
        else:
            for name in (b"notes", b"episodes", b"facts"):
                cursor = txn.cursor(dbs[name])
                if cursor.set_range(uprefix):
                    for key, value in cursor:
                        if not key.startswith(uprefix):
                            break
                        lsn = _decode_head(value).lsn
                        if txn.delete(lsn_key(lsn), db=log):  # superseded facts left the log
                            deleted.append(lsn)
            for name in (b"sessions", b"links", b"vectors", b"notes", b"summaries", b"episodes",
                         b"facts", b"entities", b"reviews", b"pending", b"ids"):
                _delete_prefix(txn, dbs[name], uprefix)
        result = deleted.tolist()
        self._forget_failures(txn, op.user_id, None if op.session_id is None else result)
        deleted.byteswap()  # big-endian on disk, like every other integer in the store
        txn.put(lsn_key(op.lsn), LOG_TOMBSTONE + deleted.tobytes(), db=log, append=True)
        return result

    def _forget_failures(self, txn: lmdb.Transaction, user_id: str,
                         lsns: list[int] | None) -> None:
        """A forgotten user's failures (their error text may quote the user), or those of the
        records a forgotten session took with it. Failures are few: a scan is cheap."""
        db = self._dbs[b"failures"]
        if not txn.stat(db)["entries"]:
            return
        gone = None if lsns is None else set(lsns)
        doomed = [key for key, value in txn.cursor(db)
                  if (decode_failure(value).user_id == user_id if gone is None
                      else int.from_bytes(key[:8], "big") in gone)]
        for key in doomed:
            txn.delete(key, db=db)

    def _forget_session_derived(self, txn: lmdb.Transaction, op: Forget, deleted: array) -> None:
        """A forgotten session's episodes, the facts extracted from it (every version), and its
        lsns in the user's entity registry."""
        dbs = self._dbs
        uprefix = user_prefix(op.user_id)
        log, vectors, links = dbs[b"log"], dbs[b"vectors"], dbs[b"links"]

        def drop(lsn: int, memory_id: str) -> None:
            if txn.delete(lsn_key(lsn), db=log):
                deleted.append(lsn)
            _wipe_key(txn, uprefix + lsn_key(lsn), vectors)
            txn.delete(uprefix + memory_id.encode(), db=dbs[b"ids"])
            _wipe_key(txn, uprefix + memory_id.encode(), dbs[b"reviews"])
            _delete_links_of(txn, links, op.user_id, memory_id)

        prefix = session_prefix(op.user_id, op.session_id)
        cursor = txn.cursor(dbs[b"episodes"])
        if cursor.set_range(prefix):
            while cursor.key().startswith(prefix):
                episode = decode_episode(cursor.value())
                drop(episode.lsn, episode.episode_id)
                if not _wipe(cursor):
                    break
        cursor = txn.cursor(dbs[b"facts"])
        if cursor.set_range(uprefix):
            while cursor.key().startswith(uprefix):
                fact = decode_fact(cursor.value())
                if fact.session_id == op.session_id:
                    drop(fact.lsn, fact.fact_id)
                    if not _wipe(cursor):
                        break
                elif not cursor.next():
                    break
        gone = set(deleted)
        cursor = txn.cursor(dbs[b"entities"])
        if cursor.set_range(uprefix):
            while cursor.key().startswith(uprefix):
                entity = decode_entity(cursor.value())
                kept = tuple(lsn for lsn in entity.lsns if lsn not in gone)
                if not kept:
                    if not _wipe(cursor):
                        break
                    continue
                if len(kept) != len(entity.lsns):
                    cursor.put(cursor.key(), _encode(msgspec.structs.replace(entity, lsns=kept)))
                if not cursor.next():
                    break

    def _put_note_in(self, txn: lmdb.Transaction, op: PutNote
                     ) -> tuple[Note | None, str | None, int]:
        """Store a note version. ``op.replaces`` says what the caller expects: -1 a new note
        (its id must be free), 1 an update (the note must exist). Returns (stored note, None,
        the lsn it replaced) or (None, why not, 0); a refused op still takes its lsn, as an
        empty tombstone, so the log stays gapless."""
        dbs = self._dbs
        key = user_prefix(op.note.user_id) + op.note.note_id.encode()
        raw = txn.get(key, db=dbs[b"notes"])
        current = None if raw is None else _decode_note(raw)
        if (op.replaces < 0) != (current is None):
            txn.put(lsn_key(op.lsn), LOG_TOMBSTONE, db=dbs[b"log"], append=True)
            return None, "exists" if current is not None else "missing", 0
        note = op.note
        replaces = 0
        if current is not None:
            replaces = current.lsn
            note = msgspec.structs.replace(note, created_at=current.created_at)
            txn.delete(lsn_key(replaces), db=dbs[b"log"])
            txn.delete(user_prefix(note.user_id) + lsn_key(replaces), db=dbs[b"vectors"])
        txn.put(key, _encode(note), db=dbs[b"notes"])
        txn.put(lsn_key(op.lsn), LOG_NOTE + lsn_key(replaces) + key, db=dbs[b"log"], append=True)
        return note, None, replaces

    def _write_summary_in(self, txn: lmdb.Transaction, op: WriteSummary) -> bool:
        key = user_prefix(op.user_id) + op.session_id.encode()
        raw = txn.get(key, db=self._dbs[b"summaries"])
        epoch = 0 if raw is None else _decode_summary(raw).epoch
        if epoch != op.expected_epoch:
            return False  # a newer summary landed since the writer read: discard this one
        txn.put(key, _encode(op.state), db=self._dbs[b"summaries"])
        return True

    def _delete_note_in(self, txn: lmdb.Transaction, op: DeleteNote) -> list[int]:
        dbs = self._dbs
        uprefix = user_prefix(op.user_id)
        key = uprefix + op.note_id.encode()
        raw = txn.get(key, db=dbs[b"notes"])
        deleted = array("Q")
        if raw is not None:
            lsn = _decode_head(raw).lsn
            deleted.append(lsn)
            _wipe_key(txn, key, dbs[b"notes"])
            txn.delete(lsn_key(lsn), db=dbs[b"log"])
            _wipe_key(txn, uprefix + lsn_key(lsn), dbs[b"vectors"])
            _delete_links_of(txn, dbs[b"links"], op.user_id, op.note_id)
            self._mark_scrub(txn, uprefix)
        result = deleted.tolist()
        deleted.byteswap()
        txn.put(lsn_key(op.lsn), LOG_TOMBSTONE + deleted.tobytes(), db=dbs[b"log"], append=True)
        return result

    def _put_episode_in(self, txn: lmdb.Transaction, op: PutEpisode) -> Episode | None:
        dbs = self._dbs
        episode = op.episode
        if txn.get(session_prefix(episode.user_id, episode.session_id)[:-1],
                   db=dbs[b"sessions"]) is None:
            # The session was forgotten while the episode was being made: drop it, and keep
            # the log gapless with an empty tombstone.
            txn.put(lsn_key(op.lsn), LOG_TOMBSTONE, db=dbs[b"log"], append=True)
            return None
        key = episode_key(episode)
        txn.put(key, _encode(episode), db=dbs[b"episodes"])
        txn.put(user_prefix(episode.user_id) + episode.episode_id.encode(), IDS_EPISODE + key,
                db=dbs[b"ids"])
        txn.put(lsn_key(op.lsn), LOG_EPISODE + key, db=dbs[b"log"], append=True)
        for link in op.links:
            for link_key in link_keys(episode.user_id, link):
                txn.put(link_key, _encode(link), db=dbs[b"links"])
        return episode

    def _put_fact_in(self, txn: lmdb.Transaction, op: PutFact) -> list[int] | None:
        dbs = self._dbs
        log, ids = dbs[b"log"], dbs[b"ids"]
        uprefix = user_prefix(op.user_id)
        if op.requires and txn.get(lsn_key(op.requires), db=log) is None:
            txn.put(lsn_key(op.lsn), LOG_TOMBSTONE, db=log, append=True)
            return None  # its source was forgotten while the fact was being decided
        left: list[int] = []
        for old in op.retired:
            key = fact_key(old)
            txn.put(key, _encode(old), db=dbs[b"facts"])
            entry = txn.get(lsn_key(old.lsn), db=log)
            if entry is not None:
                # Carry what the retired entry retired: an index that never read it still
                # has to drop those versions.
                left.extend(_fact_entry_lsns(entry)[0])
                left.append(old.lsn)
                txn.delete(lsn_key(old.lsn), db=log)
                txn.delete(uprefix + lsn_key(old.lsn), db=dbs[b"vectors"])
        if op.fact is None:
            gone = array("Q", left)
            gone.byteswap()
            txn.put(lsn_key(op.lsn), LOG_TOMBSTONE + gone.tobytes(), db=log, append=True)
            return left
        fact = op.fact
        key = fact_key(fact)
        txn.put(key, _encode(fact), db=dbs[b"facts"])
        txn.put(uprefix + fact.fact_id.encode(), IDS_FACT + key, db=ids)
        entry = LOG_FACT + len(left).to_bytes(2, "big") + b"".join(map(lsn_key, left)) + key
        txn.put(lsn_key(op.lsn), entry, db=log, append=True)
        for link in op.links:
            for link_key in link_keys(op.user_id, link):
                txn.put(link_key, _encode(link), db=dbs[b"links"])
        return left

    def _put_link_in(self, txn: lmdb.Transaction, op: PutLink) -> None:
        for key in link_keys(op.user_id, op.link):
            txn.put(key, _encode(op.link), db=self._dbs[b"links"])

    def _put_state_in(self, txn: lmdb.Transaction, op: PutState) -> None:
        dbs = self._dbs
        log = dbs[b"log"]
        for name, key, value, guard in op.puts:
            if guard and txn.get(lsn_key(guard), db=log) is None:
                continue
            if value is None:
                txn.delete(key, db=dbs[name])
            else:
                txn.put(key, value, db=dbs[name])
        for user_id, link, guard in op.links:
            if guard and txn.get(lsn_key(guard), db=log) is None:
                continue
            for link_key in link_keys(user_id, link):
                txn.put(link_key, _encode(link), db=dbs[b"links"])

    def _put_vectors_in(self, txn: lmdb.Transaction, op: PutVectors) -> list[tuple[int, str, bytes]]:
        log, vectors = self._dbs[b"log"], self._dbs[b"vectors"]
        written = []
        for item in op.items:
            lsn, user_id, value = item
            entry = txn.get(lsn_key(lsn), db=log)
            if entry is not None and entry_record_key(entry).startswith(user_prefix(user_id)):
                txn.put(user_prefix(user_id) + lsn_key(lsn), value, db=vectors)
                written.append(item)
            # else: forgotten while it was being embedded; it must not come back
        meta = self._dbs[b"meta"]
        txn.put(_EMBEDDED_KEY, lsn_key(op.watermark), db=meta)
        if op.backlog is not None:
            if op.backlog:
                txn.put(EMBED_BACKLOG_KEY, op.backlog, db=meta)
            else:
                txn.delete(EMBED_BACKLOG_KEY, db=meta)
        return written

    def _mark_scrub(self, txn: lmdb.Transaction, uprefix: bytes) -> None:
        """This transaction deletes records of the user with this key prefix: remember to
        scrub the pages (:meth:`scrub`), across a crash too."""
        meta = self._dbs[b"meta"]
        raw = txn.get(SCRUB_KEY, db=meta)
        prefixes = [] if raw is None else _decode_prefixes(raw)
        if uprefix not in prefixes:
            txn.put(SCRUB_KEY, _encode([*prefixes, uprefix]), db=meta)
        self._freed_txnid = txn.raw.id()

    def _touch(self, txn: lmdb.Transaction) -> bool:
        """Rewrite the pages holding a deleted user's records, and the pages of the
        SCRUB_BEFORE records before them: LMDB copies a page before changing it, and the copy
        carries only its records, not what its free space held (a deleted record's bytes, or
        copies of records a split moved away). Same-size values are rewritten in place. At
        most SCRUB_TOUCH_MAX records a transaction; returns whether more remain."""
        if self._touch_plan is None:
            raw = txn.get(SCRUB_KEY, db=self._dbs[b"meta"])
            self._touched = [] if raw is None else _decode_prefixes(raw)
            self._touch_plan = [(p, name) for p in self._touched for name in SCRUB_DBS]
            self._touch_from = None
        budget = SCRUB_TOUCH_MAX
        while self._touch_plan:
            uprefix, name = self._touch_plan[0]
            cursor = txn.raw.cursor(self._dbs[name])  # the sealed bytes, put back as they are
            if self._touch_from is not None:
                more = cursor.set_range(self._touch_from)
            elif more := (cursor.set_range(uprefix) or cursor.last()):
                for _ in range(SCRUB_BEFORE):
                    if not cursor.prev():
                        cursor.first()
                        break
            while more:
                if not budget:
                    self._touch_from = cursor.key()
                    return True
                key = cursor.key()
                cursor.put(key, cursor.value())
                budget -= 1
                more = not (key > uprefix and not key.startswith(uprefix)) and cursor.next()
            self._touch_plan.pop(0)
            self._touch_from = None
        self._touch_plan = None
        return False

    def _scrub_in(self, txn: lmdb.Transaction, op: ScrubFreePages) -> int | None:
        """One stage of :meth:`scrub`. ``touch``: rewrite pages (:meth:`_touch`); returns 1
        while more remain. ``fill``: zero values on the free pages LMDB may reuse now; returns
        how many free pages were left over for the next fill, or None while a reader's
        snapshot from before the last deletion pins pages. ``clear``: delete the zero values
        (their pages go back to the free list holding zeros) and the touched users' marker."""
        meta = self._dbs[b"meta"]
        if op.stage == "touch":
            more = self._touch(txn)
            self._freed_txnid = txn.raw.id()  # the pages it rewrote hold what it cleaned away
            return int(more)
        if op.stage == "clear":
            cursor = txn.cursor(meta)
            if cursor.set_range(_SCRUB_FILL):
                while cursor.key().startswith(_SCRUB_FILL):
                    if not cursor.delete():
                        break
            # Users deleted from since the touch stay listed for the next scrub.
            raw = txn.get(SCRUB_KEY, db=meta)
            left = [p for p in ([] if raw is None else _decode_prefixes(raw))
                    if p not in self._touched]
            if left:
                txn.put(SCRUB_KEY, _encode(left), db=meta)
            else:
                txn.delete(SCRUB_KEY, db=meta)
            return 0
        if any(txnid <= self._freed_txnid for txnid in _reader_txnids(self._env)):
            return None
        used = 2  # LMDB's two meta pages
        for db in (*self._dbs.values(), self._env.open_db(None, txn=txn.raw)):
            stat = txn.stat(db)
            used += stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]
        free = self._env.info()["last_pgno"] + 1 - used
        take = max(0, min(free, SCRUB_MAX_PAGES))
        cursor = txn.cursor(meta)
        start = 0  # fill keys sort last in meta; a crashed scrub's stay until the next clears
        if cursor.last() and cursor.key().startswith(_SCRUB_FILL):
            start = int.from_bytes(cursor.key()[len(_SCRUB_FILL):], "big") + 1
        zeros = bytes(SCRUB_VALUE)
        for i in range(start, start + take):
            txn.put(_SCRUB_FILL + i.to_bytes(8, "big"), zeros, db=meta)
        return free - take

    async def scrub(self) -> None:
        """Clear what deletions left in LMDB's pages, and the scrub marker: rewrite the pages
        around the deleted users' keys, then overwrite with zeros every free page (LMDB copies
        a page before changing it and keeps the old copy as a free page until it reuses it;
        taking every reusable free page with zero values and then deleting them leaves zeros
        on them). Cost: a rewrite of the users' records and a write of the free pages. Waits
        while a reader's snapshot from before the last deletion pins pages, as a snapshot
        being copied does. Not a promise for every byte: LMDB reuses page buffers without
        clearing them, so a page written later can carry stale bytes in its free space (a
        snapshot or ``compact`` writes a new environment, which cannot).

        Raises:
            EngineBroken / EngineClosed: the store failed or closed first.
        """
        while await self._scrub_step("touch"):
            pass
        # LMDB keeps the pages the latest commit freed for readers that began before it: a
        # commit in between, so that the fill may reuse the pages the touch freed.
        await self.write_unlogged(PutState(((b"meta", _SCRUB_FILL, b"", 0),), (), trio.Event()))
        while True:
            left = await self._scrub_step("fill")
            if left is None:
                await trio.sleep(SCRUB_RETRY)
            elif left <= 0:
                break
        await self._scrub_step("clear")

    async def _scrub_step(self, stage: str) -> int | None:
        results: list[int | None] = []
        op = ScrubFreePages(stage, trio.Event(), results.append)
        self.check_usable()
        self.submit(op)
        await op.done.wait()
        if self._failure is not None or not results:
            raise self._not_committed_error()
        return results[0]

    async def _grow_map(self) -> None:
        await self._enter_exclusive()
        try:
            size = self._env.info()["map_size"] * 2
            self._env.set_mapsize(size)
        finally:
            self._leave_exclusive()

    def _fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
        self._closing = True
        self._wake_all_waiters()
        self._room.unpark_all()
        self._commits.unpark_all()

    def _wake_all_waiters(self) -> None:
        # Woken waiters compare their lsn with committed_lsn (or look at _failure) and raise
        # if theirs did not land.
        while self._waiters:
            heapq.heappop(self._waiters)[2].set()
        self._batches.unpark_all()
        for op in self._queue:
            done = getattr(op, "done", None)  # unlogged ops carry an event for their writer
            if done is not None:
                done.set()

    # -- reads -------------------------------------------------------------------------------

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(txn, dbs, *args)`` in a worker thread inside one read transaction.

        Raises:
            EngineClosed: the store is closed.
        """
        while self._exclusive:
            await self._gate.park()
        if self._env is None:
            raise EngineClosed("the engine is closed; open a new one with Engine.open(path)")
        self._readers += 1
        try:
            return await trio.to_thread.run_sync(
                self._read_in_thread, fn, args, limiter=self._read_limiter
            )
        except _MapResized:
            pass
        finally:
            self._readers -= 1
            if not self._readers and self._gate:
                self._gate.unpark_all()
        await self._enter_exclusive()
        try:
            if self._env is not None:
                self._env.set_mapsize(0)  # 0: adopt the size the writer set
        finally:
            self._leave_exclusive()
        return await self.read(fn, *args)

    def _read_in_thread(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        try:
            with self._env.begin(buffers=False) as txn:
                return fn(CheckedTxn(txn, self._names), self._dbs, *args)
        except lmdb.MapResizedError:
            # The writing process grew the map: a reader adopts the new size (LMDB allows it
            # only with no transaction open in this process, so the caller does it).
            raise _MapResized() from None
        except lmdb.Error as exc:
            raise EngineBroken(f"reading the store at {self.path} failed: {exc}") from exc

    async def copy_to(self, dest: Path) -> int:
        """A record-by-record copy of the environment into the empty directory ``dest``
        (:func:`clean_copy`), from a worker thread in one read transaction (so never from the
        writer's thread with its transaction open); ingestion goes on meanwhile. No byte of a
        deleted record travels. Returns the last lsn the copy holds."""

        def copy(txn: lmdb.Transaction, dbs: dict[bytes, Any]) -> int:
            clean_copy(self._env, txn.raw, dest)
            return _int(txn.get(_LAST_LSN_KEY, db=dbs[b"meta"])) or 0

        dest.mkdir(parents=True)
        return await self.read(copy)

    async def _enter_exclusive(self) -> None:
        while self._exclusive:
            await self._gate.park()
        self._exclusive = True
        while self._readers:
            await self._gate.park()

    def _leave_exclusive(self) -> None:
        self._exclusive = False
        self._gate.unpark_all()

    def map_size(self) -> int:
        return 0 if self._env is None else self._env.info()["map_size"]


class _MapResized(Exception):
    """A read found the map grown by another process (read-only engines); retried."""


def _read_only_error() -> InvalidInput:
    return InvalidInput("read_only", "expected an engine that owns the store, found one opened "
                                     "with read_only=True, which writes nothing; open the store "
                                     "with Engine.open(path) where it is served")


CLEAN_COPY_CHUNK = 65_536  # records per write transaction of a clean copy (LMDB caps dirty pages)


def clean_copy(env: lmdb.Environment, txn: lmdb.Transaction, dest: Path) -> None:
    """Copy every named database of ``env`` as ``txn`` sees it, record by record, into a new
    environment in the existing empty directory ``dest``, and flush it to disk.

    Why not LMDB's compacting copy: it copies pages whole, and a page's free space can hold
    bytes of deleted records (a deletion moves the page's other records over the deleted one;
    LMDB reuses page buffers without clearing them). A new environment that only ever held
    the live records writes nothing else. Costs more than a page copy: every record passes
    through Python's iterator (still C calls, no decoding)."""
    out = lmdb.open(str(dest), map_size=env.info()["map_size"], max_dbs=MAX_DBS,
                    max_readers=MAX_READERS, sync=False, metasync=False, writemap=False)
    try:
        names = [key for key, _ in txn.cursor()]  # the main database lists the named ones
        for name in names:
            source = txn.cursor(env.open_db(name, txn=txn, create=False))
            records = source.iternext()
            with out.begin(write=True) as wtxn:
                target = out.open_db(name, txn=wtxn)
            while True:
                with out.begin(write=True) as wtxn:
                    cursor = wtxn.cursor(target)
                    _, added = cursor.putmulti(itertools.islice(records, CLEAN_COPY_CHUNK),
                                               append=True)
                if added < CLEAN_COPY_CHUNK:
                    break
        out.sync(True)
    finally:
        out.close()


class LogFollower:
    """Feeds every committed record past a persisted watermark to ``handle(records, last)``,
    in log order, forever (until the store closes). ``handle`` returns the puts and links to
    commit together with the new watermark, so what it derived and where it got to land in one
    transaction: nothing is derived twice or skipped across crashes.

    :meth:`wait` lets ``Engine.flush`` wait until the follower has passed an lsn.
    """

    def __init__(self, store: Store, watermark_key: bytes, chunk: int,
                 handle: Callable[[list[Searchable], int], Any]) -> None:
        self._store = store
        self._key = watermark_key
        self.name = watermark_key.decode().removesuffix("_lsn")  # in its failure records
        self._chunk = chunk
        self._handle = handle
        self.watermark = 0
        self._stopped = False
        # Parked: callers of wait, until the watermark moves or the follower stops.
        self._progress = trio.lowlevel.ParkingLot()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        store = self._store
        try:
            self.watermark = await store.read(read_meta_lsn, self._key)
            task_status.started()
            while True:
                await store.wait_commit_beyond(self.watermark)
                records, _, last = await store.read(read_log_range, self.watermark,
                                                    store.committed_lsn, self._chunk)
                try:
                    await self._step(records, last)
                except (EngineClosed, EngineBroken):
                    raise
                except Exception:
                    if not store.usable():
                        raise
                    await self._one_by_one(records, last)
                self.watermark = last
                self._progress.unpark_all()
        except EngineClosed:
            return  # the watermark on disk says where to resume
        finally:
            self._stopped = True
            self._progress.unpark_all()

    async def _step(self, records: list[Searchable], last: int) -> None:
        puts, links = await self._handle(records, last)
        puts = (*puts, (b"meta", self._key, lsn_key(last), 0))
        await self._store.write_unlogged(PutState(puts, links, trio.Event()))

    async def _one_by_one(self, records: list[Searchable], last: int) -> None:
        """A step failed: handle its records one at a time, so that the one that fails is
        kept as a failure (with the watermark past it) and the others are taken in."""
        store = self._store
        for record in records:
            try:
                await self._step([record], record.lsn)
            except (EngineClosed, EngineBroken):
                raise
            except Exception as exc:
                if not store.usable():
                    raise
                log.warning("%s: record %d failed and is kept as a failure: %r", self.name,
                            record.lsn, exc)
                put = failure_put(record.lsn, self.name, record.user_id, record.memory_id, exc)
                watermark = (b"meta", self._key, lsn_key(record.lsn), 0)
                await store.write_unlogged(PutState((put, watermark), (), trio.Event()))
        await store.write_unlogged(PutState(((b"meta", self._key, lsn_key(last), 0),), (),
                                            trio.Event()))

    async def wait(self, lsn: int) -> None:
        """Return once every record up to ``lsn`` was handled (or the follower stopped)."""
        while self.watermark < lsn and not self._stopped:
            await self._progress.park()


# -- read functions: run by Store.read in a worker thread -------------------------------------


def read_sessions(txn: lmdb.Transaction, dbs: dict[bytes, Any]) -> list[SessionInfo]:
    """Every session's info, in key order."""
    return [_decode_session(v) for v in txn.cursor(dbs[b"sessions"]).iternext(keys=False, values=True)]


def read_session_tail(
    txn: lmdb.Transaction, dbs: dict[bytes, Any], user_id: str, session_id: str,
    limit: int, before_seq: int | None,
) -> list[Turn]:
    """Up to ``limit`` turns of a session with seq < ``before_seq`` (all if None), oldest first."""
    prefix = session_prefix(user_id, session_id)
    cursor = txn.cursor(dbs[b"turns"])
    end = prefix + (before_seq.to_bytes(8, "big") if before_seq is not None else b"\xff" * 8)
    found: list[Turn] = []
    # Position on the last key below `end`, then walk backwards.
    if cursor.set_range(end):
        moved = cursor.prev()
    else:
        moved = cursor.last()
    while moved and len(found) < limit:
        key = cursor.key()
        if not key.startswith(prefix):
            break
        found.append(_decode_turn(cursor.value()))
        moved = cursor.prev()
    found.reverse()
    # Turn numbers promise no gaps: the tail must end where the session says it does and
    # count up by one, each turn under its own key.
    if before_seq is None:
        raw = txn.get(prefix[:-1], db=dbs[b"sessions"])
        end = None if raw is None else _decode_session(raw).turn_count
    else:
        end = before_seq
    if end is not None and (end > 0 or found):
        start = end - len(found)
        if start < 0 or [t.seq for t in found] != list(range(start, end)) or (
                len(found) < limit and start != 0) or any(
                t.user_id != user_id or t.session_id != session_id for t in found):
            raise StoreTampered(
                f"session {session_id!r} of user {user_id!r} promises turns numbered up to "
                f"{end - 1} without gaps, and its latest turns in the store are seqs "
                f"{[t.seq for t in found]}: "
                "turns were removed, moved or copied in outside the engine; run `engram-trio verify "
                "STORE`", "turns", prefix, found[0].lsn if found else 0)
    return found



def _note_version(txn: lmdb.Transaction, dbs: dict[bytes, Any], entry: bytes,
                  lsn: int) -> Note | None:
    """The note a ``N`` log entry at ``lsn`` names, if that version is still the current one."""
    raw = txn.get(entry[9:], db=dbs[b"notes"])
    note = None if raw is None else _decode_note(raw)
    return note if note is not None and note.lsn == lsn else None


def read_log_range(
    txn: lmdb.Transaction, dbs: dict[bytes, Any], after: int, upto: int, limit: int
) -> tuple[list[Searchable], list[int], int]:
    """What was logged in (after, upto], in log order, at most ``limit`` records.

    Returns:
        (searchable records, lsns deleted by tombstones in the range, the last lsn looked at).
        Records deleted since they were logged are skipped.
    """
    found: list[Searchable] = []
    deleted: list[int] = []
    last = after
    cursor = txn.cursor(dbs[b"log"])
    if cursor.set_range(lsn_key(after + 1)):
        for key, entry in cursor:
            lsn = int.from_bytes(key, "big")
            if lsn > upto or len(found) >= limit:
                break
            last = lsn
            kind = entry[:1]
            if kind == LOG_TOMBSTONE:
                lsns = array("Q", entry[1:])
                lsns.byteswap()
                deleted.extend(lsns)
                continue
            if kind == LOG_NOTE:
                replaces = int.from_bytes(entry[1:9], "big")
                if replaces:
                    deleted.append(replaces)
            elif kind == LOG_FACT:
                deleted.extend(_fact_entry_lsns(entry)[0])
            record = searchable_at(txn, dbs, lsn, entry)
            if record is not None:
                found.append(record)
    if len(found) < limit:
        last = max(last, upto)
    return found, deleted, last


def searchable_at(txn: lmdb.Transaction, dbs: dict[bytes, Any], lsn: int,
                  entry: bytes) -> Searchable | None:
    """What the indexes see of the record the log entry at ``lsn`` names; None for a
    tombstone, a record deleted since, a note version replaced since, or a retired fact."""
    kind = entry[:1]
    if kind == LOG_TURN:
        raw = txn.get(entry[1:], db=dbs[b"turns"])
        if raw is None:
            return None
        t = _decode_turn(raw)
        return Searchable(lsn, "turn", t.user_id, t.session_id, t.role, t.at, t.text,
                          turn_tags(t), t.turn_id, t.seq)
    if kind == LOG_NOTE:
        note = _note_version(txn, dbs, entry, lsn)
        if note is None:
            return None
        return Searchable(lsn, "note", note.user_id, "", "", note.updated_at, note.text,
                          note.tags, note.note_id)
    if kind == LOG_EPISODE:
        raw = txn.get(entry[1:], db=dbs[b"episodes"])
        return None if raw is None else episode_searchable(decode_episode(raw))
    if kind == LOG_FACT:
        raw = txn.get(_fact_entry_lsns(entry)[1], db=dbs[b"facts"])
        fact = None if raw is None else decode_fact(raw)
        return fact_searchable(fact) if fact is not None and fact.status == "active" else None
    return None


def read_searchables(txn: lmdb.Transaction, dbs: dict[bytes, Any],
                     lsns: list[int]) -> list[Searchable]:
    """What the indexes see of the records at these lsns, those still there, in order."""
    log = dbs[b"log"]
    found = []
    for lsn in lsns:
        entry = txn.get(lsn_key(lsn), db=log)
        record = None if entry is None else searchable_at(txn, dbs, lsn, entry)
        if record is not None:
            _check_logged(txn, dbs, lsn_key(lsn), entry)
            found.append(record)
    return found


def episode_searchable(e: Episode) -> Searchable:
    """What the indexes see of an episode: its title, summary and keywords."""
    text = f"{e.title}\n{e.summary}\n{' '.join(e.keywords)}"
    return Searchable(e.lsn, "episode", e.user_id, e.session_id, "", e.end_at, text, (),
                      e.episode_id)


def fact_searchable(f: Fact) -> Searchable:
    """What the indexes see of a fact: its sentence and keywords (seed 001's search text)."""
    return Searchable(f.lsn, "fact", f.user_id, "", "", f.created_at,
                      f"{f.text}\n{' '.join(f.keywords)}", (f.category,), f.fact_id)


def turn_tags(turn: Turn) -> tuple[str, ...]:
    """A turn's tags: the strings in ``meta["tags"]`` (the documented convention)."""
    tags = turn.meta.get("tags") if turn.meta else None
    if isinstance(tags, str):
        return (tags,)
    if isinstance(tags, list):
        return tuple(t for t in tags if isinstance(t, str))
    return ()


Memory = Turn | Note | Episode | Fact


def read_records(
    txn: lmdb.Transaction, dbs: dict[bytes, Any], user_id: str, lsns: list[int]
) -> dict[int, Memory]:
    """The user's records at these lsns; others' records, deleted ones and retired fact
    versions are left out."""
    uprefix = user_prefix(user_id)
    log, turns = dbs[b"log"], dbs[b"turns"]
    out: dict[int, Memory] = {}
    for lsn in lsns:
        log_key = lsn_key(lsn)
        entry = txn.get(log_key, db=log)
        if entry is None:
            continue
        kind = entry[:1]
        if kind == LOG_TURN and entry[1:].startswith(uprefix):
            raw = txn.get(entry[1:], db=turns)
            if raw is not None:
                _check_content(txn, dbs, log_key, entry, raw)
                out[lsn] = _decode_turn(raw)
        elif kind == LOG_NOTE and entry[9:].startswith(uprefix):
            note = _note_version(txn, dbs, entry, lsn)
            if note is not None:
                _check_content(txn, dbs, log_key, entry, content_of(txn, dbs, entry) or b"")
                out[lsn] = note
        elif kind == LOG_EPISODE and entry[1:].startswith(uprefix):
            raw = txn.get(entry[1:], db=dbs[b"episodes"])
            if raw is not None:
                _check_content(txn, dbs, log_key, entry, raw)
                out[lsn] = decode_episode(raw)
        elif kind == LOG_FACT:
            key = _fact_entry_lsns(entry)[1]
            raw = txn.get(key, db=dbs[b"facts"]) if key.startswith(uprefix) else None
            fact = None if raw is None else decode_fact(raw)
            if fact is not None and fact.status == "active":
                _check_content(txn, dbs, log_key, entry, _fact_core(fact))
                out[lsn] = fact
    return out


def read_links(
    txn: lmdb.Transaction, dbs: dict[bytes, Any], user_id: str, memory_ids: list[str]
) -> dict[str, list[Link]]:
    """Every link touching each memory (either direction), by memory id."""
    out: dict[str, list[Link]] = {}
    for memory_id in memory_ids:
        links = out.setdefault(memory_id, [])
        for prefix in link_prefixes(user_id, memory_id):
            links.extend(_decode_link(value) for _, value in _scan(txn, dbs[b"links"], prefix))
    return out


def read_memories_by_id(
    txn: lmdb.Transaction, dbs: dict[bytes, Any], user_id: str, memory_ids: list[str]
) -> dict[str, Memory]:
    """The user's turns, notes, episodes and facts (any version) with these ids."""
    uprefix = user_prefix(user_id)
    ids, notes = dbs[b"ids"], dbs[b"notes"]
    out: dict[str, Memory] = {}
    for memory_id in memory_ids:
        key = txn.get(uprefix + memory_id.encode(), db=ids)
        if key is not None:
            tag = key[:2]
            name, decode = _IDS_TARGETS.get(tag, (b"turns", _decode_turn))
            raw = txn.get(key[2:] if tag in _IDS_TARGETS else key, db=dbs[name])
            if raw is not None:
                out[memory_id] = decode(raw)
                continue
        raw = txn.get(uprefix + memory_id.encode(), db=notes)
        if raw is not None:
            out[memory_id] = _decode_note(raw)
    return out


def read_turn_contexts(
    txn: lmdb.Transaction, dbs: dict[bytes, Any], user_id: str, turn_ids: list[str]
) -> dict[str, list[Turn]]:
    """Each turn with the turn before and the turn after it in its session, by turn id; turns
    not on disk (or not the user's) are left out."""
    turns = dbs[b"turns"]
    out: dict[str, list[Turn]] = {}
    for turn_id, turn in read_memories_by_id(txn, dbs, user_id, turn_ids).items():
        if type(turn) is not Turn:
            continue
        prefix = session_prefix(user_id, turn.session_id)
        context = [turn]
        for seq, at_end in ((turn.seq - 1, False), (turn.seq + 1, True)):
            raw = txn.get(prefix + seq.to_bytes(8, "big"), db=turns) if seq >= 0 else None
            if raw is not None:
                context.insert(len(context) if at_end else 0, _decode_turn(raw))
        out[turn_id] = context
    return out


def read_user_vectors(
    txn: lmdb.Transaction, dbs: dict[bytes, Any], user_id: str
) -> tuple[list[int], bytes]:
    """A user's vector lsns in order, and their values concatenated (parsed by the ANN)."""
    prefix = user_prefix(user_id)
    cursor = txn.cursor(dbs[b"vectors"])
    lsns: list[int] = []
    values: list[bytes] = []
    if cursor.set_range(prefix):
        for key, value in cursor:
            if not key.startswith(prefix):
                break
            lsns.append(int.from_bytes(key[len(prefix):], "big"))
            values.append(value)
    return lsns, b"".join(values)


def stored_model(path: Path) -> ModelInfo | None:
    """The embedding model recorded in a store on disk (None: none recorded yet).

    Raises:
        StoreCorrupt: its data.mdb is shorter than LMDB's header says.
    """
    check_file(path)
    # lock=True: another process may be serving the store, and only a reader in LMDB's
    # reader table is safe from its writer reusing the pages being read.
    env = lmdb.open(str(path), readonly=True, lock=True, max_dbs=MAX_DBS)
    try:
        with env.begin() as txn:
            meta = env.open_db(b"meta", txn=txn, create=False)
            raw = txn.get(_MODEL_KEY, db=meta)
        return None if raw is None else _decode_model(raw)
    except lmdb.NotFoundError:
        return None
    finally:
        env.close()


def read_summary(
    txn: lmdb.Transaction, dbs: dict[bytes, Any], user_id: str, session_id: str
) -> SummaryState | None:
    raw = txn.get(user_prefix(user_id) + session_id.encode(), db=dbs[b"summaries"])
    return None if raw is None else _decode_summary(raw)


def _scan(txn: lmdb.Transaction, db: Any, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
    cursor = txn.cursor(db)
    if cursor.set_range(prefix):
        for key, value in cursor:
            if not key.startswith(prefix):
                break
            yield key, value


def read_facts(txn: lmdb.Transaction, dbs: dict[bytes, Any], user_id: str,
               active_only: bool) -> list[Fact]:
    """The user's facts in key order (category, key, lsn): every version, or the active ones."""
    facts = [decode_fact(v) for _, v in _scan(txn, dbs[b"facts"], user_prefix(user_id))]
    return [f for f in facts if f.status == "active"] if active_only else facts


def read_episodes(txn: lmdb.Transaction, dbs: dict[bytes, Any], user_id: str,
                  session_id: str | None) -> list[Episode]:
    """The user's episodes (of one session, if given), by session and position."""
    prefix = (user_prefix(user_id) if session_id is None
              else session_prefix(user_id, session_id))
    return [decode_episode(v) for _, v in _scan(txn, dbs[b"episodes"], prefix)]


def read_last_episode_seqs(txn: lmdb.Transaction, dbs: dict[bytes, Any],
                           keys: list[tuple[str, str]]) -> dict[tuple[str, str], int]:
    """For each (user, session): the last seq its episodes cover (-1: none yet)."""
    out: dict[tuple[str, str], int] = {}
    cursor = txn.cursor(dbs[b"episodes"])
    for user_id, session_id in keys:
        prefix = session_prefix(user_id, session_id)
        seq = -1
        found = cursor.set_range(prefix + b"\xff" * 8)
        moved = cursor.prev() if found else cursor.last()
        if moved and cursor.key().startswith(prefix):
            seq = decode_episode(cursor.value()).last_seq
        out[(user_id, session_id)] = seq
    return out


def read_session_turns(txn: lmdb.Transaction, dbs: dict[bytes, Any], user_id: str,
                       session_id: str, first_seq: int, last_seq: int) -> list[Turn]:
    """A session's turns with first_seq <= seq <= last_seq, in order."""
    prefix = session_prefix(user_id, session_id)
    cursor = txn.cursor(dbs[b"turns"])
    out: list[Turn] = []
    if cursor.set_range(prefix + first_seq.to_bytes(8, "big")):
        for key, value in cursor:
            if not key.startswith(prefix) or int.from_bytes(key[-8:], "big") > last_seq:
                break
            out.append(_decode_turn(value))
    return out


def read_entities(txn: lmdb.Transaction, dbs: dict[bytes, Any], user_id: str,
                  names: list[str]) -> dict[str, Entity]:
    """The user's registry records under these lower-case keys, and, in the same transaction,
    the entity each alias record among them points to (under its own key)."""
    db = dbs[b"entities"]
    out: dict[str, Entity] = {}
    for name in names:
        raw = txn.get(entity_key(user_id, name), db=db)
        if raw is not None:
            out[name] = decode_entity(raw)
    for entity in list(out.values()):
        target = entity.aliases[0] if entity.type == "alias" else None
        if target is not None and target not in out:
            raw = txn.get(entity_key(user_id, target), db=db)
            if raw is not None:
                out[target] = decode_entity(raw)
    return out


def read_entity_keys(txn: lmdb.Transaction, dbs: dict[bytes, Any], user_id: str) -> list[str]:
    """The user's registry keys: entity names and aliases, lower case (a shortened key's
    name comes from its record: an entity is filed under its name in lower case, an alias
    record is named by its own key)."""
    prefix = user_prefix(user_id)
    return [decode_entity(value).name.lower() if is_fitted(key) else key[len(prefix):].decode()
            for key, value in _scan(txn, dbs[b"entities"], prefix)]


def read_review_states(txn: lmdb.Transaction, dbs: dict[bytes, Any], user_id: str,
                       memory_ids: list[str]) -> dict[str, ReviewState]:
    uprefix = user_prefix(user_id)
    out = {}
    for memory_id in memory_ids:
        raw = txn.get(uprefix + memory_id.encode(), db=dbs[b"reviews"])
        if raw is not None:
            out[memory_id] = decode_review(raw)
    return out


def read_pending(txn: lmdb.Transaction, dbs: dict[bytes, Any]
                 ) -> list[tuple[str, str, PendingReview]]:
    """Every pending review: (user, conversation, what was shown)."""
    out = []
    for key, value in _scan(txn, dbs[b"pending"], b""):
        user, conversation = key.split(b"\x00", 1)
        out.append((user.decode(), conversation.decode(), decode_pending(value)))
    return out


def read_failures(txn: lmdb.Transaction, dbs: dict[bytes, Any],
                  user_id: str | None = None) -> list[Failure]:
    """The failures kept (of one user, if given), by lsn."""
    if b"failures" not in dbs:
        return []  # a store read before its failures database existed: none kept
    found = [decode_failure(v) for _, v in _scan(txn, dbs[b"failures"], b"")]
    return [f for f in found if user_id is None or f.user_id == user_id]


def count_failures(txn: lmdb.Transaction, dbs: dict[bytes, Any]) -> int:
    return txn.stat(dbs[b"failures"])["entries"] if b"failures" in dbs else 0


def read_meta_lsn(txn: lmdb.Transaction, dbs: dict[bytes, Any], name: bytes) -> int:
    return _int(txn.get(name, db=dbs[b"meta"])) or 0


def read_user_counts(txn: lmdb.Transaction, dbs: dict[bytes, Any], user_id: str
                     ) -> dict[str, Any]:
    """How many of each kind of memory a user has, and when the latest turn was said."""
    prefix = user_prefix(user_id)
    turns = 0
    latest = None
    for _, value in _scan(txn, dbs[b"sessions"], prefix):
        info = _decode_session(value)
        turns += info.turn_count
        latest = info.last_at if latest is None else max(latest, info.last_at)
    facts = read_facts(txn, dbs, user_id, True)
    return {
        "turns": turns,
        "episodes": sum(1 for _ in _scan(txn, dbs[b"episodes"], prefix)),
        "facts": len(facts),
        "notes": sum(1 for _ in _scan(txn, dbs[b"notes"], prefix)),
        "entities": sum(1 for _, v in _scan(txn, dbs[b"entities"], prefix)
                        if decode_entity(v).type != "alias"),
        "latest_at": latest,
    }
