"""What the engine's concerns share: its running actors, its settings, and whether it still
serves calls. The wiring (``_wiring.py``) builds one once every actor has started; each concern
module (ingest, recall, memory, links, forgetting, stats, snapshots, maintenance) is given it
and sends its requests to the actors through it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from pathlib import Path
from typing import Any

from actors.ann_index import AnnIndex
from actors.base import validate as v
from actors.base.config import Config
from actors.base.errors import ClockFailed, EngineClosed
from actors.embedder import Embedder
from actors.entities import Entities
from actors.episodic import EpisodicCompressor
from actors.facts import Facts
from actors.fulltext import FullText
from actors.imported import Imported
from actors.session_buffer import SessionBuffer
from actors.store import LogFollower, Store

from ._notes_md import NotesMirror

__all__ = ["Clock", "Parts", "pinnable", "pinnable_ids", "pinned"]

Clock = Callable[[], datetime]


class _Pin:
    """What a replayed log entry fixes while it applies: its writer's time (None: the
    clock's), and the seed of the ids its apply makes, with how many it made so far."""

    __slots__ = ("at", "seed", "made")

    def __init__(self, at: datetime | None, seed: str) -> None:
        self.at, self.seed, self.made = at, seed, 0


# Set in the task that applies a log entry (and seen in what that task awaits): the engine's
# clock reads the entry's time and its id makers derive ids from the entry's place in the log,
# so every node that applies the entry makes the same records (a fact's id and times, a
# note's times, a review's, an episode's times; an episode's id is its turns', see
# actors.store.read_derived_id).
_pinned: ContextVar[_Pin | None] = ContextVar("engram_pinned_entry", default=None)


def pinnable(clock: Clock) -> Clock:
    """The engine's clock: ``clock``, or the time :func:`pinned` holds for this task. A
    reading is held to the range every stored time keeps (InvalidInput ``clock``): the actors
    stamp records with it, and a clock that left the range after open must not reach the
    store (what a follower then fails on is kept as a failure, and nothing is written)."""

    def now() -> datetime:
        pin = _pinned.get()
        if pin is not None and pin.at is not None:
            return pin.at
        return v.check_at(read_clock(clock), "clock")

    return now


def read_clock(clock: Clock) -> datetime:
    """One reading of the clock given at open.

    Raises:
        ClockFailed: the clock raised.
    """
    try:
        return clock()
    except Exception as exc:
        raise ClockFailed("clock", f"expected the clock given at open to read the time, "
                                   f"found it raised {exc!r}") from exc


def pinnable_ids(make: Callable[[], str]) -> Callable[[], str]:
    """An id maker: ``make``, or, while :func:`pinned` holds an entry for this task, ids
    drawn from its seed (20 hex digits, as ``make``'s), the n-th the same on every node."""

    def new_id() -> str:
        pin = _pinned.get()
        if pin is None:
            return make()
        pin.made += 1
        return hashlib.blake2b(f"{pin.seed}:{pin.made}".encode(), digest_size=10).hexdigest()

    return new_id


@contextmanager
def pinned(at: datetime | None, seed: str) -> Iterator[None]:
    """Apply a log entry in this task until the block ends: the engine's clock reads ``at``
    (None: the clock itself) and new ids derive from ``seed`` (the entry's place in the
    log). Other tasks keep the clock and random ids; the followers hash the ids of what
    they derive from what it stands for, the same on every node."""
    token = _pinned.set(_Pin(at, seed))
    try:
        yield
    finally:
        _pinned.reset(token)


