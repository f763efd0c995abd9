"""Forgetting: the ops that delete (a session, a user, a note), and the scrub that takes
what they removed out of the store's file."""

from __future__ import annotations

from array import array
from typing import Any

import lmdb
import msgspec
import trio

from ..base.errors import EngineBroken
from ..base.messages import DeleteNote, Forget, PutState, ScrubDone
from .codecs import (
    _decode_head,
    _decode_link,
    _encode,
    decode_entity,
    decode_episode,
    decode_fact,
    decode_failure,
    decode_pending,
)
from .layout import (
    _SCRUB_FILL,
    LOG_TOMBSTONE,
    SCRUB_KEY,
    SCRUB_STEP_KEY,
    SCRUBBED_KEY,
    legacy_link_keys,
    link_keys,
    link_prefixes,
    lsn_key,
    session_prefix,
    user_prefix,
)
from .pages import PageFormatError, Scrubbed, zero_stale_bytes
from .reads import _scan, holds_memory

SCRUB_RETRY = 0.05  # seconds between looks while a reader's snapshot keeps freed pages in use


def _delete_prefix(txn: lmdb.Transaction, db: Any, prefix: bytes) -> None:
    cursor = txn.cursor(db)
    if cursor.set_range(prefix):
        while cursor.key().startswith(prefix):
            if not cursor.delete():
                break


def _drop_mentions(txn: lmdb.Transaction, dbs: dict[bytes, Any], user_id: str,
                   gone: set[int]) -> None:
    """The user's entity registry without the mentions at positions ``gone`` (records this
    transaction deletes): an entity no other record mentions goes, and one whose latest
    mention went no longer names it (the next mention links to nothing rather than to a
    forgotten id)."""
    uprefix = user_prefix(user_id)
    cursor = txn.cursor(dbs[b"entities"])
    if not cursor.set_range(uprefix):
        return
    while cursor.key().startswith(uprefix):
        entity = decode_entity(cursor.value())
        kept = tuple(lsn for lsn in entity.lsns if lsn not in gone)
        if not kept:
            if not cursor.delete():
                break
            continue
        if len(kept) != len(entity.lsns):
            last = (entity.last_id if not entity.last_id
                    or holds_memory(txn, dbs, user_id, entity.last_id) else "")
            cursor.put(cursor.key(), _encode(msgspec.structs.replace(entity, lsns=kept,
                                                                    last_id=last)))
        if not cursor.next():
            break


def _drop_stale_reviews(txn: lmdb.Transaction, dbs: dict[bytes, Any], user_id: str) -> None:
    """The user's pending reviews (what a retrieve_memory showed, kept for the next reply to
    rate, under the conversation that asked) that name a memory this transaction deleted:
    they quote its text. A conversation holds one at most, so this reads a few records."""
    uprefix = user_prefix(user_id)
    cursor = txn.cursor(dbs[b"pending"])
    if not cursor.set_range(uprefix):
        return
    while cursor.key().startswith(uprefix):
        shown = decode_pending(cursor.value()).memory_ids
        if not all(holds_memory(txn, dbs, user_id, memory_id) for memory_id in shown):
            if not cursor.delete():
                break
            continue
        if not cursor.next():
            break


