"""How the writer applies each op other than appends and deletions, inside the batch's write
transaction (worker thread); what an applier returns goes to the op's ``committed``."""

from __future__ import annotations

from array import array
from typing import Any

import lmdb
import msgspec

from ..base.errors import StoreCorrupt
from ..base.messages import (
    Elsewhere,
    PutEpisode,
    PutFact,
    PutLink,
    PutNote,
    PutState,
    PutVectors,
    WriteSummary,
)
from ..base.records import Episode, Link, Note
from .codecs import _decode_link, _decode_note, _decode_summary, _encode
from .layout import (
    _EMBEDDED_KEY,
    EMBED_BACKLOG_KEY,
    IDS_EPISODE,
    IDS_FACT,
    LOG_EPISODE,
    LOG_NOTE,
    LOG_TOMBSTONE,
    _fact_entry_lsns,
    entry_record_key,
    episode_key,
    fact_entry,
    fact_key,
    legacy_link_keys,
    link_keys,
    lsn_key,
    session_prefix,
    user_prefix,
)
from .reads import holds_memory, read_memories_by_id


class Appliers:
    """How :class:`~.store.Store`'s writer applies each kind of op that neither appends nor
    deletes (see ``Store._appliers``)."""

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
            # In the write transaction: an update naming no importance, emotion or category
            # keeps the current version's, whatever was written since the caller read.
            note = msgspec.structs.replace(note, created_at=current.created_at,
                                           **{f: getattr(current, f) for f in op.keep})
            txn.delete(lsn_key(replaces), db=dbs[b"log"])
            txn.delete(user_prefix(note.user_id) + lsn_key(replaces), db=dbs[b"vectors"])
        txn.put(key, _encode(note), db=dbs[b"notes"])
        txn.put(lsn_key(op.lsn), LOG_NOTE + lsn_key(replaces) + key, db=dbs[b"log"], append=True)
        return note, None, replaces

    def _write_summary_in(self, txn: lmdb.Transaction, op: WriteSummary) -> bool:
        if txn.get(session_prefix(op.user_id, op.session_id)[:-1],
                   db=self._dbs[b"sessions"]) is None:
            return False  # the session was forgotten since the writer read it: it stays so
        if not all(holds_memory(txn, self._dbs, op.user_id, turn_id) for turn_id in op.made_of):
            # Turns it was made of were forgotten meanwhile, the session written again since:
            # the summary of them would be taken for the new turns'.
            return False
        key = user_prefix(op.user_id) + op.session_id.encode()
        raw = txn.get(key, db=self._dbs[b"summaries"])
        epoch = 0 if raw is None else _decode_summary(raw).epoch
        if epoch != op.expected_epoch:
            return False  # a newer summary landed since the writer read: discard this one
        txn.put(key, _encode(op.state), db=self._dbs[b"summaries"])
        return True

    def _put_episode_in(self, txn: lmdb.Transaction, op: PutEpisode) -> Episode | None:
        dbs = self._dbs
        episode = op.episode
        if txn.get(session_prefix(episode.user_id, episode.session_id)[:-1],
                   db=dbs[b"sessions"]) is None or not all(
                holds_memory(txn, dbs, episode.user_id, turn_id) for turn_id in episode.turn_ids):
            # The session, or turns of it, forgotten while the episode was being made (the
            # session perhaps written again since): drop it, and keep the log gapless with an
            # empty tombstone.
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
            if old.lsn != op.lsn and txn.get(key, db=dbs[b"facts"]) is None:
                # A version an earlier op made that is not stored (refused: its source was
                # forgotten after a queued decision counted on it; or forgotten since):
                # retiring it must not write it. (A version at this op's own lsn is history
                # an import writes.)
                continue
            txn.put(key, _encode(old), db=dbs[b"facts"])
            entry = txn.get(lsn_key(old.lsn), db=log)
            if entry is not None:
                # Carry what the retired entry retired while an index may not have applied it
                # durably: one that never reads it still has to drop those versions. Once
                # the text index has (``retirements_applied_lsn``), it dropped them; carried
                # always, a key superseded n times logged n lsns with each new value (16,000
                # in a 100k-turn import) and past 65,535 could take no new value at all.
                if old.lsn > self.retirements_applied_lsn:
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
        txn.put(lsn_key(op.lsn), fact_entry(left, key), db=log, append=True)
        for link in op.links:
            for link_key in link_keys(op.user_id, link):
                txn.put(link_key, _encode(link), db=dbs[b"links"])
        return left

    def _put_link_in(self, txn: lmdb.Transaction, op: PutLink) -> tuple[str, ...] | Link:
        """Write the link if both its ends are the user's memories now, in this transaction:
        an end forgotten after the caller looked for it would otherwise leave a link to
        nothing, and a check after the write leaves that link to any crash before it. Returns
        the ends not found (none: written), or the link of this type the pair holds the other
        way: the pair's keys are the same both ways, so writing would turn it around (an
        episode's ``summarises`` into the turn summarising the episode)."""
        link = op.link
        found = read_memories_by_id(txn, self._dbs, op.user_id, [link.from_id, link.to_id])
        missing = tuple(end for end in (link.from_id, link.to_id) if end not in found)
        if missing:
            return missing
        other = _held_other_way(txn, self._dbs[b"links"], op.user_id, link)
        if other is not None:
            return other
        for key in link_keys(op.user_id, link):
            txn.put(key, _encode(link), db=self._dbs[b"links"])
        return ()

    def _put_state_in(self, txn: lmdb.Transaction, op: PutState
                      ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The puts, merges and links; returns the indexes of the links written and of the
        merges that put a value."""
        dbs = self._dbs
        log = dbs[b"log"]
        for name, key, value, guard in op.puts:
            if guard and txn.get(lsn_key(guard), db=log) is None:
                continue
            if value is None:
                txn.delete(key, db=dbs[name])
            else:
                txn.put(key, value, db=dbs[name])
        merged = []
        for i, (name, key, merge, guard) in enumerate(op.merges):
            if guard and txn.get(lsn_key(guard), db=log) is None:
                continue
            try:
                held = txn.get(key, db=dbs[name])
                value = merge(held)
                if type(value) is Elsewhere:  # a pointer: merged into what it points to
                    key = value.key
                    value = merge(txn.get(key, db=dbs[name]))
                    if type(value) is Elsewhere:
                        value = None  # one hop: a pointer to a pointer is left as it is
            except StoreCorrupt:
                continue  # damaged: left for verify to name, and for its reader's read to fail
            if value is not None:
                txn.put(key, value, db=dbs[name])
                merged.append(i)
        linked = []
        for i, (user_id, link, guard) in enumerate(op.links):
            if guard and txn.get(lsn_key(guard), db=log) is None:
                continue
            # A derived link's other end may have been forgotten since it was found (an
            # entity's last mention, in a session forgotten meanwhile): a link to it would
            # keep a forgotten id in the store.
            if not holds_memory(txn, dbs, user_id, link.to_id):
                continue
            # One of its type the pair holds the other way (a caller's link() since this
            # was decided) stays: writing would turn it around.
            if _held_other_way(txn, dbs[b"links"], user_id, link) is not None:
                continue
            for link_key in link_keys(user_id, link):
                txn.put(link_key, _encode(link), db=dbs[b"links"])
            linked.append(i)
        return tuple(linked), tuple(merged)

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


def _held_other_way(txn: lmdb.Transaction, links: Any, user_id: str, link: Link) -> Link | None:
    """The link of ``link``'s type that the pair holds the other way, if any: under the
    typed keys, or the untyped ones a store from before them holds (one link a pair, read
    still). The pair's keys are the same both ways, so writing ``link`` would replace it."""
    for key in (link_keys(user_id, link)[0], legacy_link_keys(user_id, link)[0]):
        raw = txn.get(key, db=links)
        if raw is not None:
            other = _decode_link(raw)
            if other.type == link.type and (other.from_id, other.to_id) == (link.to_id,
                                                                             link.from_id):
                return other
    return None
