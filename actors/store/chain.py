"""The log's hash chain as the writer extends it and as opening and ``verify`` check it (the
scheme is described in :mod:`.integrity`)."""

from __future__ import annotations

from typing import Any

from ..base.errors import EngineError, StoreTampered
from ..base.records import Fact
from .codecs import _encode, decode_fact
from .integrity import (
    ABSENT,
    DIGEST,
    ZERO,
    CheckedTxn,
    chain_records,
    content_digest,
    link,
    unseal,
)
from .layout import (
    LOG_EPISODE,
    LOG_FACT,
    LOG_NOTE,
    LOG_TOMBSTONE,
    LOG_TURN,
    _fact_entry_lsns,
    lsn_key,
)


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


def _chain_turns(txn: CheckedTxn, dbs: dict[bytes, Any], lsns: list[bytes], entries: list[bytes],
                 values: list[bytes], previous: bytes) -> bytes:
    """Append the chain records of appended turns (their log keys and entries, and their
    values); returns the last digest."""
    records, previous = chain_records(previous, lsns, entries, values)
    txn.cursor(dbs[b"chain"]).put_columns(lsns, records, append=True)
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
