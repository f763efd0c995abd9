"""The messages actors exchange: frozen, tagged Structs, one union per actor.

Persisted records live in ``actors.base.records``; nothing here is ever written to disk as is.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import msgspec

from .records import Turn

__all__ = ["AppendTurn", "AppendTurns", "Forget", "PutVectors", "PutLink", "PutNote", "DeleteNote",
           "WriteSummary",
           "PutEpisode", "PutFact", "PutState", "Searchable",
           "EmbedRequest", "Candidate",
           "StoreOp", "EmbedderOp", "ScrubDone"]


class AppendTurn(msgspec.Struct, frozen=True, tag=True):
    """Write one turn. ``key`` and ``value`` are encoded on the trio thread at ingest, so the
    writer thread holds the GIL only for LMDB's own C loop.

    Attributes:
        turn: the record (its ``lsn`` orders the log).
        key: the turn's key in the ``turns`` database.
        value: the turn encoded as msgpack.
        started_at: the session's earliest turn time, for its SessionInfo.
        id_key: the turn's key in the ``ids`` database.
        last_at: the session's latest turn time, for its SessionInfo (a turn may be
            back-dated: this is not always its own).
    """

    turn: Turn
    key: bytes
    value: bytes
    started_at: datetime
    id_key: bytes
    last_at: datetime

    @property
    def lsn(self) -> int:
        return self.turn.lsn


class AppendTurns(msgspec.Struct, frozen=True, tag=True):
    """Write a run of turns with consecutive lsns (``add_turns``): what as many AppendTurn ops
    would carry, made in bulk on the trio thread, as columns (one item per turn). It takes one
    queue slot per turn (``Store.submit_turns``), so queue limits and batches count turns.

    Attributes:
        turns: the records, in lsn order.
        keys: their keys in the ``turns`` database.
        values: the turns encoded as msgpack.
        id_keys: their keys in the ``ids`` database.
        lsns: their keys in the ``log`` database.
        sessions: each session of the run: its key in ``sessions`` -> (its earliest and its
            latest turn time, its last turn in the run).
    """

    turns: list[Turn]
    keys: list[bytes]
    values: list[bytes]
    id_keys: list[bytes]
    lsns: list[bytes]
    sessions: dict[bytes, tuple[datetime, datetime, Turn]]

    @property
    def lsn(self) -> int:
        """The last turn's lsn: the op is logged once all of them are."""
        return self.turns[-1].lsn

    def one(self, i: int) -> AppendTurn:
        """The ``i``-th turn as an op of its own (the writer isolates a turn it cannot put)."""
        key = self.keys[i]
        started_at, last_at, _ = self.sessions[key[:-9]]
        return AppendTurn(self.turns[i], key, self.values[i], started_at, self.id_keys[i],
                          last_at)


class Forget(msgspec.Struct, frozen=True, tag=True):
    """Delete a whole session (``session_id`` set) or a whole user (``session_id`` None), and log
    a tombstone at ``lsn`` that lists the deleted log sequence numbers and nothing of the user.

    ``committed`` (optional) is called on the trio thread right after the commit, in commit
    order, with the deleted lsns."""

    lsn: int
    user_id: str
    session_id: str | None
    committed: Any = None


class ScrubDone(msgspec.Struct, frozen=True, tag=True):
    """A scrub (``Store.scrub``) took out of the store's file what the deletions before it
    removed: clear the scrub marker if it still reads ``marker`` (a deletion since changed
    it, and asks for a scrub of its own). ``done`` is set once committed. Derived upkeep: no
    log position."""

    marker: bytes
    done: Any = None

    lsn = None  # not part of the log


class PutVectors(msgspec.Struct, frozen=True, tag=True):
    """Store embeddings of logged records and advance the embedded watermark, atomically.

    Derived data: it takes no log sequence number. A vector whose record was deleted while it
    was being computed is dropped by the writer, so a forgotten user's vectors never come back.

    Attributes:
        items: (lsn, user_id, value) per record; value is the ANN header + float32 vector.
        watermark: every record up to this lsn is embedded (or not searchable).
        done: set once committed.
        committed: called on the trio thread right after the commit, in commit order, with the
            items actually written.
        backlog: the embedding backlog that remains once these items are written (8-byte
            big-endian lsns; b"": none); None leaves it as it is.
    """

    items: list[tuple[int, str, bytes]]
    watermark: int
    done: Any = None
    committed: Any = None
    backlog: bytes | None = None

    lsn = None  # not part of the log


class PutLink(msgspec.Struct, frozen=True, tag=True):
    """Store a typed link between two memories of one user (both directions are indexed),
    if both ends exist when the write transaction applies it and the pair holds no link of
    its type the other way; ``committed`` gets the ends it did not find (empty: written) or
    that other link."""

    user_id: str
    link: Any  # records.Link
    done: Any = None
    committed: Any = None

    lsn = None  # links are not searchable records: not part of the log


class PutNote(msgspec.Struct, frozen=True, tag=True):
    """Store a note, or a new version of one; the writer finds the version it replaces, which
    leaves the log and, through this op's log entry, the indexes."""

    lsn: int
    note: Any  # records.Note
    replaces: int  # -1: a new note (its id must be free); 1: an update (the note must exist)
    committed: Any = None  # gets (stored note, None, replaced lsn) or (None, why not, 0)
    keep: tuple[str, ...] = ()  # fields an update takes from the version it replaces


class DeleteNote(msgspec.Struct, frozen=True, tag=True):
    """Delete a note: its record, log entry and vector; a tombstone at ``lsn`` lists it.
    ``committed`` gets the deleted lsns (empty if there was no such note)."""

    lsn: int
    user_id: str
    note_id: str
    committed: Any = None


