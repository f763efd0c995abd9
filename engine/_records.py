"""Persisted records and the public value types built on them.

Persisted records are msgspec Structs encoded as msgpack arrays (``array_like``): compact and
fast. Schema evolution rules (msgspec docs, schema-evolution): a new field goes at the end with a
default, and the annotation of a persisted field never changes. ``SCHEMA_VERSION`` counts changes
that need a migration (see ``actors.store.MIGRATIONS``).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

import msgspec

__all__ = ["Turn", "SessionInfo", "NewTurn", "Link", "Note", "SummaryState", "Role", "ROLES",
           "SCHEMA_VERSION"]

SCHEMA_VERSION = 2  # 2: vectors stored as float16 (actors.store migrates 1 -> 2)

Role = Literal["user", "assistant", "system", "tool"]
ROLES: tuple[str, ...] = ("user", "assistant", "system", "tool")


class Turn(msgspec.Struct, frozen=True, array_like=True):
    """One conversation turn as stored.

    Attributes:
        lsn: the store's global log sequence number of this turn (first, so that deletion can
            read it without decoding the rest).
        turn_id: unique id of the turn.
        user_id: the tenant the turn belongs to.
        session_id: the session within that user.
        seq: position in the session, from 0, without gaps.
        role: user, assistant, system or tool.
        text: what was said.
        at: when it was said, timezone-aware (stored and returned as UTC).
        meta: the caller's JSON-serialisable extras.
    """

    lsn: int
    turn_id: str
    user_id: str
    session_id: str
    seq: int
    role: Role
    text: str
    at: datetime
    meta: dict[str, Any] = {}


class SessionInfo(msgspec.Struct, frozen=True, array_like=True):
    """A session's summary, as stored and as ``list_sessions`` returns it.

    Attributes:
        user_id: the tenant.
        session_id: the session.
        started_at: time of its first turn.
        last_at: time of its latest turn (by seq).
        turn_count: number of turns (the next seq).
    """

    user_id: str
    session_id: str
    started_at: datetime
    last_at: datetime
    turn_count: int


class NewTurn(msgspec.Struct, frozen=True, kw_only=True):
    """A turn to ingest with ``Engine.add_turns``; the fields mean what ``add_turn``'s do."""

    user_id: str
    session_id: str
    role: str
    text: str
    at: datetime | None = None
    meta: dict[str, Any] | None = None


class Link(msgspec.Struct, frozen=True, array_like=True):
    """A typed link between two memories of one user, as stored and as returned.

    Attributes:
        from_id: the memory it starts at (a turn id, later also episode, fact or note ids).
        to_id: the memory it points to.
        type: what the link means, e.g. ``relates_to``, ``follows``, ``summarises``.
        at: when it was made.
    """

    from_id: str
    to_id: str
    type: str
    at: datetime


class Note(msgspec.Struct, frozen=True, array_like=True):
    """A note a bot or its model keeps about a user (seed 003), searchable like other memories.

    Attributes:
        lsn: log position of this version (an update gives the note a new one).
        note_id: the note's id, kept across updates.
        user_id: the tenant.
        text: the note.
        tags: the caller's tags (the recall ``tags`` filter sees them).
        created_at: when the note was first stored.
        updated_at: when this version was stored.
    """

    lsn: int
    note_id: str
    user_id: str
    text: str
    tags: tuple[str, ...]
    created_at: datetime
    updated_at: datetime


class SummaryState(msgspec.Struct, frozen=True, array_like=True):
    """A session's rolling summary (seed 003), written with optimistic concurrency.

    Attributes:
        epoch: bumped by every write; a writer must name the epoch it read.
        summary: the summary text.
        upper_seq: the summary covers the session's turns with seq below this.
        updated_at: when it was written.
    """

    epoch: int
    summary: str
    upper_seq: int
    updated_at: datetime
