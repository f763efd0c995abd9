"""Forgetting: the ops that delete (a session, a user, a note), each record's bytes overwritten
before it goes, and the scrub that clears what deletions left on LMDB's free pages."""

from __future__ import annotations

from array import array
from typing import Any

import lmdb
import msgspec
import trio

from ..base.messages import DeleteNote, Forget, PutState, ScrubFreePages
from .codecs import (
    _decode_head,
    _decode_link,
    _decode_prefixes,
    _encode,
    decode_entity,
    decode_episode,
    decode_fact,
    decode_failure,
)
from .integrity import CheckedCursor, CheckedTxn
from .layout import (
    _SCRUB_FILL,
    LOG_TOMBSTONE,
    SCRUB_KEY,
    legacy_link_keys,
    link_keys,
    link_prefixes,
    lsn_key,
    session_prefix,
    user_prefix,
)
from .reads import _scan

SCRUB_RETRY = 0.05  # seconds between looks while a reader pins the pages a scrub must reuse
SCRUB_VALUE = 4_000  # bytes of each fill value: alone on one overflow page of 4 KiB
SCRUB_MAX_PAGES = 32_768  # pages one fill transaction takes (LMDB caps dirty pages per txn)
SCRUB_TOUCH_MAX = 50_000  # records a touch rewrites per transaction (LMDB caps dirty pages)
SCRUB_BEFORE = 256  # records before a deleted user's keys whose pages a scrub rewrites too:
# a page that split keeps copies of the records it gave its right sibling in its free space
SCRUB_DBS = (b"turns", b"vectors", b"notes", b"summaries", b"episodes", b"facts", b"entities",
             b"pending", b"reviews", b"links", b"sessions")  # values that hold text or vectors


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
    """Every link touching one memory, in both directions, in either key form (links written
    before they carried their type in the key too)."""
    found = [(key, value) for prefix in link_prefixes(user_id, memory_id)
             for key, value in _scan(txn, db, prefix)]
    for key, value in found:
        _wipe_key(txn, key, db)
        link = _decode_link(value)
        for other in (*link_keys(user_id, link), *legacy_link_keys(user_id, link)):
            _wipe_key(txn, other, db)


def _reader_txnids(env: lmdb.Environment) -> list[int]:
    """The snapshots that read transactions (of any process) hold open, by transaction id."""
    out = []
    for line in env.readers().splitlines()[1:]:
        fields = line.split()
        if len(fields) == 3 and fields[2].isdigit():
            out.append(int(fields[2]))
    return out


class Forgetting:
    """The deletions of :class:`~.store.Store` and its scrub of freed pages. Its state (what
    the scrub has left to do) is set up in ``Store.__init__``."""

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