class WriteSummary(msgspec.Struct, frozen=True, tag=True):
    """Compare-and-set a session's summary: applied (with epoch ``expected_epoch + 1``) only if
    the stored epoch is still ``expected_epoch`` and every turn of ``made_of`` (the ids of the
    turns the new text was made from) is still held; ``committed`` gets True or False."""

    user_id: str
    session_id: str
    state: Any  # records.SummaryState, epoch already expected_epoch + 1
    expected_epoch: int
    done: Any = None
    committed: Any = None
    made_of: tuple[str, ...] = ()

    lsn = None  # not searchable: not part of the log


class PutEpisode(msgspec.Struct, frozen=True, tag=True):
    """Store an episode, log it (so both indexes take it) and link it to its turns.
    ``committed`` gets the stored episode, or None if its session was forgotten meanwhile."""

    lsn: int
    episode: Any  # records.Episode
    links: tuple[Any, ...]  # records.Link, written in both directions
    committed: Any = None


class PutFact(msgspec.Struct, frozen=True, tag=True):
    """Write a fact version and retire others, in one transaction.

    The Facts actor decides (one decision at a time per engine); the writer applies. Each
    retired version is rewritten with its new status and leaves the log and the vectors, so both
    indexes drop it; ``fact`` (if any) is logged as a new searchable record. ``committed`` gets
    the lsns that left the indexes, or None if the op was dropped (``requires``).

    Attributes:
        lsn: this op's log position (the new fact's, or a tombstone's when there is none).
        user_id: the tenant.
        fact: the new version, or None (a retraction or a prune).
        retired: versions to rewrite, already carrying their new status.
        links: links to write (fact -> its source turns and episodes).
    """

    lsn: int
    user_id: str
    fact: Any  # records.Fact | None
    retired: tuple[Any, ...]
    links: tuple[Any, ...] = ()
    committed: Any = None
    requires: int = 0  # applied only if this lsn's record (the source turn) is still logged


class Elsewhere(msgspec.Struct, frozen=True):
    """A merge's answer (:class:`PutState`): the value it was given points to the record
    under ``key`` of the same database, which it merges into instead."""

    key: bytes


class PutState(msgspec.Struct, frozen=True, tag=True):
    """Unlogged records of one user, written or deleted in one transaction: entities, review
    state, pending reviews, fact use counters, and the long-term follower's watermark.

    Attributes:
        puts: (database name, key, value or None to delete, guard lsn).
        links: (user id, link, guard lsn).
        merges: (database name, key, merge, guard lsn): ``merge(value)`` takes the value
            the key holds in the transaction (None: none) and gives the one to put (None:
            leave it), so a record another write changed since the caller read it is merged
            with, not written over; or :class:`Elsewhere`: the value points to another key
            (an entity's alias), whose value it is given and merges into instead, one hop.
            Runs in the writer's thread, perhaps more than once (a batch written again):
            quick and pure. A damaged value there is left as it is.

    A put, link or merge with a guard lsn other than 0 is skipped if that lsn's record has
    left the log (deleted while this was derived from it), so that nothing of a forgotten
    session or user comes back.
    """

    puts: tuple[tuple[bytes, bytes, bytes | None, int], ...]
    links: tuple[tuple[str, Any, int], ...] = ()
    done: Any = None  # set once committed (write_unlogged waits on it); None: nobody waits
    merges: tuple[tuple[bytes, bytes, Any, int], ...] = ()
    # Called once committed with (the indexes of the links written, those of the merges that
    # put a value): a link the pair holds the other way, or whose end is gone, is not.
    committed: Any = None

    lsn = None  # not searchable: not part of the log


class Searchable(msgspec.Struct, frozen=True):
    """What the indexes need of a logged record, read back from the store in log order."""

    lsn: int
    kind: str
    user_id: str
    session_id: str
    role: str
    at: datetime
    text: str
    tags: tuple[str, ...] = ()
    memory_id: str = ""
    seq: int = -1  # a turn's position in its session
    attrs: dict[str, Any] = {}  # what a recall filter sees of it (``where.attributes``)


class EmbedRequest(msgspec.Struct, frozen=True, tag=True):
    """Embed ``texts``; the model thread calls ``reply`` with an ``outcome`` of the vectors.

    Attributes:
        texts: what to embed.
        query: a caller is waiting on the hot path: served before background work.
        reply: the one-shot answer; hands the outcome to the waiting trio task.
    """

    texts: tuple[str, ...]
    query: bool
    reply: Any


@dataclass(frozen=True)
class Candidate:
    """A fact proposed by an extractor or a caller, before the Facts actor's rules run: what
    the extractors (actors.extraction, an LLM's) and the facade hand the Facts actor. A plain
    dataclass rather than a Struct: it is public (``engine.Candidate``), built by users'
    extractors, and never crosses a channel.

    Attributes:
        category: ``identity``, ``preference``, ``constraint``, ``instruction``,
            ``relationship``, ``pet``, ``schedule``, or an extractor's own.
        key: what it is about within the category (``location``, ``likes:jazz``,
            ``sister:ana``); one value is active per (category, key).
        value: the value (``Lisbon``, ``likes``, ``Ana``).
        text: the fact as one sentence, what prompts show and the indexes search.
        confidence / importance: 0-1; below ``MIN_CONFIDENCE`` / ``MIN_IMPORTANCE`` it is
            dropped.
        keywords: extra search words.
    """

    category: str
    key: str
    value: str
    text: str
    confidence: float
    importance: float
    keywords: tuple[str, ...] = ()


StoreOp = (AppendTurn | AppendTurns | Forget | ScrubDone | PutVectors | PutLink | PutNote
           | DeleteNote | WriteSummary | PutEpisode | PutFact | PutState)
EmbedderOp = EmbedRequest
