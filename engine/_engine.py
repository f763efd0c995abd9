"""The Engine facade: the lifecycle, and one method per public call that checks the engine is
open and hands the call to the module that owns its concern. Nothing here touches a channel.

Where each call goes (one module per concern, named for it):

- ``_wiring.py``: open's arguments checked and its model chosen; the actors started in order,
  stopped in reverse; failures as one error;
- ``_ingest.py``: ``add_turn(s)``, the history reads, ``flush``;
- ``_recall.py``: ``recall``, ``retrieve_memory(_raw)``, ``context_pre_retrieve`` (the pipeline
  is ``_retrieval.py``, seed 001's sections ``_briefing.py``, the result types ``_hits.py``);
- ``_memory.py``: facts, notes, session summaries, episodes, reviews, entities;
- ``_links.py``: ``link`` and ``links``;
- ``_forget.py``: ``forget_session`` / ``forget_user`` and the scrub that follows them;
- ``_logbatch.py``: ``apply_log_batch``, a cluster's replicated log applied (engine.cluster);
- ``_snapshot.py``: snapshot, restore, compact; ``_verify.py``: verify;
- ``_stats.py``: ``stats``, ``failures``, ``memory_stats``;
- ``_maintenance.py`` and ``_tools.py``: the periodic passes and seed 004's agent tools.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

import numpy as np
import trio

from actors.base.config import Config
from actors.base.errors import InvalidInput
from actors.base.records import (
    Entity,
    Episode,
    Fact,
    Failure,
    Link,
    NewTurn,
    Note,
    ReviewState,
    SessionInfo,
    SummaryState,
    Turn,
)
from actors.base.validate import check_at, check_flag
from actors.embedder import EmbeddingBackend
from actors.extraction import Extractor
from actors.session_buffer import Receipt

from . import _browse, _stats
from ._args import check_count, check_texts
from ._briefing import Briefing
from ._context import context_for_prompt
from ._export import (
    UserRecords,
    UserVectors,
    VectorRows,
    export_records,
    export_user,
    export_vectors,
    import_user,
    import_users,
    restore_users,
)
from ._forget import Forgetting
from ._hits import Hits, RetrieveResult
from ._ingest import Ingest
from ._links import Links
from ._llm import LLM
from ._logbatch import PartitionLog
from ._maintenance import Maintenance, MaintenanceReport
from ._memory import EntityInfo, Memory
from ._owner import OwnerLock, claim_in_process, release_in_process
from ._parts import Clock, read_clock
from ._recall import Recall
from ._retrieval import Retriever
from ._snapshot import Manifest, compact, restore, take_snapshot
from ._stats import Stats
from ._tools import call_tool
from ._verify import verify_store
from ._wiring import Running, checked_open, embedding_for, running

__all__ = ["Engine"]


def _utc_now() -> datetime:
    return datetime.now(timezone.utc)


def _path_arg(field: str, value: Any) -> Path:
    """A path argument of a store command, refused before ``os.fspath`` raises TypeError."""
    if not isinstance(value, (str, os.PathLike)):
        raise InvalidInput(field, f"expected a directory path, found {type(value).__name__}")
    return Path(value)


def _key_arg(key: Any) -> str | None:
    """An ``integrity_key`` argument: a string or None (the key's rules are Config's)."""
    if key is not None and not isinstance(key, str):
        raise InvalidInput("integrity_key", f"expected a string or None, found "
                                            f"{type(key).__name__}")
    return key


def _checked_clock(clock: Any) -> Clock:
    """``clock``, once one reading shows it gives timezone-aware datetimes: every time the
    engine compares is aware, and a naive clock failed only later, inside recall."""
    if not callable(clock):
        raise InvalidInput("clock", f"expected a callable returning a timezone-aware datetime, "
                                    f"found {type(clock).__name__} {clock!r}"[:200])
    now = read_clock(clock)
    if not isinstance(now, datetime) or now.utcoffset() is None:
        found = (f"datetime {now.isoformat()} with no timezone" if isinstance(now, datetime)
                 else f"{type(now).__name__} {now!r}"[:80])
        raise InvalidInput("clock", f"expected a callable returning a timezone-aware "
                                    f"datetime, found {found}")
    if type(now) is not datetime:
        # Stored records encode datetime itself: a subclass's reading failed every add_turn
        # given no time.
        raise InvalidInput("clock", f"expected a callable returning datetime itself, found "
                                    f"{type(now).__name__} (a subclass: pendulum's, pandas'); "
                                    "wrap it: lambda: datetime.fromtimestamp(clock().timestamp(), "
                                    "timezone.utc)")
    check_at(now, "clock")  # a time the text index can hold, as every stored time must be
    return clock


class Engine:
    """An open memory engine. Get one with ``async with Engine.open(path) as mem``."""

    def __init__(self, run: Running) -> None:
        parts = self._parts = run.parts
        # The actors, by name: the lifecycle owns them (and tests and benches look at them).
        self._store, self._buffer, self._embedder = parts.store, parts.buffer, parts.embedder
        self._ann, self._fulltext = parts.ann, parts.fulltext
        self._facts, self._compressor = parts.facts, parts.compressor
        self._followers = parts.followers
        self._retriever = Retriever(parts.store, parts.buffer, parts.embedder, parts.ann,
                                    parts.fulltext, parts.facts, parts.entities, parts.clock)
        self._briefing = Briefing(self._retriever)
        # One service per concern; each method below hands its call to one of them.
        self._ingest = Ingest(parts, run.scrubber)
        self._recall = Recall(parts, self._retriever, self._briefing)
        self._memory = Memory(parts, run.scrubber)
        self._links = Links(parts)
        self._forgetting = Forgetting(parts, run.scrubber)
        self._scrubbed = run.scrubber.wait  # a snapshot of a scrubbed store copies faster
        self._partition_log = PartitionLog(parts, self._forgetting, self._logged_call)
        self._maintenance = Maintenance(parts, self._memory)

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        path: str | os.PathLike[str],
        *,
        config: Config | Mapping[str, Any] | None = None,
        clock: Clock | None = None,
        embedder: EmbeddingBackend | None = None,
        reembed: bool = False,
        llm: LLM | None = None,
        read_only: bool = False,
        extractor: Extractor | None = None,
    ) -> AsyncIterator[Engine]:
        """Open (or create) the store at ``path`` and run the engine for the ``async with`` body.

        The engine owns the store while it runs: a second ``Engine.open`` of it, from this
        process or another, raises :class:`StoreInUse` naming the owner's pid. With
        ``read_only=True`` it owns nothing and may read a store another process serves.

        Args:
            path: a directory; created if missing.
            config: a :class:`Config`, a dict of overrides, or None for the defaults.
            clock: returns the current timezone-aware time; stamps turns given no ``at``.
            embedder: the embedding backend (default: the ONNX model ``config.model``, or the
                one the store was made with, or for a new store the variant the model's
                build measured as the faster here); tests that are not about embeddings pass
                a ``HashEmbedder``.
            reembed: embed everything again with the configured model, in the background:
                the store's vectors are dropped, whether another model made them or this one.
            llm: an optional language model (:class:`LLM`, e.g. :class:`OpenAICompatibleLLM`)
                that summarises episodes and extracts facts in the background; without one
                the offline defaults do (extractive summaries, rules).
            extractor: what extracts facts from user turns in the background (an
                :class:`Extractor`: spaCy, your own prompt, a service); default: the
                ``llm``'s prompt if one is given, else the offline rules. The rules stand in
                for a turn it fails on.
            read_only: read an existing store without owning it (another process may be
                serving it): no lock is taken, nothing runs in the background, every write
                raises ``InvalidInput`` (field ``read_only``), and the text index is searched
                as its owner last committed it. Counts are those at open.

        Raises:
            InvalidInput: bad path or config.
            StoreInUse: another engine owns the store (not raised with ``read_only``, unless
                this process has it open already).
            StoreIncompatible: the store was written by a newer schema.
            ModelMismatch: the store's vectors come from another model (and not ``reembed``).
            ModelMissing: the model files are not built.
            StoreCorrupt: a record fails its checksum, or data.mdb is cut short.
            StoreTampered: the hash chain's tail or head (its MAC, with ``integrity_key``) does
                not match the store: it was edited outside the engine.
            EngineBroken: an actor failed while the engine ran (``__cause__`` has the group).
        """
        config, tasks, extractor = checked_open(path, config, llm, extractor, read_only,
                                                reembed)
        clock = _checked_clock(clock) if clock is not None else _utc_now
        root = Path(path)
        embedding = await embedding_for(root, config, embedder, reembed)
        owner = None if read_only else OwnerLock(root, "serving").acquire()
        try:
            claim = claim_in_process(root, "read-only" if read_only else "serving")
        except BaseException:
            if owner is not None:
                owner.release()
            raise
        try:
            async with running(root, config, clock, embedding, reembed, tasks, extractor,
                               read_only) as run:
                engine = cls(run)
                if config.long_term:
                    await run.start_background(engine._maintenance.run,
                                               config.maintenance_seconds)
                    if config.consolidate_on_new_session:
                        await run.start_background(engine._maintenance.follow_switches)
                yield engine
        finally:
            release_in_process(claim)
            if owner is not None:
                owner.release()

    # -- ingest ------------------------------------------------------------------------------

    async def add_turn(
        self,
        user_id: str,
        session_id: str,
        role: str,
        text: str,
        at: datetime | None = None,
        meta: dict[str, Any] | None = None,
        durable: bool = False,
        *,
        agent_id: str | None = None,
        run_id: str | None = None,
    ) -> Receipt:
        """Add one turn to a session; return once it is in the short-term window.

        Args:
            user_id: the tenant; a non-empty string.
            session_id: the session within the user; a non-empty string.
            role: ``user``, ``assistant``, ``system`` or ``tool``.
            text: what was said; non-empty, at most ``Config.max_text_chars``.
            at: when; timezone-aware. Default: the engine clock.
            meta: a JSON-serialisable dict kept with the turn.
            durable: also wait until the turn is committed to disk.
            agent_id / run_id: the session's scope below the user (mem0's), set by its first
                turn; a later turn may leave them out, and naming another is refused.
                recall filters by them; ``forget_scope`` forgets one.

        Returns:
            A :class:`Receipt` with ``turn_id``, ``seq`` and ``await durable()``.

        Raises:
            InvalidInput: a bad argument; nothing was written.
            EngineClosed: the engine is closed.
        """
        check_open = self._parts.check_open
        check_open()
        await trio.lowlevel.checkpoint_if_cancelled()
        at, meta = self._ingest.check_turn(user_id, session_id, role, text, at, meta)
        if durable is not False and durable is not True:  # the hot path: no call for a bool
            check_flag("durable", durable)
        await self._store.reserve(1)  # backpressure: the disk's queue has room
        check_open()
        if agent_id is None and run_id is None:  # the hot path: as it was before scopes
            receipt = self._buffer.append(user_id, session_id, role, text, at, meta)
        else:  # checked with the append, no await between: the session cannot change
            self._ingest.check_scope(user_id, session_id, agent_id, run_id)
            receipt = self._buffer.append(user_id, session_id, role, text, at, meta, None,
                                          agent_id, run_id)
        if durable:
            await receipt.durable()
        return receipt

    def add_turn_nowait(
        self,
        user_id: str,
        session_id: str,
        role: str,
        text: str,
        at: datetime | None = None,
        meta: dict[str, Any] | None = None,
        *,
        agent_id: str | None = None,
        run_id: str | None = None,
    ) -> Receipt:
        """:meth:`add_turn` without waiting: synchronous, for hot paths and for callers outside
        a trio task (the asyncio facade calls it straight from the asyncio loop).

        Returns:
            A :class:`Receipt`, as :meth:`add_turn`'s.

        Raises:
            trio.WouldBlock: the store's queue is full (the disk is far behind); nothing was
                written; ``await add_turn(...)`` waits for room instead.
            InvalidInput / EngineClosed: as :meth:`add_turn`.
        """
        self._parts.check_open()
        at, meta = self._ingest.check_turn(user_id, session_id, role, text, at, meta)
        if agent_id is not None or run_id is not None:
            self._ingest.check_scope(user_id, session_id, agent_id, run_id)
        if not self._store.has_room(1):
            raise trio.WouldBlock
        return self._buffer.append(user_id, session_id, role, text, at, meta, None, agent_id,
                                   run_id)

    async def add_turns(
        self, items: Iterable[NewTurn | Mapping[str, Any]], *, durable: bool = False
    ) -> list[Receipt]:
        """Add many turns at once, in order; all are validated before any is written.

        Args:
            items: :class:`NewTurn` values, or mappings with the same keys.
            durable: also wait until all of them are committed to disk.

        Returns:
            One :class:`Receipt` per item, in order.

        Raises:
            InvalidInput: an item is bad (``field`` says which, e.g. ``items[3].text``);
                nothing was written.
            EngineClosed: the engine is closed.

        A cancellation while the call waits for the store to make room (more turns than its
        queue holds, 16,384) leaves the turns queued before it in the store, in order, and
        their receipts are lost with the call: a caller that retries after one reads the
        sessions' histories first, or imports under turn ids it can check.
        """
        return await self._ingest.add_turns(items, durable)

    # -- reads -------------------------------------------------------------------------------

    async def session_history(self, user_id: str, session_id: str, limit: int = 50) -> list[Turn]:
        """The latest ``limit`` turns of a session, oldest first (unknown session: empty).

        Raises:
            InvalidInput: bad ids or limit.
            EngineClosed: the engine is closed.
        """
        return await self._ingest.session_history(user_id, session_id, limit)

    async def list_sessions(self, user_id: str) -> list[SessionInfo]:
        """The user's sessions, most recently active first (unknown user: empty)."""
        return await self._ingest.list_sessions(user_id)

    async def get_turn(self, user_id: str, turn_id: str) -> Turn | None:
        """One turn by id, with its ``meta``; None if the user has no such turn."""
        return await self._ingest.get_turn(user_id, turn_id)

    # -- retrieval ---------------------------------------------------------------------------

    async def recall(
        self,
        user_id: str,
        query: str,
        limit: int | None = None,
        *,
        focus: int | None = None,
        session_id: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        roles: Iterable[str] | None = None,
        kinds: Iterable[str] | None = None,
        tags: Iterable[str] | None = None,
        link_depth: int | None = None,
        budget_tokens: int | None = None,
        legs: Iterable[str] | None = None,
        link_types: Iterable[str] | None = None,
        where: Mapping[str, Any] | None = None,
        category: str | Iterable[str] | None = None,
        min_importance: float | None = None,
        emotion: str | Iterable[str] | None = None,
        as_of: datetime | None = None,
        agent_id: str | None = None,
        run_id: str | None = None,
    ) -> Hits:
        """The user's memories that best match ``query``: vector, BM25, entity and window legs
        fused by weighted z-scores, neighbouring turns and covering episodes lifting the turns
        they point at, expanded along links, packed into a token budget. Each hit's
        ``explain`` says why it ranks where it does.

        While an index is being rebuilt (a missing or damaged text index, vectors being
        re-embedded) the answer comes from the other legs at once rather than waiting, and
        says so: ``hits.degraded`` names the incomplete legs (``hits.partial`` is True).

        Args:
            user_id: whose memories; nothing of another user can come back.
            query: free text; never parsed as query syntax.
            limit: hits before link expansion (default: the focus level's, else 10).
            focus: seed 000's focus level 0-5: sets limit, a time window (1 h ... 7 days back
                from now, or from ``as_of`` when that is earlier) and link depth, each
                overridable by its own argument.
            session_id / since / until / roles / kinds: filters, applied inside each index
                (``until`` before ``since`` is refused). Linked memories pass them too.
            tags: keep memories carrying any of these tags (a turn's ``meta["tags"]``).
            link_depth: hops along links, both directions (default: the focus level's, else 0).
            budget_tokens: keep the best hits whose text fits (~4 characters a token).
            legs: the search legs that run, among ``vector``, ``bm25``, ``entity`` and
                ``window`` (default: all), to see what each finds alone or without another.
            link_types: follow only links of these types (``derived_from``, ``summarises``,
                ``shares_entity``, your own; default: every type).
            where: a metadata filter in mem0's shape, applied inside every search leg (never
                by discarding after the limit): ``{"channel": "web", "priority": {"gte": 2},
                "lang": {"in": ["en", "pt"]}, "title": {"contains": "trip"}}``, operators
                ``eq ne gt gte lt lte in nin contains``, ``AND`` / ``OR`` / ``NOT`` nesting,
                over a turn's ``meta`` and the records' own fields (``kind``, ``role``,
                ``session_id``, ``tags``, ``category``, ``key``, ``value``, ``importance``,
                ``confidence``, ``origin``, ``emotion``; ``meta.NAME`` for a meta key they
                shadow).
                Linked memories pass it too.
            category / min_importance / emotion: seed 000's filters, each a ``where``
                condition: notes' and facts' category (one or any of a list), importance at
                least this, notes' emotion label (one or any of a list). Turns and episodes
                have none of these, so any of them keeps notes and facts only.
            as_of: answer as the store knew it then (timezone-aware): turns said and note
                versions written by then, episodes made by then, fact versions recorded, in
                force and not yet retired then (both time axes), links made by then.
            agent_id / run_id: only turns and notes of this scope (mem0's); facts and
                episodes belong to the user and have none.

        Returns:
            :class:`Hits` (a list of :class:`Hit`), best first; linked memories follow the
            hits they were reached from; ``degraded`` names legs whose index was incomplete.

        Raises:
            InvalidInput: a bad argument; among them an empty list for a filter that takes a
                list (``kinds=[]``...): leave the filter out (None) for no filter.
        """
        return await self._recall.recall(
            user_id, query, limit, focus=focus, session_id=session_id, since=since, until=until,
            roles=roles, kinds=kinds, tags=tags, link_depth=link_depth, budget_tokens=budget_tokens,
            legs=legs, link_types=link_types, where=where, category=category,
            min_importance=min_importance, emotion=emotion, as_of=as_of, agent_id=agent_id,
            run_id=run_id)

    async def retrieve_memory(self, user_id: str, query: str, conversation_id: str | None = None,
                              episodic_limit: int = 5, semantic_limit: int = 20,
                              detail: str = "auto", category: str | None = None,
                              min_importance: float = 0.0, *,
                              legs: Iterable[str] | None = None, record: bool = True) -> str:
        """seed 001's ``retrieve_memory``: prompt-ready Markdown, semantic facts first (with
        ``[category]``), then episodic memories with rank, score, key moment and relative time;
        ``detail`` (auto / none / low / high) decides which show their messages. Records a
        pending review of the episodic memories shown (rated when the conversation's next
        assistant turn arrives, or by :meth:`review`).

        Args:
            conversation_id: the session the answer goes to (its next assistant turn rates
                what was shown).
            category / min_importance: which facts the semantic section may show.
            legs: the search legs that run, as :meth:`recall`'s (default: all), to compare what
                each brings; facts are searched by their vector and BM25 legs (those of the two
                named) and, not yet indexed, by the window leg; standing facts always come.
            record: False for a look that is not a use (an inspector, a debugging command):
                no pending review is recorded and the facts shown keep their decay.

        Raises:
            InvalidInput: a bad argument (``episodic_limit`` must be 1-100).
        """
        return await self._recall.retrieve_memory(user_id, query, conversation_id,
                                                   episodic_limit, semantic_limit, detail, category,
                                                   min_importance, legs, record)

    async def retrieve_memory_raw(self, user_id: str, query: str,
                                  conversation_id: str | None = None, episodic_limit: int = 5,
                                  semantic_limit: int = 20, detail: str = "auto",
                                  category: str | None = None,
                                  min_importance: float = 0.0, *,
                                  legs: Iterable[str] | None = None,
                                  record: bool = True) -> RetrieveResult:
        """seed 001's raw endpoint: typed ``semantic`` and ``episodic`` lists (no embeddings).
        Encode with ``msgspec.json.encode`` for the seed's JSON shape. Records a pending
        review, as :meth:`retrieve_memory` does; ``legs`` and ``record`` as there."""
        return await self._recall.retrieve_memory_raw(user_id, query, conversation_id,
                                                       episodic_limit, semantic_limit, detail,
                                                       category, min_importance, legs, record)

    async def context_pre_retrieve(self, user_id: str, query: str,
                                   conversation_id: str | None = None, semantic_limit: int = 20,
                                   category: str | None = None,
                                   min_importance: float = 0.0) -> str:
        """seed 001's ``context_pre_retrieve``: semantic facts only, as Markdown for a system
        prompt; records no pending review."""
        return await self._recall.context_pre_retrieve(user_id, query, conversation_id,
                                                        semantic_limit, category, min_importance)

    async def context_for_prompt(self, user_id: str, session_id: str, *,
                                 budget_tokens: int = 400, query: str | None = None) -> str:
        """What a bot should know as a session starts (seed 004's context injection, seed
        002's prompt shape): Markdown with "What I know about you" (active facts, most
        important first), the latest weekly reflection, and episodes of the user's *other*
        sessions (the relevant ones first, then the most recent), never this session's own.

        Args:
            session_id: the session the prompt is for (it may have no turns yet).
            budget_tokens: the most the text may cost (~4 characters a token); what does not
                fit is left out, line by line, in the order above.
            query: what relevance is measured against (default: the session's latest turns;
                with none, the most recent episodes are shown).

        Returns:
            The Markdown; empty when nothing is known about the user.

        Raises:
            InvalidInput: a bad id, budget or query.
        """
        parts = self._parts
        parts.check_open()
        parts.check_session(user_id, session_id)
        check_count("budget_tokens", budget_tokens, 1, 1_000_000)
        if query is not None:
            parts.check_text("query", query)
        return await context_for_prompt(parts, self._retriever, user_id, session_id,
                                        budget_tokens, query)

    # -- links -------------------------------------------------------------------------------

    async def link(self, user_id: str, from_id: str, to_id: str, type: str = "relates_to",
                   at: datetime | None = None) -> Link:
        """Link two of the user's memories; recall follows links in both directions.

        Raises:
            InvalidInput: an id is not a memory of this user, the two are the same, or the
                pair holds a link of this type the other way (one link of each type a pair).
        """
        return await self._links.link(user_id, from_id, to_id, type, at)

    async def links(self, user_id: str, memory_id: str) -> list[Link]:
        """Every link touching a memory, in either direction."""
        return await self._links.links(user_id, memory_id)

    # -- rolling session summaries -----------------------------------------------------------

    async def session_summary(self, user_id: str, session_id: str) -> SummaryState | None:
        """The session's rolling summary (seed 003), or None before the first write. Pass its
        ``epoch`` to :meth:`write_session_summary`."""
        return await self._memory.session_summary(user_id, session_id)

    async def write_session_summary(self, user_id: str, session_id: str, summary: str,
                                    upper_seq: int, expected_epoch: int) -> bool:
        """Replace the session's rolling summary if nobody did since ``expected_epoch`` was read.

        Optimistic concurrency (seed 003): a slow summariser holding a stale epoch is refused,
        so it can never overwrite a newer summary.

        Args:
            summary: the new summary text.
            upper_seq: it covers the session's turns with seq below this.
            expected_epoch: the epoch read with :meth:`session_summary` (0 before any).

        Returns:
            True if written (the epoch is now ``expected_epoch + 1``), False if stale.

        Raises:
            InvalidInput: unknown session, bad text, or ``upper_seq`` beyond the session.
        """
        return await self._memory.write_session_summary(user_id, session_id, summary,
                                                         upper_seq, expected_epoch)

    # -- notes -------------------------------------------------------------------------------

    async def store_note(self, user_id: str, text: str, *, note_id: str | None = None,
                         tags: Iterable[str] | None = None, importance: float | None = None,
                         emotion: str | None = None, category: str | None = None,
                         agent_id: str | None = None, run_id: str | None = None) -> Note:
        """Keep a note about the user (seed 003); recall finds it like any other memory.

        Args:
            note_id: the note's id (default: a new one); refused if the user has it already.
            tags: for the recall ``tags`` filter.
            importance: 0-1 (default 0.5), for recall's ``min_importance`` (seed 000).
            emotion: a free label (``joy``, ``curiosity``, ``positive``...), stored
                lower-case, for recall's ``emotion`` (seed 000).
            category: seed 000's category (``travel``), for recall's ``category``.
            agent_id / run_id: the note's scope below the user (mem0's), for recall's filters
                and ``forget_scope``; a repeat is merged only into a note of the same scope.

        Raises:
            InvalidInput: bad text, tags or fields, or ``note_id`` is taken (use update_note).
        """
        return await self._memory.put_note(user_id, text, note_id, tags, replace=False,
                                           importance=importance, emotion=emotion,
                                           category=category, agent_id=agent_id,
                                           run_id=run_id)

    async def update_note(self, user_id: str, note_id: str, text: str, *,
                          tags: Iterable[str] | None = None, importance: float | None = None,
                          emotion: str | None = None, category: str | None = None,
                          agent_id: str | None = None, run_id: str | None = None) -> Note:
        """Replace a note's text (and tags), keeping its id and creation time; importance,
        emotion and category change when given ("" clears a label) and are kept otherwise.

        Raises:
            InvalidInput: the user has no such note, or a bad argument.
        """
        return await self._memory.put_note(user_id, text, note_id, tags, replace=True,
                                           importance=importance, emotion=emotion,
                                           category=category, agent_id=agent_id,
                                           run_id=run_id)

    async def get_note(self, user_id: str, note_id: str) -> Note | None:
        """A note by id; None if the user has no such note."""
        return await self._memory.get_note(user_id, note_id)

    async def delete_note(self, user_id: str, note_id: str) -> bool:
        """Delete a note from the store and both indexes; False if there was none."""
        return await self._memory.delete_note(user_id, note_id)

    # -- structured facts --------------------------------------------------------------------

    async def remember_fact(self, user_id: str, category: str, key: str, value: str, *,
                            text: str | None = None, confidence: float = 0.9,
                            importance: float = 0.7, keywords: Iterable[str] = (),
                            valid_at: datetime | None = None) -> Fact:
        """State a fact about the user (seed 004's remember_fact). One value is active per
        (category, key): a new value supersedes the old one, which stays in the history with
        ``invalid_at`` set, unless its confidence is lower (seed 002's rule). The same value
        again, or a sentence nearly the same as an active fact's, reinforces that fact.

        Args:
            category: identity, preference, constraint, instruction, or your own.
            key: what the fact is about within the category (``location``, ``likes:jazz``).
            value: its value (``Lisbon``).
            text: the fact as a sentence for prompts (default: ``"<key>: <value>"``).
            confidence / importance: 0-1.
            keywords: extra search words.
            valid_at: since when it is true (default: now).

        Returns:
            The active fact for the key (the new one, or the reinforced one); or, for a value
            given as true from before the one in force (``valid_at`` earlier than its), the
            past version kept in history (``status`` "superseded", ``invalid_at`` where the
            value in force begins): the value in force stays.

        Raises:
            InvalidInput: a bad argument, or an active value with higher confidence exists
                (call :meth:`correct_fact` to replace it anyway).
        """
        return await self._memory.remember_fact(
            user_id, category, key, value, text=text, confidence=confidence, importance=importance,
            keywords=keywords, valid_at=valid_at)

    async def correct_fact(self, user_id: str, category: str, key: str, value: str, *,
                           text: str | None = None, importance: float = 0.7,
                           keywords: Iterable[str] = (),
                           valid_at: datetime | None = None) -> Fact:
        """Replace a fact's value whatever the old one's confidence (seed 004's correct_fact):
        the old version is retired with ``invalid_at`` set to when the new one is true
        (``valid_at``, default: now) and kept in the history; the new one has confidence 1.

        Raises:
            InvalidInput: a bad argument (``valid_at`` must be timezone-aware).
        """
        return await self._memory.correct_fact(user_id, category, key, value, text=text,
                                                importance=importance, keywords=keywords,
                                                valid_at=valid_at)

    async def confirm_fact(self, user_id: str, category: str, key: str) -> Fact:
        """Protect the active fact (seed 004's confirm_fact): confidence 1, never decays, and
        no inferred value supersedes it.

        Raises:
            NotFound: the user has no active fact with that category and key.
        """
        return await self._memory.confirm_fact(user_id, category, key)

    async def forget_fact(self, user_id: str, category: str, key: str) -> bool:
        """Retract the active fact: it leaves recall and the profile, and stays in the history
        as ``retracted``. False if there was none."""
        return await self._memory.forget_fact(user_id, category, key)

    async def profile(self, user_id: str, *, category: str | None = None,
                      min_importance: float = 0.0, as_of: datetime | None = None) -> list[Fact]:
        """The user's active facts, most important first: the deterministic lookup that
        never misses a standing fact (no search involved).

        Args:
            category / min_importance: which facts.
            as_of: answer as the store knew it then (time travel over both time axes): the
                versions recorded by then and not yet retired (``created_at`` /
                ``expired_at``) that were true then (``valid_at`` / ``invalid_at``).

        Raises:
            InvalidInput: a bad argument (``as_of`` must be timezone-aware).
        """
        return await self._memory.profile(user_id, category, min_importance, as_of)

    async def fact_history(self, user_id: str, category: str, key: str) -> list[Fact]:
        """Every version of a fact, oldest first, with their validity and status."""
        return await self._memory.fact_history(user_id, category, key)

    # -- episodes and reviews ----------------------------------------------------------------

    async def episodes(self, user_id: str, session_id: str | None = None) -> list[Episode]:
        """The user's episodes (of one session), by session and position."""
        return await self._memory.episodes(user_id, session_id)

    async def close_session(self, user_id: str, session_id: str) -> bool:
        """The session is over: make an episode of its turns not yet in one, now (otherwise
        maintenance does once it has been idle for ``Config.session_idle_seconds``).

        Returns:
            True if an episode was made.
        """
        return await self._memory.close_session(user_id, session_id)

    async def review(self, user_id: str, memory_id: str, rating: str | int) -> ReviewState:
        """Rate how well a shown memory served (FSRS): ``again``/1, ``hard``/2, ``good``/3 or
        ``easy``/4. Its stability and difficulty change, and with them its retrievability,
        which re-ranks it in every later retrieval.

        Raises:
            InvalidInput: a bad rating, or no episode or turn of the user has that id (facts
                do not follow FSRS: confirm or correct them).
        """
        return await self._memory.review(user_id, memory_id, rating)

    # -- entities ----------------------------------------------------------------------------

    async def entity_info(self, user_id: str, name: str, limit: int = 20) -> EntityInfo | None:
        """An entity the user's memories mention (by name or alias, any case) and those
        memories, newest first; None if no memory mentions it."""
        return await self._memory.entity_info(user_id, name, limit)

    async def memory_stats(self, user_id: str) -> dict[str, Any]:
        """Counts of the user's memories by kind (turns, episodes, active facts, notes,
        entities) and when the latest turn was said (seed 004's memory_stats)."""
        return await _stats.memory_stats(self._parts, user_id)

    # -- listings (engine/_browse.py: what the inspector and operators browse) ---------------

    @property
    def path(self) -> Path:
        """The store directory this engine serves (for ``Engine.verify`` beside it)."""
        return self._parts.store.path

    @property
    def config(self) -> Config:
        """The settings this engine was opened with (frozen: changing them means a reopen)."""
        return self._parts.config

    def check_open(self) -> None:
        """What every call checks first: raise EngineClosed if the engine was closed,
        EngineBroken if its store broke underneath. For a wrapper that must refuse before it
        does work of its own (the cluster's engine does)."""
        self._parts.check_open()

    async def list_users(self) -> list[str]:
        """Every user with a session, a note or a fact, sorted."""
        return await _browse.list_users(self._parts)

    async def list_notes(self, user_id: str) -> list[Note]:
        """The user's notes (current versions), most recently updated first.

        Raises:
            InvalidInput: a bad user id.
        """
        return await _browse.list_notes(self._parts, user_id)

    async def list_entities(self, user_id: str) -> list[Entity]:
        """The entities the user's memories mention, most mentioned first (details and the
        memories mentioning one: :meth:`entity_info`).

        Raises:
            InvalidInput: a bad user id.
        """
        return await _browse.list_entities(self._parts, user_id)

    async def fact_versions(self, user_id: str) -> list[Fact]:
        """Every version of every fact of the user, superseded, pruned and retracted ones
        included, by category and key and each key's versions oldest first (one key's:
        :meth:`fact_history`).

        Raises:
            InvalidInput: a bad user id.
        """
        return await _browse.fact_versions(self._parts, user_id)

    # -- maintenance and tools ---------------------------------------------------------------

    async def export_user(self, user_id: str,
                          dest: str | os.PathLike[str] | IO[bytes]) -> dict[str, int]:
        """Write every record of a user (turns, notes, episodes, every fact version, links,
        review states, session summaries, entities) as versioned JSON Lines (docs/EXPORT.md).

        Args:
            user_id: whose memory.
            dest: a file path (written atomically) or a binary file (``sys.stdout.buffer``).

        Returns:
            How many lines of each kind were written (``turn``, ``fact``, ...).

        Raises:
            NotFound: the store holds no record of the user (nothing is written).
            InvalidInput: a bad user id or destination.
            OSError: the disk under a path ``dest`` is full or failed; nothing of the file
                is left (as ``snapshot``'s).
        """
        self._parts.check_open()
        self._parts.check_ids(user_id)
        if not isinstance(dest, (str, os.PathLike)) and not hasattr(dest, "write"):
            raise InvalidInput("dest", "expected a file path or a binary file, found "
                                       f"{type(dest).__name__}")
        return await export_user(self._parts, user_id, dest)

    async def import_user(self, source: str | os.PathLike[str] | bytes | IO[bytes], *,
                          as_user: str | None = None) -> dict[str, int]:
        """Read a user's export into this store: records keep their ids, times, history and
        derivations, so the store answers as the exporting one did. Records the user already
        has (by id) are skipped: importing the same file twice changes nothing.

        Args:
            source: an export's path, its bytes, or a binary file.
            as_user: import under this user id instead of the exported one.

        Returns:
            How many records of each kind were written (``turns``, ``facts``, ...), and
            ``skipped``.

        Raises:
            InvalidInput: the source is not an export this build reads (the message names the
                line), it is cut short, or a session here holds other turns than the export's;
                nothing was written.
        """
        self._parts.check_open()
        if as_user is not None:
            self._parts.check_ids(as_user)
        return await import_user(self._parts, source, as_user)

    async def export_vectors(self, user_id: str) -> UserVectors:
        """The stored vectors of the user's records (those embedded so far), to go beside the
        user's export into ``import_users``, which then stores them instead of running the
        model again (a cluster's partition snapshots carry them)."""
        self._parts.check_open()
        self._parts.check_ids(user_id)
        return await export_vectors(self._parts, user_id)

    async def import_users(self, sources: Sequence[str | os.PathLike[str] | bytes | IO[bytes]],
                           *, as_users: Sequence[str | None] | None = None,
                           vectors: Sequence[UserVectors | None] | None = None
                           ) -> list[dict[str, int]]:
        """``import_user`` for many exports at once, as one import: one parse, one read of
        what the store holds, the records in shared blocks and commits. For moving many users
        of a few turns each (a partition's snapshot, a migration), where one import each
        spends most of its time waiting on the store.

        Args:
            sources: the exports (paths, bytes or binary files), one per user.
            as_users: for each source, a user id to import it under (None: the exported one).
            vectors: for each source, its user's ``export_vectors`` (or None): the records
                keep those vectors and the model runs only on the others. Vectors of another
                model than this engine's are not used, nor any with
                ``Config(background_embedding=False)`` (the serving process embeds).

        Returns:
            For each source, in order, what ``import_user`` returns for it.

        Raises:
            InvalidInput: a source is not an export this build reads (the field names it:
                ``sources[3]``), two are of the same user, vectors are not its user's or
                not whole ``dim``-value float16 vectors (finite, not all zeros), or a
                session here holds other turns than its export's; nothing was written. A live turn that reaches a
                session of the import while it is written stops it there, as with
                ``import_user``.
        """
        self._parts.check_open()
        if isinstance(sources, (str, bytes, os.PathLike)) or not isinstance(sources, Sequence):
            raise InvalidInput("sources", "expected a list of exports, found "
                                          f"{type(sources).__name__}")
        if as_users is None:
            as_users = [None] * len(sources)
        if isinstance(as_users, (str, bytes)) or not isinstance(as_users, Sequence):
            raise InvalidInput("as_users", "expected a list of user ids (or None), one per "
                                           f"source, found {type(as_users).__name__}")
        if len(as_users) != len(sources):
            raise InvalidInput("as_users", f"expected one per source ({len(sources)}), found "
                                           f"{len(as_users)}")
        if vectors is not None and not isinstance(vectors, Sequence):
            raise InvalidInput("vectors", "expected a list of UserVectors (or None), one per "
                                          f"source, found {type(vectors).__name__}")
        if vectors is not None and len(vectors) != len(sources):
            raise InvalidInput("vectors", f"expected one per source ({len(sources)}), found "
                                          f"{len(vectors)}")
        for as_user in as_users:
            if as_user is not None:
                self._parts.check_ids(as_user)
        return await import_users(self._parts, list(sources), list(as_users),
                                  [f"sources[{i}]" for i in range(len(sources))],
                                  None if vectors is None else list(vectors))

    async def maintain(self) -> MaintenanceReport:
        """Run one maintenance pass now (it also runs every ``Config.maintenance_seconds``)."""
        self._parts.check_open()
        return await self._maintenance.run_once()

    async def call_tool(self, name: str, arguments: Mapping[str, Any] | str) -> dict[str, Any]:
        """Run one of :data:`TOOLS` (seed 004's agent tools) for a model's tool call.

        Args:
            name: the tool's name.
            arguments: its arguments, as a mapping or the JSON text a model produced.

        Returns:
            A JSON-ready dict.

        Raises:
            InvalidInput: an unknown tool, or arguments that do not fit its schema.
        """
        self._parts.check_open()
        return await call_tool(self, name, arguments)

    # -- deletion ----------------------------------------------------------------------------

    async def apply_log_batch(self, partition: int, entries: Sequence[tuple[int, Any]],
                              results: dict[int, Any] | None = None) -> int:
        """Apply a batch of a cluster's replicated log (``engine.cluster`` drives this).

        Args:
            partition: the log partition the entries come from.
            entries: ``(log_seq, entry)`` pairs in log order (``engine._logbatch.LogTurn`` /
                ``LogForget`` / ``LogCall``); an empty batch just reads the watermark.
            results: if given, what each ``LogCall`` returned (or the error it raised), by
                its log sequence.

        Returns:
            The partition's watermark after the batch (its last log sequence applied).

        Raises:
            InvalidInput: a malformed batch; nothing was written.
            EngineClosed / EngineBroken: as any write.
        """
        return await self._partition_log.apply(partition, entries, results)

    @property
    def log_counts(self) -> dict[str, int]:
        """What applying a cluster's log has skipped since open: turns whose id was already
        applied (``duplicates``) and entries that failed the engine's checks (``invalid``);
        and the entries (calls, forgets) that waited for the long-term followers to take in
        the log before them (``waited``), of which 10 s or more (``waited_long``)."""
        applied = self._partition_log
        return {"duplicates": applied.duplicates, "invalid": applied.invalid,
                "waited": applied.waited, "waited_long": applied.waited_long}

    async def export_records(self, user_id: str) -> tuple[UserRecords, VectorRows]:
        """Every record of the user as ``export_user`` writes them, as structs rather than
        JSON, and their stored vectors in one buffer: what ``engine.cluster`` puts in a
        partition snapshot, for :meth:`restore_users`."""
        self._parts.check_open()
        self._parts.check_ids(user_id)
        return await export_records(self._parts, user_id)

    async def restore_users(self, users: Sequence[UserRecords],
                            vectors: Sequence[VectorRows | None]) -> list[dict[str, int]]:
        """Write users as :meth:`export_records` read them (``engine.cluster``: a partition
        snapshot into a copy that holds none of them), as one import: its checks, and the
        vectors kept when this engine has their model. The log's followers catch up once the
        last record is written; until they hold every restored record, recall names their
        legs in ``degraded``.

        Returns:
            For each user, what ``import_user`` returns.

        Raises:
            InvalidInput: a user's records or vectors do not pass an import's checks
                (``users[3]``, ``vectors[3]``); nothing was written.
        """
        self._parts.check_open()
        if not all(isinstance(user, UserRecords) for user in users):
            raise InvalidInput("users", "expected UserRecords (Engine.export_records), found "
                                        f"{sorted({type(u).__name__ for u in users})}")
        if len(users) != len(vectors):
            raise InvalidInput("vectors", f"expected one per user ({len(users)}), found "
                                          f"{len(vectors)}")
        return await restore_users(self._parts, list(users), list(vectors))

    async def set_log_watermark(self, partition: int, seq: int) -> None:
        """Set a partition's watermark (``engine.cluster``: 0 before a copy of the partition
        is dropped, a snapshot's sequence once its users are restored from it).

        Raises:
            InvalidInput: a sequence below 0.
        """
        self._parts.check_open()
        await self._partition_log.set_watermark(partition, seq)

    async def _logged_call(self, method: str, user_id: str, args: dict[str, Any]) -> Any:
        # A LogCall's method, by name (the log batch checked it against its list).
        return await getattr(self, method)(user_id, **args)

    async def forget_session(self, user_id: str, session_id: str) -> None:
        """Delete a session and all its turns; returns once the deletion is on disk.

        Once the next ``flush`` (or a clean close) returns, no byte of what it removed (its
        text, ids and vectors) is in any file of the store: ``data.mdb`` (free pages and the
        free space inside pages included), the text index, saved graphs, or a snapshot taken
        after. ``flush`` waits meanwhile for a reader of another process holding a snapshot
        from before the deletion; after a crash, the next open finishes it."""
        await self._forgetting.forget_session(user_id, session_id)

    async def forget_user(self, user_id: str) -> None:
        """Delete everything of a user; returns once the deletion is on disk. What is
        promised once the next ``flush`` returns: as for :meth:`forget_session`."""
        await self._forgetting.forget_user(user_id)

    async def forget_scope(self, user_id: str, *, agent_id: str | None = None,
                           run_id: str | None = None) -> dict[str, int]:
        """Delete one scope of a user: every session whose turns carry this ``agent_id`` and
        ``run_id`` (either alone matches any of the other), with what was derived from them,
        and every note of that scope; nothing of another scope or user. Each session and note
        goes in a transaction of its own: a crash midway leaves the rest, and calling again
        finishes. Returns once on disk (the next ``flush``, once the bytes left the indexes).

        Returns:
            ``{"sessions": n, "notes": m}`` forgotten.

        Raises:
            InvalidInput: neither ``agent_id`` nor ``run_id`` given, or a bad id.
        """
        return await self._forgetting.forget_scope(user_id, agent_id, run_id,
                                                   self._memory.delete_note)

    # -- embeddings --------------------------------------------------------------------------

    async def embed(self, texts: list[str]) -> np.ndarray:
        """Embed texts with the engine's model.

        Args:
            texts: a list of strings (a lone string is refused: wrap it in a list).

        Returns:
            A float32 array of shape (len(texts), dimension), each row of unit length.

        Raises:
            InvalidInput: ``texts`` is not a list of strings.
            EngineBroken: the model failed.
        """
        self._parts.check_open()
        return await self._embedder.embed(check_texts(texts))

    async def embed_query(self, user_id: str, query: str) -> np.ndarray:
        """The vector :meth:`recall` searches with for this query: from the per-user query
        cache when the user asked it before, else from the model (and then cached).

        Returns:
            A read-only float32 vector of unit length.

        Raises:
            InvalidInput: a bad user id or query.
        """
        self._parts.check_open()
        self._parts.check_lookup_ids(user_id)
        self._parts.check_text("query", query)
        return await self._embedder.embed_query(query, user_id)

    # -- snapshots ---------------------------------------------------------------------------

    async def snapshot(self, dest: str | os.PathLike[str]) -> Manifest:
        """Write a point-in-time snapshot of the store to ``dest`` while the engine serves.

        It first waits until every write acknowledged before the call is committed (a
        buffered turn included), and for the scrubs of earlier deletions (see :meth:`flush`).
        The text
        index is copied (or, if its segments still hold deleted documents, built afresh from
        the copy), then LMDB is copied compactly from a worker thread; the manifest
        records the log sequence number it is consistent at, counts and sha256 checksums.
        Nothing of a user forgotten before the call is in any of its files.

        Args:
            dest: a new or empty directory.

        Returns:
            The :class:`Manifest` also written to ``dest/manifest.json``.

        Raises:
            InvalidInput: ``dest`` has files in it.
            OSError: the disk under ``dest`` is full or failed; nothing of the copy is left.
        """
        self._parts.check_open()
        return await take_snapshot(self._parts, _path_arg("dest", dest), self._scrubbed)

    @staticmethod
    async def restore(snapshot_dir: str | os.PathLike[str], store_path: str | os.PathLike[str],
                      *, overwrite: bool = False,
                      progress: Callable[[int, int], None] | None = None,
                      integrity_key: str | None = None) -> Manifest:
        """Verify a snapshot and install it as the store at ``store_path``; then open it with
        ``Engine.open(store_path)``.

        Args:
            snapshot_dir: a directory written by :meth:`snapshot`.
            store_path: where the store goes: a new or empty directory unless ``overwrite``.
            overwrite: replace a store already there.
            progress: called with (bytes copied, bytes in all) as files are installed.
            integrity_key: the key the snapshot's store was sealed with: its manifest's MAC
                (over every file's sha256 and the chain head) must match under it, and then
                vouches for every byte, so only the chain's head is checked. Without it the
                hash chain of the snapshot's store is checked link by link up to the head the
                manifest names before it is installed (``engram-trio verify`` checks every
                link and record of a store).

        Raises:
            InvalidInput: no snapshot there, or ``store_path`` holds files and not ``overwrite``;
                a path that cannot be one (a NUL, a name too long, through a file, a folder
                the process cannot make); ``store_path`` inside the snapshot, or a name a
                snapshot or store already takes for its leftovers.
            StoreIncompatible: the snapshot is damaged (a checksum differs) or too new.
            StoreTampered: its manifest's MAC fails under the key (or it has none), or its
                store's hash chain breaks.
            StoreInUse: an engine serves the store at ``store_path``; nothing was replaced.
            OSError: the disk under ``store_path`` is full or failed; nothing of the copy is
                left, and a store it would have replaced is still there.
        """
        return await restore(_path_arg("snapshot", snapshot_dir),
                             _path_arg("store_path", store_path), overwrite, progress,
                             _key_arg(integrity_key))

    @staticmethod
    async def verify(store_path: str | os.PathLike[str], *, integrity_key: str | None = None,
                     seal: bool = False) -> dict[str, Any]:
        """Check a whole store: every record's checksum, the hash chain from the first log
        position to the head (and the head's MAC, with the key), that every removed record
        is covered by a logged removal, that every session's turns run without gaps, and
        that no key has two active fact values. It reads one consistent state, so it may run
        beside an engine serving the store from another process (not with ``seal``); LMDB
        opens a store once per process, so not beside one of this process.

        Args:
            store_path: the store directory.
            integrity_key: the key the store is sealed with (without it the MAC is unchecked).
            seal: if the store verifies and is not sealed yet, MAC its head with the key (the
                store must be closed); from then on it opens only with that key.

        Returns:
            A report: ``ok``, ``problems`` (``where`` and ``what`` of each break), counts.

        Raises:
            InvalidInput: no store there, ``seal`` without a key, or a store an engine of
                this process serves.
        """
        return await trio.to_thread.run_sync(verify_store, _path_arg("store_path", store_path),
                                             _key_arg(integrity_key), seal)

    @staticmethod
    async def compact(store_path: str | os.PathLike[str]) -> dict[str, Any]:
        """Rewrite a closed store without freed pages (LMDB keeps deleted records' bytes in
        them) and rebuild its text index if deleted documents linger in its segments.

        Raises:
            StoreInUse: an engine has the store open (the message names its pid).
        """
        return await trio.to_thread.run_sync(compact, _path_arg("store_path", store_path))

    # -- upkeep ------------------------------------------------------------------------------

    async def flush(self) -> None:
        """Return once everything acknowledged before the call is on disk and in every index
        (the vector index too, with background embedding on), and the long-term layer has
        taken it in: its facts extracted, its entities registered, the episodes it completes
        made, and those indexed too. What forgets and deleted notes removed before the call
        has left every file of the store by then (see ``engine/_forget.py``).

        Raises:
            RecordRefused: a record logged before the call could not be written (its lsn and
                id; the others were); raised by one flush only. A record a background part
                failed on is not raised: it is in :meth:`failures`.
        """
        await self._ingest.flush()

    async def stats(self) -> Stats:
        """Counts and positions; cheap enough to call from a health check."""
        return await _stats.stats(self._parts)

    async def failures(self, user_id: str | None = None) -> list[Failure]:
        """The records some part of the engine could not take (a write the store refused, a
        record the text index or a long-term follower failed on), by lsn. Each part went on
        without that record; the rest of the store is whole.

        Args:
            user_id: only this user's (default: everyone's).

        Raises:
            InvalidInput: a bad user id.
        """
        return await _stats.failures(self._parts, user_id)
