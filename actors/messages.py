"""The messages actors exchange: frozen, tagged Structs, one union per actor.

Persisted records live in ``engine._records``; nothing here is ever written to disk as is.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import msgspec

from engine._records import Turn

__all__ = ["AppendTurn", "Forget", "PutVectors", "PutLink", "PutNote", "DeleteNote", "WriteSummary",
           "Searchable",
           "EmbedRequest",
           "StoreOp", "EmbedderOp"]


class AppendTurn(msgspec.Struct, frozen=True, tag=True):
    """Write one turn. ``key`` and ``value`` are encoded on the trio thread at ingest, so the
    writer thread holds the GIL only for LMDB's own C loop.

    Attributes:
        turn: the record (its ``lsn`` orders the log).
        key: the turn's key in the ``turns`` database.
        value: the turn encoded as msgpack.
        started_at: the session's first turn time, for its SessionInfo.
        id_key: the turn's key in the ``ids`` database.
    """

    turn: Turn
    key: bytes
    value: bytes
    started_at: datetime
    id_key: bytes

    @property
    def lsn(self) -> int:
        return self.turn.lsn


class Forget(msgspec.Struct, frozen=True, tag=True):
    """Delete a whole session (``session_id`` set) or a whole user (``session_id`` None), and log
    a tombstone at ``lsn`` that lists the deleted log sequence numbers and nothing of the user.

    ``committed`` (optional) is called on the trio thread right after the commit, in commit
    order, with the deleted lsns."""

    lsn: int
    user_id: str
    session_id: str | None
    committed: Any = None


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
    """

    items: list[tuple[int, str, bytes]]
    watermark: int
    done: Any = None
    committed: Any = None

    lsn = None  # not part of the log


class PutLink(msgspec.Struct, frozen=True, tag=True):
    """Store a typed link between two memories of one user (both directions are indexed)."""

    user_id: str
    link: Any  # engine._records.Link
    done: Any = None
    committed: Any = None

    lsn = None  # links are not searchable records: not part of the log


class PutNote(msgspec.Struct, frozen=True, tag=True):
    """Store a note, or a new version of one; the writer finds the version it replaces, which
    leaves the log and, through this op's log entry, the indexes."""

    lsn: int
    note: Any  # engine._records.Note
    replaces: int  # -1: a new note (its id must be free); 1: an update (the note must exist)
    committed: Any = None  # gets (stored note, None, replaced lsn) or (None, why not, 0)


class DeleteNote(msgspec.Struct, frozen=True, tag=True):
    """Delete a note: its record, log entry and vector; a tombstone at ``lsn`` lists it.
    ``committed`` gets the deleted lsns (empty if there was no such note)."""

    lsn: int
    user_id: str
    note_id: str
    committed: Any = None


class WriteSummary(msgspec.Struct, frozen=True, tag=True):
    """Compare-and-set a session's summary: applied (with epoch ``expected_epoch + 1``) only if
    the stored epoch is still ``expected_epoch``; ``committed`` gets True or False."""

    user_id: str
    session_id: str
    state: Any  # engine._records.SummaryState, epoch already expected_epoch + 1
    expected_epoch: int
    done: Any = None
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


StoreOp = (AppendTurn | Forget | PutVectors | PutLink | PutNote | DeleteNote
           | WriteSummary)
EmbedderOp = EmbedRequest
