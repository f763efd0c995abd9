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

__all__ = ["Turn", "SessionInfo", "NewTurn", "Link", "Note", "SummaryState", "Episode", "Fact",
           "Entity", "ReviewState", "PendingReview", "Failure", "Role", "ROLES",
           "SCHEMA_VERSION"]

# 2: vectors stored as float16 (actors.store migrates 1 -> 2).
# 3: episodes, facts, entities and review state (new databases: an older build must refuse).
# 4: notes and facts that the writer left without vectors are listed for embedding.
# 5: every value carries a CRC-32; the log a hash chain (actors.store migrates 4 -> 5).
# 6: every value's CRC-32 takes in its key (actors.store migrates 5 -> 6).
SCHEMA_VERSION = 6

Role = Literal["user", "assistant", "system", "tool"]
ROLES: tuple[str, ...] = ("user", "assistant", "system", "tool")


class Turn(msgspec.Struct, frozen=True, array_like=True, gc=False):
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
        meta: the caller's JSON-serialisable extras (read-only, like the record: the turns
            of one ``add_turns`` call without meta share one empty dict).
        agent_id / run_id: its scope below the user (mem0's), its session's; "" for none.

    Not tracked by the garbage collector (``gc=False``): it refers to nothing that could refer
    back to it (meta is checked JSON), and an import makes one per turn.
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
    agent_id: str = ""
    run_id: str = ""


class SessionInfo(msgspec.Struct, frozen=True, array_like=True):
    """A session's summary, as stored and as ``list_sessions`` returns it.

    Attributes:
        user_id: the tenant.
        session_id: the session.
        started_at: the earliest time of its turns (a turn may be back-dated: not always
            its first turn's).
        last_at: the latest time of its turns (not always its last turn's).
        turn_count: number of turns (the next seq).
        agent_id / run_id: the scope every turn of the session has (its first turn's).
    """

    user_id: str
    session_id: str
    started_at: datetime
    last_at: datetime
    turn_count: int
    agent_id: str = ""
    run_id: str = ""


class NewTurn(msgspec.Struct, frozen=True, kw_only=True):
    """A turn to ingest with ``Engine.add_turns``; the fields mean what ``add_turn``'s do."""

    user_id: str
    session_id: str
    role: str
    text: str
    at: datetime | None = None
    meta: dict[str, Any] | None = None
    agent_id: str | None = None
    run_id: str | None = None


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
        importance: 0-1 (seed 000's; recall's ``min_importance`` filters by it, never ranks).
        emotion: a free label, lower-case (seed 000's emotion: ``joy``, ``curiosity``, or a
            valence such as ``positive``); "" for none.
        category: the note's category (seed 000's, like a fact's: ``travel``); "" for none.
        agent_id / run_id: its scope below the user (mem0's); "" for none.
    """

    lsn: int
    note_id: str
    user_id: str
    text: str
    tags: tuple[str, ...]
    created_at: datetime
    updated_at: datetime
    importance: float = 0.5
    emotion: str = ""
    category: str = ""
    agent_id: str = ""
    run_id: str = ""


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


class Episode(msgspec.Struct, frozen=True, array_like=True):
    """A stretch of a session compressed into one memory (seed 001's episodic fields).

    Attributes:
        lsn: log position (first, like every logged record).
        episode_id: unique id (``e_...``).
        user_id / session_id: where it comes from.
        first_seq / last_seq: the session's turns it covers, inclusive.
        turn_ids: those turns' ids, in order.
        title / summary / keywords: what it is about (extractive, or from the LLM).
        start_at / end_at: times of its first and last turn.
        surprise: novelty against the user's earlier episodes at creation, 0-1.
        stability / difficulty: FSRS state at creation (reviews live in ``ReviewState``).
        created_at: when it was made; consolidated_at: when its session was consolidated
            (None while the session was still running).
    """

    lsn: int
    episode_id: str
    user_id: str
    session_id: str
    first_seq: int
    last_seq: int
    turn_ids: tuple[str, ...]
    title: str
    summary: str
    keywords: tuple[str, ...]
    start_at: datetime
    end_at: datetime
    surprise: float
    stability: float
    difficulty: float
    created_at: datetime
    consolidated_at: datetime | None = None


class Fact(msgspec.Struct, frozen=True, array_like=True):
    """A structured fact about a user, keyed (user, category, key); one version of it.

    Bi-temporal: ``valid_at`` / ``invalid_at`` say when it was true in the world,
    ``created_at`` / ``expired_at`` when we learned it and when we retired it.

    Attributes:
        lsn: log position of this version.
        fact_id: unique id of this version (``f_...``).
        user_id / category / key: what it is about (e.g. ``identity`` / ``location``).
        value: the value (``Lisbon``).
        text: the fact as a sentence, what the indexes see and prompts show.
        confidence / importance: 0-1.
        keywords: search keywords.
        source_turn_ids / source_episode_ids: provenance.
        session_id: the session it was extracted from ("" if stated through the API).
        valid_at / invalid_at / created_at / expired_at: see above.
        status: ``active``, ``superseded`` (a newer value replaced it), ``pruned`` (decayed
            away) or ``retracted`` (forget_fact).
        protected: confirmed by the user: never decays.
        origin: ``rules``, ``llm`` or ``api``.
        access_count / last_access_at: uses (shown in a prompt, restated); decay counts from
            the last one.
    """

    lsn: int
    fact_id: str
    user_id: str
    category: str
    key: str
    value: str
    text: str
    confidence: float
    importance: float
    keywords: tuple[str, ...]
    source_turn_ids: tuple[str, ...]
    source_episode_ids: tuple[str, ...]
    session_id: str
    valid_at: datetime
    invalid_at: datetime | None
    created_at: datetime
    expired_at: datetime | None
    status: str = "active"
    protected: bool = False
    origin: str = "api"
    access_count: int = 0
    last_access_at: datetime | None = None


class Entity(msgspec.Struct, frozen=True, array_like=True):
    """A named thing a user's memories mention, with the memories that do (by lsn, newest last).

    Attributes:
        name: its canonical name (the first spelling seen).
        type: person, place, organisation, email, url, hashtag, mention, date or other.
        aliases: other spellings seen (lower-case forms match too).
        mentions: how many times it was mentioned.
        first_seen / last_seen: when.
        lsns: the memories mentioning it, at most ``actors.entities.MEMORIES_PER_ENTITY``.
        last_id: the id of the latest memory mentioning it (the next one links to it).
    """

    name: str
    type: str
    aliases: tuple[str, ...]
    mentions: int
    first_seen: datetime
    last_seen: datetime
    lsns: tuple[int, ...]
    last_id: str = ""


class ReviewState(msgspec.Struct, frozen=True, array_like=True):
    """A memory's FSRS state after its reviews (an episode starts from its own fields).

    Attributes:
        stability / difficulty: FSRS state.
        last_review: when it was last reviewed.
        reps: reviews so far.
    """

    stability: float
    difficulty: float
    last_review: datetime
    reps: int


class PendingReview(msgspec.Struct, frozen=True, array_like=True):
    """What a ``retrieve_memory`` call showed, waiting to be rated (seed 001).

    Attributes:
        memory_ids: the episodic memories shown.
        texts: their summaries, for the offline rater.
        query: the query that found them.
        shown_at: when.
    """

    memory_ids: tuple[str, ...]
    texts: tuple[str, ...]
    query: str
    shown_at: datetime


class Failure(msgspec.Struct, frozen=True, array_like=True):
    """A record one part of the engine could not take, kept so that it is seen, not lost: the
    part went on without it. Deleted with its user (``forget_user``) or its session.

    Attributes:
        lsn: the record's log sequence number (0: a write outside the log).
        actor: the part that failed: ``store`` (the write was refused), ``fulltext``,
            ``embedder``, or a long-term follower (``entities``, ``facts``, ``episodic``).
        user_id: the record's user ("" if not known).
        memory_id: the record's id ("" if not known).
        error: what went wrong.
        at: when it was recorded.
    """

    lsn: int
    actor: str
    user_id: str
    memory_id: str
    error: str
    at: datetime