class Parts:
    """The actors of one running engine and the state its concerns share.

    Attributes:
        store / buffer / embedder / ann / fulltext / facts / compressor / entities: the
            actors (see DESIGN.md's map); each owns its state, the concerns only send to them.
        followers: the long-term layer's log followers, when it runs.
        imported: log positions of imported records, which the followers do not derive from.
        tasks: the LLM's prompts (``ModelTasks``) when ``Engine.open`` got an ``llm``.
        notes_md: the notes' Markdown mirror (``Config.notes_markdown_dir``), if any.
        config / clock: the engine's settings and clock (:func:`pinnable`: a replayed log
            call reads its writer's time there).
        turn_clock: the same clock unwrapped, for the time of a turn given none: no logged
            call adds a turn (a log's turns carry their time), so the ingest path skips the
            pin's lookup.
        read_only: opened with ``read_only=True``: every write is refused.
        open_lsn: what the store held at open (a leg whose index lacks it is degraded).
        closed: set when the engine begins to close; every later call raises EngineClosed.
        forgets: forget_session / forget_user calls so far (a retrieval that raced one does
            not record what it showed).
        forgetting: forget_session calls under way, from their first read to their queued
            op (a reflection pass writes no note meanwhile).
    """

    def __init__(self, store: Store, buffer: SessionBuffer, embedder: Embedder, ann: AnnIndex,
                 fulltext: FullText, facts: Facts, compressor: EpisodicCompressor,
                 entities: Entities, config: Config, clock: Clock,
                 imported: Imported | None = None, tasks: Any = None,
                 turn_clock: Clock | None = None) -> None:
        self.store = store
        self.buffer = buffer
        self.embedder = embedder
        self.ann = ann
        self.fulltext = fulltext
        self.facts = facts
        self.compressor = compressor
        self.entities = entities
        self.followers: list[LogFollower] = []
        self.imported = imported if imported is not None else Imported()
        self.tasks = tasks  # the LLM's tasks (engine._llm.ModelTasks), when one was given
        # What flush waits for besides the followers and the indexes (background work that
        # follows them, e.g. the reflection a session switch asks for).
        self.settling: list[Callable[[], Awaitable[None]]] = []
        self.notes_md = (NotesMirror(Path(config.notes_markdown_dir), store.store_id)
                         if config.notes_markdown_dir is not None and not store.read_only
                         else None)
        self.config = config
        self.clock = clock
        self.turn_clock = turn_clock or clock
        self.read_only = store.read_only
        self.open_lsn = store.committed_lsn
        self.closed = False
        self.forgets = 0
        self.forgetting = 0

    def time_by_log(self) -> None:
        """Have the long-term followers time what they derive by the log, not by the clock:
        an episode or a rating at the logged turn that made it due, an extracted fact at
        its turn's time. Set for good once the engine applies a cluster's log (or opens a
        store that did), before its followers see a turn of it: every node then derives
        the same times and decisions, however much later it replays the log."""
        self.compressor.timed_by_log = self.facts.timed_by_log = True

    def check_open(self) -> None:
        """Raise EngineClosed if the caller closed the engine, the store's own error if it
        broke underneath."""
        if self.closed:
            raise EngineClosed("the engine is closed; open a new one with Engine.open(path)")
        self.store.check_usable()

    def check_ids(self, user_id: Any, session_id: Any = None) -> None:
        v.check_id("user_id", user_id, self.config.max_id_chars)
        if session_id is not None:
            v.check_id("session_id", session_id, self.config.max_id_chars)

    def check_session(self, user_id: Any, session_id: Any, lookup: bool = False) -> None:
        """:meth:`check_ids` (``lookup``: :meth:`check_lookup_ids`) for a call that names one
        session: None is refused there, not read as "no session given"."""
        v.check_id("user_id", user_id, self.config.max_id_chars, lookup=lookup)
        v.check_id("session_id", session_id, self.config.max_id_chars, lookup=lookup)

    def check_id(self, field: str, value: Any) -> str:
        return v.check_id(field, value, self.config.max_id_chars)

    def check_lookup_ids(self, user_id: Any, session_id: Any = None) -> None:
        """:meth:`check_ids` for a call that only reads or forgets: ids of the length stores
        written before the byte limit may hold are accepted (never on a write)."""
        v.check_id("user_id", user_id, self.config.max_id_chars, lookup=True)
        if session_id is not None:
            v.check_id("session_id", session_id, self.config.max_id_chars, lookup=True)

    def check_lookup_id(self, field: str, value: Any) -> str:
        return v.check_id(field, value, self.config.max_id_chars, lookup=True)

    def check_text(self, field: str, value: Any) -> str:
        return v.check_text(field, value, self.config.max_text_chars)

    def now(self) -> datetime:
        """The engine clock's time, checked as a caller's ``at`` would be: the clock is the
        caller's too, and a time the text index cannot hold must not reach the store."""
        return v.check_at(self.clock(), "clock")

    def turn_now(self) -> datetime:
        """:meth:`now` for a turn given no time (:attr:`turn_clock`)."""
        return v.check_at(read_clock(self.turn_clock), "clock")

    async def committed(self) -> None:
        """Wait until everything logged before the call is on disk: a read by id finds it
        then (indexes and vectors are not needed)."""
        await self.store.wait_logged()

    def degraded(self, masked: bool = False) -> tuple[str, ...]:
        """The search legs whose index lacks records the store held when the engine opened:
        a rebuild or a long catch-up is under way (the normal lag of new records is not this;
        the window leg covers it). ``masked``: the query filters by tags or ``where``, whose
        mask of the vector and entity legs the text index gives, so a text index catching up
        degrades those legs too."""
        legs: tuple[str, ...] = ()
        text_behind = self.fulltext.catching_up
        if text_behind:
            legs += ("bm25",)
        if (max(self.embedder.embedded_lsn, self.store.embedded_lsn) < self.open_lsn
                or (masked and text_behind)):
            legs += ("vector",)
        if masked and text_behind:
            legs += ("entity",)
        return legs