def _delete_links_of(txn: lmdb.Transaction, db: Any, user_id: str, memory_id: str) -> None:
    """Every link touching one memory, in both directions, in either key form (links written
    before they carried their type in the key too)."""
    found = [(key, value) for prefix in link_prefixes(user_id, memory_id)
             for key, value in _scan(txn, db, prefix)]
    for key, value in found:
        txn.delete(key, db=db)
        link = _decode_link(value)
        for other in (*link_keys(user_id, link), *legacy_link_keys(user_id, link)):
            txn.delete(other, db=db)


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
        gone: set[str] = set()  # the session's turn ids, and then its episodes'
        ids, log, vectors = dbs[b"ids"], dbs[b"log"], dbs[b"vectors"]
        cursor = txn.cursor(dbs[b"turns"])
        if cursor.set_range(tprefix):
            while cursor.key().startswith(tprefix):
                head = _decode_head(cursor.value())
                deleted.append(head.lsn)
                gone.add(head.turn_id)
                txn.delete(uprefix + head.turn_id.encode(), db=ids)
                txn.delete(lsn_key(head.lsn), db=log)
                txn.delete(uprefix + lsn_key(head.lsn), db=vectors)
                if op.session_id is not None:  # a whole user's go by prefix, below
                    txn.delete(uprefix + head.turn_id.encode(), db=dbs[b"reviews"])
                    _delete_links_of(txn, dbs[b"links"], op.user_id, head.turn_id)
                if not cursor.delete():
                    break
        self._mark_scrub(txn)
        if op.session_id is not None:
            for name in (b"sessions", b"summaries", b"pending"):
                txn.delete(tprefix[:-1], db=dbs[name])
            self._forget_session_derived(txn, op, deleted, gone)
            _drop_stale_reviews(txn, dbs, op.user_id)
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

    def _forget_session_derived(self, txn: lmdb.Transaction, op: Forget, deleted: array,
                                gone: set[str]) -> None:
        """A forgotten session's episodes, the facts extracted from it (every version), its
        turns' and episodes' ids (``gone``: the turns') among other facts' sources, and its
        lsns in the user's entity registry."""
        dbs = self._dbs
        uprefix = user_prefix(op.user_id)
        log, vectors, links = dbs[b"log"], dbs[b"vectors"], dbs[b"links"]

        # Every position of what goes, for the entity registry: a superseded fact version
        # left the log when it was superseded, but the names it mentions still point at it.
        dropped: set[int] = set()

        def drop(lsn: int, memory_id: str) -> None:
            dropped.add(lsn)
            if txn.delete(lsn_key(lsn), db=log):
                deleted.append(lsn)
            txn.delete(uprefix + lsn_key(lsn), db=vectors)
            txn.delete(uprefix + memory_id.encode(), db=dbs[b"ids"])
            txn.delete(uprefix + memory_id.encode(), db=dbs[b"reviews"])
            _delete_links_of(txn, links, op.user_id, memory_id)

        prefix = session_prefix(op.user_id, op.session_id)
        cursor = txn.cursor(dbs[b"episodes"])
        if cursor.set_range(prefix):
            while cursor.key().startswith(prefix):
                episode = decode_episode(cursor.value())
                drop(episode.lsn, episode.episode_id)
                gone.add(episode.episode_id)
                if not cursor.delete():
                    break
        # The facts of the session go (every version), and those whose every source turn
        # went with it; a fact of another session that this one restated stays, without the
        # forgotten turns' and episodes' ids among its sources (not in the chain's digest of
        # a version, which covers its session: a fact of this session another restated goes
        # with it, its session id being one of this session's bytes).
        cursor = txn.cursor(dbs[b"facts"])
        if cursor.set_range(uprefix):
            while cursor.key().startswith(uprefix):
                fact = decode_fact(cursor.value())
                turns = tuple(t for t in fact.source_turn_ids if t not in gone)
                if fact.session_id == op.session_id or (fact.source_turn_ids and not turns):
                    drop(fact.lsn, fact.fact_id)
                    if not cursor.delete():
                        break
                    continue
                episodes = tuple(e for e in fact.source_episode_ids if e not in gone)
                if turns != fact.source_turn_ids or episodes != fact.source_episode_ids:
                    cursor.put(cursor.key(), _encode(msgspec.structs.replace(
                        fact, source_turn_ids=turns, source_episode_ids=episodes)))
                if not cursor.next():
                    break
        _drop_mentions(txn, dbs, op.user_id, dropped.union(deleted))

    def _delete_note_in(self, txn: lmdb.Transaction, op: DeleteNote) -> list[int]:
        dbs = self._dbs
        uprefix = user_prefix(op.user_id)
        key = uprefix + op.note_id.encode()
        raw = txn.get(key, db=dbs[b"notes"])
        deleted = array("Q")
        if raw is not None:
            lsn = _decode_head(raw).lsn
            deleted.append(lsn)
            txn.delete(key, db=dbs[b"notes"])
            txn.delete(lsn_key(lsn), db=dbs[b"log"])
            txn.delete(uprefix + lsn_key(lsn), db=dbs[b"vectors"])
            _delete_links_of(txn, dbs[b"links"], op.user_id, op.note_id)
            _drop_mentions(txn, dbs, op.user_id, {lsn})  # the names only it held go with it
            _drop_stale_reviews(txn, dbs, op.user_id)
            self._mark_scrub(txn)
        result = deleted.tolist()
        deleted.byteswap()
        txn.put(lsn_key(op.lsn), LOG_TOMBSTONE + deleted.tobytes(), db=dbs[b"log"], append=True)
        return result

    def _mark_scrub(self, txn: lmdb.Transaction) -> None:
        """This transaction deletes records: count it in the scrub marker, which lives until a
        scrub covered it (:meth:`scrub`), across a crash too. The marker holds a count, not
        whose records went: it outlives the scrub's overwrite of its own transaction's pages."""
        meta = self._dbs[b"meta"]
        raw = txn.get(SCRUB_KEY, db=meta)
        count = int.from_bytes(raw, "big") if raw is not None and len(raw) == 8 else 0
        txn.put(SCRUB_KEY, (count + 1).to_bytes(8, "big"), db=meta)

    def _scrub_done_in(self, txn: lmdb.Transaction, op: ScrubDone) -> None:
        """Clear the scrub marker if no deletion counted itself in since the scrub read it
        (one that did asks for a scrub of its own), marking the file scrubbed, and the zero
        values an older build's scrub left in ``meta`` if it crashed."""
        meta = self._dbs[b"meta"]
        if txn.get(SCRUB_KEY, db=meta) == op.marker:
            txn.delete(SCRUB_KEY, db=meta)
            txn.put(SCRUBBED_KEY, b"\x01", db=meta)  # see layout.SCRUBBED_KEY
        cursor = txn.cursor(meta)
        if cursor.set_range(_SCRUB_FILL):
            while cursor.key().startswith(_SCRUB_FILL):
                if not cursor.delete():
                    break

    async def scrub(self) -> None:
        """Take out of ``data.mdb`` every byte the deletions committed before the call
        removed (:mod:`.pages` says where LMDB leaves them), then clear the scrub marker.

        1. Close and open the environment again: LMDB keeps the page buffers of this
           process's write transactions, uncleared, for the next ones, so a buffer that held
           a deleted record would carry its bytes into pages written later. Reads wait
           meanwhile (milliseconds).
        2. Then, with no write in between (the writer waits from before step 1 to the end of
           this one): in a write transaction of its own, zero the free space, padding and
           overflow tails of every page in use, and every free page LMDB would reuse. A
           write between the two would copy pages holding deleted bytes (a copy on write
           takes a page's used part and up to 7 bytes of free space at either edge, and
           its padding) into fresh buffers that later writes reuse: after step 2 those
           bytes would be back in pages it never saw. With none, every page written after
           step 2 is built from zeroed buffers and from pages step 2 cleaned, so once the
           marker is cleared the file holds no deleted byte at all, and a snapshot's
           compacting copy of it needs no zeroing of its own (``Store.copy_to``).
        3. After a commit, and once no reader's snapshot is older than step 2's: zero the
           free pages step 2 had to leave (the pages the commit before it freed are the
           previous meta page's tree; a reader's snapshot may hold others).

        Cost: a read of the pages in use (0.1 s a 100 MB here), writes only where something
        stale is. Waits while a reader of any process holds a snapshot from before step 2,
        as a snapshot being copied does.

        Raises:
            EngineBroken: the file is not laid out as LMDB 0.9 lays it out (nothing written).
            EngineClosed: the store failed or closed first.
        """
        marker = await self.read(_read_marker)
        if marker is None:
            return  # no deletion since the last scrub
        first, oldest, _ = await self._zero_stale(True, (0, None), True)
        while oldest < first:
            # A commit, so that the pages the one before step 2 freed may be reused.
            await self.write_unlogged(PutState(((b"meta", SCRUB_STEP_KEY, b"", 0),
                                                (b"meta", SCRUB_STEP_KEY, None, 0)),
                                               (), trio.Event()))
            _, reached, _ = await self._zero_stale(False, (oldest, first))
            if reached < first:
                await trio.sleep(SCRUB_RETRY)
            oldest = max(oldest, reached)
        await self.write_unlogged(ScrubDone(marker, trio.Event()))

    async def _zero_stale(self, live: bool, freed: tuple[int, int | None],
                          reopen: bool = False) -> tuple[int, int, Scrubbed]:
        """:func:`.pages.zero_stale_bytes` inside a write transaction that writes nothing,
        on the writer's limiter; with ``reopen``, the environment is opened afresh first,
        the writer waiting throughout. Returns that transaction's id, the oldest snapshot
        it respected, and what was zeroed."""
        self.check_usable()
        if not reopen:
            return await trio.to_thread.run_sync(self._zero_stale_in_thread, live, freed,
                                                 limiter=self._write_limiter)
        async with self._write_limiter:  # held from the reopen to the end of the zeroing
            await self._reopen_env()
            self.check_usable()
            return await trio.to_thread.run_sync(self._zero_stale_in_thread, live, freed)

    def _zero_stale_in_thread(self, live: bool, freed: tuple[int, int | None]
                              ) -> tuple[int, int, Scrubbed]:
        try:
            txn = self._env.begin(write=True)  # LMDB's writer lock: no page changes hands
            try:
                txnid = txn.id()
                oldest = min([txnid - 1, *_reader_txnids(self._env)])
                done = zero_stale_bytes(self.path / "data.mdb", txnid, oldest, live=live,
                                        freed=freed, sync=self._config.fsync)
            finally:
                txn.abort()
        except (PageFormatError, lmdb.Error, OSError) as exc:
            raise EngineBroken(f"scrubbing the store at {self.path} failed: {exc}") from exc
        return txnid, oldest, done


def _read_marker(txn: Any, dbs: dict[bytes, Any]) -> bytes | None:
    return txn.get(SCRUB_KEY, db=dbs[b"meta"])
