"""The Engine facade: owns the nursery, starts the actors, hides every channel."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import msgspec
import trio

import numpy as np

from actors.ann_index import AnnIndex
from actors.embedder import (
    DEFAULT_MODEL,
    Embedder,
    EmbeddingBackend,
    OnnxEmbedder,
    model_for_store,
)
from actors.entities import Entities
from actors.episodic import RATINGS, EpisodicCompressor, memory_review_state, review_state
from actors.facts import Candidate, Facts
from actors.fulltext import FullText
from actors.base.messages import DeleteNote, PutLink, PutNote, PutState, WriteSummary
from actors.session_buffer import Receipt, SessionBuffer, new_turn_id
from actors.store import (
    LogFollower,
    Store,
    count_failures,
    read_failures,
    read_entities,
    read_episodes,
    read_links,
    read_memories_by_id,
    read_records,
    read_review_states,
    read_summary,
    read_user_counts,
    user_prefix,
)

from actors.base import validate as v
from actors.base.config import Config
from ._forget import Scrubber
from ._llm import LLM, ModelTasks
from ._maintenance import Maintenance, MaintenanceReport
from actors.base.records import (
    SCHEMA_VERSION,
    Entity,
    Episode,
    Fact,
    Failure,
    Link,
    NewTurn,
    Note,
    PendingReview,
    ReviewState,
    SessionInfo,
    SummaryState,
    Turn,
)
from ._retrieval import (
    FOCUS_LEVELS,
    Hit,
    Hits,
    RetrieveResult,
    Retriever,
    _hit,
    focus_settings,
    render_markdown,
)
from ._owner import OwnerLock, claim_in_process, release_in_process
from ._snapshot import Manifest, compact, restore, take_snapshot
from ._tools import call_tool
from ._verify import verify_store
from actors.base.errors import (
    EngineBroken,
    EngineClosed,
    InvalidInput,
    RecordRefused,
    StoreCorrupt,
    StoreTampered,
)

__all__ = ["Engine", "Stats", "EntityInfo"]

Clock = Callable[[], datetime]


def _utc_now() -> datetime:
    return datetime.now(timezone.utc)


class Stats(msgspec.Struct, frozen=True, kw_only=True):
    """What ``Engine.stats`` reports.

    Attributes:
        users / sessions / turns: what the engine holds (turns include those not yet on disk).
        last_lsn: the newest log sequence number handed out.
        committed_lsn: everything up to here is on disk.
        queued: turns and deletions waiting for the disk.
        live_windows: sessions whose short-term window is in RAM.
        store_bytes: size of the LMDB data file; map_bytes: its current map size.
        schema_version: the store's schema.
        model: the embedding model's id; embedded_lsn: every record up to here has its vector.
        indexed_lsn: every record up to here is in the full-text index.
        vector_lag_records: records logged and not yet embedded (turns, mostly).
        vector_lag_seconds: how long ago the oldest record not yet embedded was committed
            (0: none is waiting; to within 0.1 s).
        texts_embedded / embed_cache_hits: background texts the model embedded, and those the
            content cache answered instead, since the engine opened.
        failures: records some part of the engine could not take and went on without
            (listed by :meth:`Engine.failures` and ``engram inspect STORE --failures``).
        degraded: the search legs whose index is being rebuilt or caught up with what the
            store held at open (``bm25``, ``vector``); ``recall`` flags its results meanwhile.
        read_only: the engine was opened with ``read_only=True``.
    """

    users: int
    sessions: int
    turns: int
    last_lsn: int
    committed_lsn: int
    queued: int
    live_windows: int
    store_bytes: int
    map_bytes: int
    schema_version: int
    model: str
    embedded_lsn: int
    indexed_lsn: int
    failures: int = 0
    degraded: tuple[str, ...] = ()
    read_only: bool = False
    vector_lag_records: int = 0
    vector_lag_seconds: float = 0.0
    texts_embedded: int = 0
    embed_cache_hits: int = 0


class EntityInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What ``entity_info`` returns: the entity and the memories that mention it, newest
    first."""

    entity: Entity
    memories: list[Hit]


class Engine:
    """An open memory engine. Get one with ``async with Engine.open(path) as mem``."""

    def __init__(self, store: Store, buffer: SessionBuffer, embedder: Embedder, ann: AnnIndex,
                 fulltext: FullText, facts: Facts, compressor: EpisodicCompressor,
                 entities: Entities, config: Config, clock: Clock,
                 nursery: trio.Nursery) -> None:
        self._store = store
        self._buffer = buffer
        self._embedder = embedder
        self._ann = ann
        self._fulltext = fulltext
        self._facts = facts
        self._compressor = compressor
        self._entities = entities
        self._retriever = Retriever(store, buffer, embedder, ann, fulltext, facts, entities,
                                    clock)
        self._maintenance = Maintenance(self)
        self._config = config
        self._clock = clock
        self._nursery = nursery
        self._followers: list[LogFollower] = []  # the long-term layer's, if it runs
        self._scrubber = Scrubber(store, fulltext, ann)
        self._forgets = 0  # forget_session / forget_user calls so far
        self._closed = False
        self._read_only = store.read_only
        self._open_lsn = store.committed_lsn  # what the store held at open

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
                one the store was made with, or ``minilm-l6-v2-q8`` for a new store); tests
                that are not about embeddings pass a ``HashEmbedder``.
            reembed: adopt the configured model even if the store's vectors came from another,
                dropping them so that everything is embedded again in the background.
            llm: an optional language model (:class:`LLM`, e.g. :class:`OpenAICompatibleLLM`)
                that summarises episodes and extracts facts in the background; without one
                the offline defaults do (extractive summaries, rules).
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
        if not isinstance(path, (str, os.PathLike)):
            raise InvalidInput("path", f"expected a directory path, found {type(path).__name__}")
        if llm is not None and not isinstance(llm, LLM):
            raise InvalidInput("llm", "expected an object with an async complete(system, prompt) "
                                      f"method, found {type(llm).__name__}")
        config = Config.checked(dict(config) if isinstance(config, Mapping) else config)
        if type(read_only) is not bool:
            raise InvalidInput("read_only", f"expected True or False, found {read_only!r}")
        if read_only and reembed:
            raise InvalidInput("reembed", "expected False with read_only=True (re-embedding "
                                          "rewrites every vector), found True")
        if read_only:  # a reader derives nothing: that is the owner's work
            config = msgspec.structs.replace(config, background_embedding=False,
                                             long_term=False)
        clock = clock or _utc_now
        tasks = None if llm is None else ModelTasks(llm)
        if embedder is None:
            model = config.model
            if model is None:  # the store's own, so an older default never strands a store
                model = (DEFAULT_MODEL if reembed
                         else await trio.to_thread.run_sync(model_for_store, Path(path)))
            embedder = OnnxEmbedder(model, config.model_dir, config.embed_threads)
        embedding = Embedder(embedder, config.query_cache, config.background_embed_threads)
        root = Path(path)
        owner = None if read_only else OwnerLock(root, "serving").acquire()
        try:
            claim = claim_in_process(root, "read-only" if read_only else "serving")
        except BaseException:
            if owner is not None:
                owner.release()
            raise
        try:
            async with cls._run(root, config, clock, embedding, reembed, tasks,
                                read_only) as engine:
                yield engine
        finally:
            release_in_process(claim)
            if owner is not None:
                owner.release()

    @classmethod
    @asynccontextmanager
    async def _run(cls, root: Path, config: Config, clock: Clock, embedding: Embedder,
                   reembed: bool, tasks: ModelTasks | None,
                   read_only: bool) -> AsyncIterator[Engine]:
        """The engine's lifetime: actors started in order, stopped in reverse."""
        store = Store(root, config, embedding.model, reembed, read_only)
        ann = AnnIndex(store, embedding.model.dim, config.ann_cache_vectors, root / "ann",
                       read_only)
        fulltext = FullText(root / "fulltext", store, read_only)
        body_error: BaseException | None = None
        raised: BaseException | None = None
        background: list[trio.CancelScope] = []
        try:
            async with trio.open_nursery() as nursery:
                engine: Engine | None = None
                try:
                    await nursery.start(store.run)
                    await nursery.start(embedding.run)
                    await nursery.start(ann.run)
                    await nursery.start(fulltext.run)
                    buffer = SessionBuffer(store, config)
                    await buffer.load()
                    if config.background_embedding:
                        await nursery.start(embedding.follow, store, ann.added)
                    facts = Facts(store, lambda user, lsns: ann.removed(user, lsns, False),
                                  clock, lambda: new_turn_id()[2:])
                    compressor = EpisodicCompressor(
                        store, embedding, ann, clock, lambda: new_turn_id()[2:],
                        after_turns=config.episode_after_turns,
                        keep_turns=config.episode_keep_turns, llm=tasks,
                        vectors_follow=config.background_embedding)
                    entities = Entities(store)
                    engine = cls(store, buffer, embedding, ann, fulltext, facts, compressor,
                                 entities, config, clock, nursery)
                    if not read_only:  # a reader writes nothing; the owner scrubs
                        scope = trio.CancelScope()
                        background.append(scope)
                        await nursery.start(_in_scope, scope, engine._scrubber.run)
                    if config.long_term:
                        engine._followers = [entities.follower, facts.follower(tasks),
                                             compressor.follower]
                        tasks_to_run = [(f.run, ()) for f in engine._followers]
                        tasks_to_run.append((engine._maintenance.run,
                                             (config.maintenance_seconds,)))
                        for task, args in tasks_to_run:
                            scope = trio.CancelScope()
                            background.append(scope)
                            await nursery.start(_in_scope, scope, task, *args)
                    yield engine
                except BaseException as exc:
                    body_error = exc
                    raise
                finally:
                    # The store drains what is queued, shielded; the embedder answers what it
                    # holds; the follower stops where the watermark on disk says it stopped.
                    if engine is not None:
                        engine._closed = True
                        if engine._scrubber.pending and store.usable():
                            # What a forget removed leaves the files before the engine
                            # closes: otherwise the next open scrubs (the marker in the
                            # store names the users). Bounded by work, like the drain.
                            with trio.CancelScope(shield=True):
                                await engine._scrubber.wait()
                    # The long-term layer stops first; its watermarks say where to resume.
                    for scope in background:
                        scope.cancel()
                    embedding.close()
                    ann.close()
                    store.close()
        except BaseExceptionGroup as group:
            raised = _translate(group, body_error)
        if raised is not None:
            raise raised

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

        Returns:
            A :class:`Receipt` with ``turn_id``, ``seq`` and ``await durable()``.

        Raises:
            InvalidInput: a bad argument; nothing was written.
            EngineClosed: the engine is closed.
        """
        self._check_open()
        await trio.lowlevel.checkpoint_if_cancelled()
        at, meta = self._check_turn(user_id, session_id, role, text, at, meta)
        await self._store.reserve(1)
        self._check_open()
        receipt = self._buffer.append(user_id, session_id, role, text, at, meta)
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
        self._check_open()
        at, meta = self._check_turn(user_id, session_id, role, text, at, meta)
        if not self._store.has_room(1):
            raise trio.WouldBlock
        return self._buffer.append(user_id, session_id, role, text, at, meta)

    def _check_turn(self, user_id: Any, session_id: Any, role: Any, text: Any, at: Any,
                    meta: Any) -> tuple[datetime, dict[str, Any] | None]:
        """One turn's arguments, as :meth:`add_turn` and :meth:`add_turn_nowait` take them;
        returns the time it is stamped with (the engine clock's, checked, when ``at`` is None)
        and its meta."""
        config = self._config
        v.check_id("user_id", user_id, config.max_id_chars)
        v.check_id("session_id", session_id, config.max_id_chars)
        v.check_role(role)
        v.check_text("text", text, config.max_text_chars)
        at = self._now() if at is None else v.check_at(at)
        return at, v.check_meta(meta, config.max_meta_bytes)

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
        """
        self._check_open()
        await trio.lowlevel.checkpoint_if_cancelled()
        checked = [self._check_item(i, item) for i, item in enumerate(items)]
        receipts: list[Receipt] = []
        buffer, store = self._buffer, self._store
        # Each chunk is appended without yielding, so its turns stay contiguous in a session.
        for start in range(0, len(checked), _BULK_CHUNK):
            chunk = checked[start : start + _BULK_CHUNK]
            await store.reserve(len(chunk))
            self._check_open()
            receipts.extend(buffer.append(*item) for item in chunk)
        if durable and receipts:
            await receipts[-1].durable()
        return receipts

    def _check_item(self, index: int, item: NewTurn | Mapping[str, Any]) -> tuple[Any, ...]:
        config = self._config
        if isinstance(item, Mapping):
            try:
                item = NewTurn(**item)  # fields are checked below, as add_turn checks them
            except TypeError as exc:
                raise InvalidInput(
                    f"items[{index}]", f"expected the fields of a NewTurn, found {exc}"
                ) from None
        elif not isinstance(item, NewTurn):
            raise InvalidInput(
                f"items[{index}]", f"expected a NewTurn or a mapping, found {type(item).__name__}"
            )
        try:
            return (
                v.check_id("user_id", item.user_id, config.max_id_chars),
                v.check_id("session_id", item.session_id, config.max_id_chars),
                v.check_role(item.role),
                v.check_text("text", item.text, config.max_text_chars),
                self._now() if item.at is None else v.check_at(item.at),
                v.check_meta(item.meta, config.max_meta_bytes),
            )
        except InvalidInput as exc:
            raise InvalidInput(f"items[{index}].{exc.field}", _reason(exc)) from None

    # -- reads -------------------------------------------------------------------------------

    async def session_history(self, user_id: str, session_id: str, limit: int = 50) -> list[Turn]:
        """The latest ``limit`` turns of a session, oldest first (unknown session: empty).

        Raises:
            InvalidInput: bad ids or limit.
            EngineClosed: the engine is closed.
        """
        self._check_open()
        self._check_ids(user_id, session_id)
        _check_count("limit", limit, 1, 1_000_000)
        return await self._buffer.history(user_id, session_id, limit)

    async def list_sessions(self, user_id: str) -> list[SessionInfo]:
        """The user's sessions, most recently active first (unknown user: empty)."""
        self._check_open()
        self._check_ids(user_id)
        await trio.lowlevel.checkpoint()
        return self._buffer.sessions(user_id)

    async def get_turn(self, user_id: str, turn_id: str) -> Turn | None:
        """One turn by id, with its ``meta``; None if the user has no such turn."""
        self._check_open()
        self._check_ids(user_id)
        v.check_id("turn_id", turn_id, self._config.max_id_chars)
        store = self._store
        await store.wait_committed(store.next_lsn - 1)
        found = (await store.read(read_memories_by_id, user_id, [turn_id])).get(turn_id)
        return found if type(found) is Turn else None

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
            focus: seed 000's focus level 0-5: sets limit, a time window (1 h ... 7 days back)
                and link depth, each overridable by its own argument.
            session_id / since / until / roles / kinds: filters, applied inside each index.
            tags: keep memories carrying any of these tags (a turn's ``meta["tags"]``).
            link_depth: hops along links, both directions (default: the focus level's, else 0).
            budget_tokens: keep the best hits whose text fits (~4 characters a token).

        Returns:
            :class:`Hits` (a list of :class:`Hit`), best first; linked memories follow the
            hits they were reached from; ``degraded`` names legs whose index was incomplete.

        Raises:
            InvalidInput: a bad argument.
        """
        self._check_open()
        self._check_ids(user_id)
        v.check_text("query", query, self._config.max_text_chars)
        if focus is not None and (type(focus) is not int or focus not in FOCUS_LEVELS):
            raise InvalidInput("focus", f"expected an integer from 0 to 5, found {focus!r}")
        settings = focus_settings(focus, self._clock())
        limit = settings["limit"] if limit is None else _check_count("limit", limit, 1, 1000)
        link_depth = (settings["link_depth"] if link_depth is None
                      else _check_count("link_depth", link_depth, 0, 5))
        if since is None:
            since = settings["since"]
        else:
            v.check_at(since, "since")
        if until is not None:
            v.check_at(until, "until")
        if session_id is not None:
            v.check_id("session_id", session_id, self._config.max_id_chars)
        if budget_tokens is not None:
            _check_count("budget_tokens", budget_tokens, 1, 1_000_000)
        degraded = self._degraded()  # before the search: a leg that completes meanwhile
        hits = await self._retriever.recall(  # may or may not have served this query
            user_id, query, limit=limit, session_id=session_id, since=since, until=until,
            roles=_choices("roles", roles, ("user", "assistant", "system", "tool")),
            kinds=_choices("kinds", kinds, ("turn", "episode", "fact", "note")),
            link_depth=link_depth, budget_tokens=budget_tokens, tags=_tags(tags))
        return Hits(hits, degraded + tuple(leg for leg in self._degraded()
                                           if leg not in degraded))

    def _degraded(self) -> tuple[str, ...]:
        """The search legs whose index lacks records the store held when the engine opened:
        a rebuild or a long catch-up is under way (the normal lag of new records is not this;
        the window leg covers it)."""
        legs = ()
        if self._fulltext.catching_up:
            legs += ("bm25",)
        embedded = max(self._embedder.embedded_lsn, self._store.embedded_lsn)
        if embedded < self._open_lsn:
            legs += ("vector",)
        return legs

    async def retrieve_memory(self, user_id: str, query: str, conversation_id: str | None = None,
                              episodic_limit: int = 5, semantic_limit: int = 20,
                              detail: str = "auto", category: str | None = None,
                              min_importance: float = 0.0) -> str:
        """seed 001's ``retrieve_memory``: prompt-ready Markdown, semantic facts first (with
        ``[category]``), then episodic memories with rank, score, key moment and relative time;
        ``detail`` (auto / none / low / high) decides which show their messages. Records a
        pending review of the episodic memories shown (rated when the conversation's next
        assistant turn arrives, or by :meth:`review`).

        Args:
            conversation_id: the session the answer goes to (its next assistant turn rates
                what was shown).
            category / min_importance: which facts the semantic section may show.

        Raises:
            InvalidInput: a bad argument (``episodic_limit`` must be 1-100).
        """
        result = await self.retrieve_memory_raw(user_id, query, conversation_id, episodic_limit,
                                                semantic_limit, detail, category, min_importance)
        return render_markdown(result, self._clock(), detail)

    async def retrieve_memory_raw(self, user_id: str, query: str,
                                  conversation_id: str | None = None, episodic_limit: int = 5,
                                  semantic_limit: int = 20, detail: str = "auto",
                                  category: str | None = None,
                                  min_importance: float = 0.0) -> RetrieveResult:
        """seed 001's raw endpoint: typed ``semantic`` and ``episodic`` lists (no embeddings).
        Encode with ``msgspec.json.encode`` for the seed's JSON shape. Records a pending
        review, as :meth:`retrieve_memory` does."""
        self._check_retrieve(user_id, query, conversation_id, semantic_limit, category,
                             min_importance)
        _check_count("episodic_limit", episodic_limit, 1, 100)
        if detail not in ("auto", "none", "low", "high"):
            raise InvalidInput("detail", "expected one of 'auto', 'none', 'low', 'high', "
                                         f"found {detail!r}")
        forgets = self._forgets
        degraded = self._degraded()
        result = await self._retriever.retrieve(
            user_id, query, conversation_id=conversation_id, episodic_limit=episodic_limit,
            semantic_limit=semantic_limit, category=category, min_importance=min_importance,
            episodic=True)
        if degraded:
            result = msgspec.structs.replace(result, degraded=degraded)
        if forgets == self._forgets:  # a deletion meanwhile: what was shown may be gone
            self._record_pending(user_id, conversation_id, query, result)
        self._count_use(user_id, result)
        return result

    async def context_pre_retrieve(self, user_id: str, query: str,
                                   conversation_id: str | None = None, semantic_limit: int = 20,
                                   category: str | None = None,
                                   min_importance: float = 0.0) -> str:
        """seed 001's ``context_pre_retrieve``: semantic facts only, as Markdown for a system
        prompt; records no pending review."""
        self._check_retrieve(user_id, query, conversation_id, semantic_limit, category,
                             min_importance)
        result = await self._retriever.retrieve(
            user_id, query, conversation_id=conversation_id, episodic_limit=0,
            semantic_limit=semantic_limit, category=category, min_importance=min_importance,
            episodic=False)
        self._count_use(user_id, result)
        return render_markdown(result, self._clock(), "none", episodic=False)

    def _count_use(self, user_id: str, result: RetrieveResult) -> None:
        """Facts shown in a prompt were used: their decay restarts. Queued, not awaited, so
        the reply does not wait for the write (``flush`` does)."""
        if result.semantic and not self._read_only:
            self._facts.touch(user_id, [f.id for f in result.semantic])

    def _check_retrieve(self, user_id: str, query: str, conversation_id: str | None,
                        semantic_limit: int, category: str | None,
                        min_importance: float = 0.0) -> None:
        self._check_open()
        self._check_ids(user_id)
        v.check_text("query", query, self._config.max_text_chars)
        if conversation_id is not None:
            v.check_id("conversation_id", conversation_id, self._config.max_id_chars)
        _check_count("semantic_limit", semantic_limit, 0, 100)
        if category is not None:
            v.check_id("category", category, self._config.max_id_chars)
        _check_fraction("min_importance", min_importance)

    # -- links -------------------------------------------------------------------------------

    async def link(self, user_id: str, from_id: str, to_id: str, type: str = "relates_to",
                   at: datetime | None = None) -> Link:
        """Link two of the user's memories; recall follows links in both directions.

        Raises:
            InvalidInput: an id is not a memory of this user, or the two are the same.
        """
        self._check_open()
        self._check_ids(user_id)
        for field, memory_id in (("from_id", from_id), ("to_id", to_id)):
            v.check_id(field, memory_id, self._config.max_id_chars)
        v.check_id("type", type, self._config.max_id_chars)
        if from_id == to_id:
            raise InvalidInput("to_id", f"expected another memory than from_id, found {to_id!r}")
        at = self._now() if at is None else v.check_at(at)
        # Both memories must be on disk to be found; indexes and vectors are not needed.
        await self._store.wait_committed(self._store.next_lsn - 1)
        found = await self._store.read(read_memories_by_id, user_id, [from_id, to_id])
        for field, memory_id in (("from_id", from_id), ("to_id", to_id)):
            if memory_id not in found:
                raise InvalidInput(field, f"expected the id of a memory of user {user_id!r}, "
                                          f"found none with id {memory_id!r}")
        link = Link(from_id, to_id, type, at.astimezone(timezone.utc))
        await self._store.write_unlogged(PutLink(user_id, link, trio.Event()))
        return link

    async def links(self, user_id: str, memory_id: str) -> list[Link]:
        """Every link touching a memory, in either direction."""
        self._check_open()
        self._check_ids(user_id)
        v.check_id("memory_id", memory_id, self._config.max_id_chars)
        return (await self._store.read(read_links, user_id, [memory_id]))[memory_id]

    # -- rolling session summaries -----------------------------------------------------------

    async def session_summary(self, user_id: str, session_id: str) -> SummaryState | None:
        """The session's rolling summary (seed 003), or None before the first write. Pass its
        ``epoch`` to :meth:`write_session_summary`."""
        self._check_open()
        self._check_ids(user_id, session_id)
        await self._store.wait_committed(self._store.next_lsn - 1)
        return await self._store.read(read_summary, user_id, session_id)

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
        self._check_open()
        self._check_ids(user_id, session_id)
        v.check_text("summary", summary, self._config.max_text_chars)
        turns = self._buffer.next_seq(user_id, session_id)
        if turns is None:
            raise InvalidInput("session_id", f"expected a session of user {user_id!r}, found "
                                             f"none called {session_id!r}")
        _check_count("upper_seq", upper_seq, 0, turns)
        _check_count("expected_epoch", expected_epoch, 0, 2**62)
        state = SummaryState(expected_epoch + 1, summary, upper_seq,
                             self._clock().astimezone(timezone.utc))
        applied: list[bool] = []
        await self._store.write_unlogged(WriteSummary(user_id, session_id, state, expected_epoch,
                                                      trio.Event(), applied.append))
        return applied[0]

    # -- notes -------------------------------------------------------------------------------

    async def store_note(self, user_id: str, text: str, *, note_id: str | None = None,
                         tags: Iterable[str] | None = None) -> Note:
        """Keep a note about the user (seed 003); recall finds it like any other memory.

        Args:
            note_id: the note's id (default: a new one); refused if the user has it already.
            tags: for the recall ``tags`` filter.

        Raises:
            InvalidInput: bad text or tags, or ``note_id`` is taken (use update_note).
        """
        return await self._put_note(user_id, text, note_id, tags, replace=False)

    async def update_note(self, user_id: str, note_id: str, text: str, *,
                          tags: Iterable[str] | None = None) -> Note:
        """Replace a note's text (and tags), keeping its id and creation time.

        Raises:
            InvalidInput: the user has no such note.
        """
        return await self._put_note(user_id, text, note_id, tags, replace=True)

    async def _put_note(self, user_id: str, text: str, note_id: str | None,
                        tags: Iterable[str] | None, replace: bool) -> Note:
        self._check_open()
        self._check_ids(user_id)
        v.check_text("text", text, self._config.max_text_chars)
        if note_id is None:
            note_id = "n_" + new_turn_id()[2:]
        v.check_id("note_id", note_id, self._config.max_id_chars)
        tags = v.check_words("tags", tags)
        now = self._now().astimezone(timezone.utc)
        store = self._store
        await store.reserve(1)
        self._check_open()
        lsn = store.next_lsn
        note = Note(lsn, note_id, user_id, text, tags, now, now)
        outcome: list[tuple[Note | None, str | None, int]] = []

        def committed(result: tuple[Note | None, str | None, int]) -> None:
            outcome.append(result)
            if result[2]:  # the replaced version leaves the vector index in commit order
                self._ann.removed(user_id, [result[2]], False)

        store.submit(PutNote(lsn, note, 1 if replace else -1, committed))
        await store.wait_committed(lsn)
        stored, refused, _ = outcome[0]
        if refused == "exists":
            raise InvalidInput("note_id", f"expected a new note id, found {note_id!r} in use; "
                                          "call update_note to change it")
        if refused == "missing":
            raise InvalidInput("note_id", f"expected the id of a note of user {user_id!r}, "
                                          f"found none with id {note_id!r}")
        return stored

    async def get_note(self, user_id: str, note_id: str) -> Note | None:
        """A note by id; None if the user has no such note."""
        self._check_open()
        self._check_ids(user_id)
        v.check_id("note_id", note_id, self._config.max_id_chars)
        await self._store.wait_committed(self._store.next_lsn - 1)
        found = (await self._store.read(read_memories_by_id, user_id, [note_id])).get(note_id)
        return found if type(found) is Note else None

    async def delete_note(self, user_id: str, note_id: str) -> bool:
        """Delete a note from the store and both indexes; False if there was none."""
        self._check_open()
        self._check_ids(user_id)
        v.check_id("note_id", note_id, self._config.max_id_chars)
        store = self._store
        await store.reserve(1)
        self._check_open()
        lsn = store.next_lsn
        deleted: list[list[int]] = []

        def committed(lsns: list[int]) -> None:
            deleted.append(lsns)
            self._ann.removed(user_id, lsns, False)

        store.submit(DeleteNote(lsn, user_id, note_id, committed))
        await store.wait_committed(lsn)
        if deleted[0]:
            self._scrubber.ask()
        return bool(deleted[0])

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
            The active fact for the key (the new one, or the reinforced one).

        Raises:
            InvalidInput: a bad argument, or an active value with higher confidence exists
                (call :meth:`correct_fact` to replace it anyway).
        """
        candidate = self._candidate(user_id, category, key, value, text, confidence, importance,
                                    keywords)
        valid_at = None if valid_at is None else v.check_at(valid_at, "valid_at")
        outcome = await self._facts.propose(user_id, candidate, origin="api", valid_at=valid_at)
        if outcome.status == "refused":
            rival = outcome.previous
            raise InvalidInput("confidence", f"expected at least the active value's confidence "
                                             f"({rival.confidence:.2f} for {rival.value!r}), "
                                             f"found {confidence:.2f}; call correct_fact to "
                                             "replace it")
        return outcome.fact

    async def correct_fact(self, user_id: str, category: str, key: str, value: str, *,
                           text: str | None = None, importance: float = 0.7,
                           keywords: Iterable[str] = ()) -> Fact:
        """Replace a fact's value whatever the old one's confidence (seed 004's correct_fact):
        the old version is retired with ``invalid_at`` now and kept in the history; the new
        one has confidence 1."""
        candidate = self._candidate(user_id, category, key, value, text, 1.0, importance,
                                    keywords)
        outcome = await self._facts.propose(user_id, candidate, origin="api", force=True)
        return outcome.fact

    async def confirm_fact(self, user_id: str, category: str, key: str) -> Fact:
        """Protect the active fact (seed 004's confirm_fact): confidence 1, never decays, and
        no inferred value supersedes it.

        Raises:
            InvalidInput: the user has no active fact with that category and key.
        """
        self._check_fact_key(user_id, category, key)
        fact = await self._facts.confirm(user_id, category, key)
        if fact is None:
            raise InvalidInput("key", f"expected an active fact ({category!r}, {key!r}) of user "
                                      f"{user_id!r}, found none")
        return fact

    async def forget_fact(self, user_id: str, category: str, key: str) -> bool:
        """Retract the active fact: it leaves recall and the profile, and stays in the history
        as ``retracted``. False if there was none."""
        self._check_fact_key(user_id, category, key)
        return bool(await self._facts.retire(user_id, [(category, key)], "retracted"))

    async def profile(self, user_id: str, *, category: str | None = None,
                      min_importance: float = 0.0) -> list[Fact]:
        """The user's active facts, most important first: the deterministic lookup that
        never misses a standing fact (no search involved)."""
        self._check_open()
        self._check_ids(user_id)
        if category is not None:
            v.check_id("category", category, self._config.max_id_chars)
        _check_fraction("min_importance", min_importance)
        return await self._facts.profile(user_id, category, min_importance)

    async def fact_history(self, user_id: str, category: str, key: str) -> list[Fact]:
        """Every version of a fact, oldest first, with their validity and status."""
        self._check_fact_key(user_id, category, key)
        return await self._facts.history(user_id, category, key)

    def _check_fact_key(self, user_id: str, category: str, key: str) -> None:
        self._check_open()
        self._check_ids(user_id)
        v.check_id("category", category, self._config.max_id_chars)
        v.check_id("key", key, self._config.max_id_chars)

    def _candidate(self, user_id: str, category: str, key: str, value: str, text: str | None,
                   confidence: float, importance: float, keywords: Iterable[str]) -> Candidate:
        self._check_fact_key(user_id, category, key)
        v.check_text("value", value, self._config.max_text_chars)
        if text is not None:
            v.check_text("text", text, self._config.max_text_chars)
        _check_fraction("confidence", confidence)
        _check_fraction("importance", importance)
        words = v.check_words("keywords", keywords)
        return Candidate(category, key, value, text or f"{key}: {value}", float(confidence),
                         float(importance), words)

    # -- episodes and reviews ----------------------------------------------------------------

    async def episodes(self, user_id: str, session_id: str | None = None) -> list[Episode]:
        """The user's episodes (of one session), by session and position."""
        self._check_open()
        self._check_ids(user_id, session_id)
        await self._store.wait_committed(self._store.next_lsn - 1)
        return await self._store.read(read_episodes, user_id, session_id)

    async def close_session(self, user_id: str, session_id: str) -> bool:
        """The session is over: make an episode of its turns not yet in one, now (otherwise
        maintenance does once it has been idle for ``Config.session_idle_seconds``).

        Returns:
            True if an episode was made.
        """
        self._check_open()
        self._check_ids(user_id, session_id)
        turns = self._buffer.next_seq(user_id, session_id)
        if turns is None:
            raise InvalidInput("session_id", f"expected a session of user {user_id!r}, found "
                                             f"none called {session_id!r}")
        return await self._compressor.consolidate(user_id, session_id, turns)

    async def review(self, user_id: str, memory_id: str, rating: str | int) -> ReviewState:
        """Rate how well a shown memory served (FSRS): ``again``/1, ``hard``/2, ``good``/3 or
        ``easy``/4. Its stability and difficulty change, and with them its retrievability,
        which re-ranks it in every later retrieval.

        Raises:
            InvalidInput: a bad rating, or no episode or turn of the user has that id (facts
                do not follow FSRS: confirm or correct them).
        """
        self._check_open()
        self._check_ids(user_id)
        v.check_id("memory_id", memory_id, self._config.max_id_chars)
        if isinstance(rating, bool) or rating not in RATINGS:
            raise InvalidInput("rating", "expected again/hard/good/easy or 1-4, found "
                                         f"{rating!r}")
        store = self._store
        await store.wait_committed(store.next_lsn - 1)
        memory = (await store.read(read_memories_by_id, user_id, [memory_id])).get(memory_id)
        if type(memory) not in (Episode, Turn):
            raise InvalidInput("memory_id", f"expected the id of an episode or turn of user "
                                            f"{user_id!r}, found {memory_id!r}")
        current = (await store.read(read_review_states, user_id, [memory_id])).get(memory_id)
        state = review_state(current or memory_review_state(memory), RATINGS[rating],
                             self._clock().astimezone(timezone.utc))
        key = user_prefix(user_id) + memory_id.encode()
        await store.write_unlogged(PutState(((b"reviews", key, _ENCODE(state), memory.lsn),),
                                            (), trio.Event()))
        return state

    def _record_pending(self, user_id: str, conversation_id: str | None, query: str,
                        result: RetrieveResult) -> None:
        """Remember what a retrieval showed, for the review that rates it (seed 001). Not
        awaited: the reply must not wait for this write."""
        if not result.episodic or self._read_only:
            return
        pending = PendingReview(tuple(i.id for i in result.episodic),
                                tuple(i.summary for i in result.episodic), query,
                                self._clock().astimezone(timezone.utc))
        key = user_prefix(user_id) + (conversation_id or "").encode()
        self._store.submit(PutState(((b"pending", key, _ENCODE(pending), 0),)))

    # -- entities ----------------------------------------------------------------------------

    async def entity_info(self, user_id: str, name: str, limit: int = 20) -> EntityInfo | None:
        """An entity the user's memories mention (by name or alias, any case) and those
        memories, newest first; None if no memory mentions it."""
        self._check_open()
        self._check_ids(user_id)
        v.check_text("name", name, self._config.max_text_chars)
        _check_count("limit", limit, 1, 1000)
        key = name.strip().lower()
        store = self._store
        registry = await store.read(read_entities, user_id, [key])
        found = registry.get(key)
        if found is not None and found.type == "alias":
            found = registry.get(found.aliases[0])
        if found is None:
            return None
        lsns = sorted(found.lsns, reverse=True)
        records = await store.read(read_records, user_id, lsns[: limit * 2])
        memories = [_hit(records[lsn], 1.0, ("entity",)) for lsn in lsns if lsn in records]
        return EntityInfo(entity=found, memories=memories[:limit])

    async def memory_stats(self, user_id: str) -> dict[str, Any]:
        """Counts of the user's memories by kind (turns, episodes, active facts, notes,
        entities) and when the latest turn was said (seed 004's memory_stats)."""
        self._check_open()
        self._check_ids(user_id)
        await self._store.wait_committed(self._store.next_lsn - 1)
        counts = await self._store.read(read_user_counts, user_id)
        return msgspec.to_builtins(counts)

    # -- maintenance and tools ---------------------------------------------------------------

    async def maintain(self) -> MaintenanceReport:
        """Run one maintenance pass now (it also runs every ``Config.maintenance_seconds``)."""
        self._check_open()
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
        self._check_open()
        return await call_tool(self, name, arguments)

    # -- deletion ----------------------------------------------------------------------------

    async def forget_session(self, user_id: str, session_id: str) -> None:
        """Delete a session and all its turns; returns once the deletion is on disk (the
        next ``flush`` returns once its bytes have left the index files too)."""
        self._check_open()
        self._check_ids(user_id, session_id)
        self._forgets += 1
        self._buffer.drop_session(user_id, session_id)
        self._embedder.forget_texts()
        self._compressor.forget(user_id, session_id)
        await self._store.forget(
            user_id, session_id, lambda lsns: self._ann.removed(user_id, lsns, False))
        self._scrubber.ask()
        self._facts.forget(user_id)  # facts extracted from the session went with it
        self._entities.forget(user_id)  # ...and entities only it mentioned

    async def forget_user(self, user_id: str) -> None:
        """Delete everything of a user; returns once the deletion is on disk (the next
        ``flush`` returns once its bytes have left the index files too)."""
        self._check_open()
        self._check_ids(user_id)
        self._forgets += 1
        self._buffer.drop_user(user_id)
        self._embedder.forget_user(user_id)
        self._compressor.forget(user_id, None)
        await self._store.forget(user_id, None, lambda lsns: self._ann.removed(user_id, lsns, True))
        self._scrubber.ask()
        self._facts.forget(user_id)
        self._entities.forget(user_id)

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
        self._check_open()
        if isinstance(texts, str) or not isinstance(texts, (list, tuple)):
            raise InvalidInput("texts", f"expected a list of strings, found {type(texts).__name__}"
                               + ("; wrap one text in a list: [text]" if isinstance(texts, str)
                                  else ""))
        for i, text in enumerate(texts):
            if type(text) is not str:
                raise InvalidInput(f"texts[{i}]", f"expected a string, found {type(text).__name__}")
        return await self._embedder.embed(list(texts))

    # -- snapshots ---------------------------------------------------------------------------

    async def snapshot(self, dest: str | os.PathLike[str]) -> Manifest:
        """Write a point-in-time snapshot of the store to ``dest`` while the engine serves.

        The text index is copied (or, if its segments still hold deleted documents, built
        afresh from the copy), then LMDB is copied compactly from a worker thread; the manifest
        records the log sequence number it is consistent at, counts and sha256 checksums.
        Nothing of a user forgotten before the call is in any of its files.

        Args:
            dest: a new or empty directory.

        Returns:
            The :class:`Manifest` also written to ``dest/manifest.json``.

        Raises:
            InvalidInput: ``dest`` has files in it.
        """
        self._check_open()
        if not isinstance(dest, (str, os.PathLike)):
            raise InvalidInput("dest", f"expected a directory path, found {type(dest).__name__}")
        return await take_snapshot(self, Path(dest))

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
                (over every file's sha256 and the chain head) must match under it. Either way
                the hash chain of the snapshot's store is checked link by link up to the head
                the manifest names before it is installed (``engram-trio verify`` checks every
                record as well).

        Raises:
            InvalidInput: no snapshot there, or ``store_path`` holds files and not ``overwrite``.
            StoreIncompatible: the snapshot is damaged (a checksum differs) or too new.
            StoreTampered: its manifest's MAC fails under the key (or it has none), or its
                store's hash chain breaks.
            StoreInUse: an engine serves the store at ``store_path``; nothing was replaced.
        """
        return await restore(Path(snapshot_dir), Path(store_path), overwrite, progress,
                             integrity_key)

    @staticmethod
    async def verify(store_path: str | os.PathLike[str], *, integrity_key: str | None = None,
                     seal: bool = False) -> dict[str, Any]:
        """Check a whole store: every record's checksum, the hash chain from the first log
        position to the head (and the head's MAC, with the key), that every removed record
        is covered by a logged removal, and that every session's turns run without gaps. It
        reads one consistent state, so it may run beside a serving engine (not with ``seal``).

        Args:
            store_path: the store directory.
            integrity_key: the key the store is sealed with (without it the MAC is unchecked).
            seal: if the store verifies and is not sealed yet, MAC its head with the key (the
                store must be closed); from then on it opens only with that key.

        Returns:
            A report: ``ok``, ``problems`` (``where`` and ``what`` of each break), counts.

        Raises:
            InvalidInput: no store there, or ``seal`` without a key.
        """
        return await trio.to_thread.run_sync(verify_store, Path(store_path), integrity_key, seal)

    @staticmethod
    async def compact(store_path: str | os.PathLike[str]) -> dict[str, Any]:
        """Rewrite a closed store without freed pages (LMDB keeps deleted records' bytes in
        them) and rebuild its text index if deleted documents linger in its segments.

        Raises:
            StoreInUse: an engine has the store open (the message names its pid).
        """
        return await trio.to_thread.run_sync(compact, Path(store_path))

    # -- upkeep ------------------------------------------------------------------------------

    async def flush(self) -> None:
        """Return once everything acknowledged before the call is on disk and in every index
        (the vector index too, with background embedding on), and the long-term layer has
        taken it in: its facts extracted, its entities registered, the episodes it completes
        made, and those indexed too. What forgets and deleted notes removed before the call
        has left the text index and the saved graphs by then (see ``engine/_forget.py``).

        Raises:
            RecordRefused: a record logged before the call could not be written (its lsn and
                id; the others were); raised by one flush only. A record a background part
                failed on is not raised: it is in :meth:`failures`.
        """
        self._check_open()
        if self._read_only:  # nothing acknowledged here; the owner indexes, not this engine
            await trio.lowlevel.checkpoint()
            return
        target = self._store.next_lsn - 1
        await self._store.wait_written()  # logged or not: use counts and reviews too
        for follower in self._followers:
            await follower.wait(target)
        target = self._store.next_lsn - 1  # what the long-term layer derived meanwhile
        await self._store.wait_written()
        await self._fulltext.wait_indexed(target)
        if self._config.background_embedding:
            await self._embedder.wait_embedded(target)
        await self._scrubber.wait()  # what forgets and deleted notes removed left every file
        refused = self._store.take_refused(target)
        if refused:
            first = refused[0]
            more = f" (and {len(refused) - 1} more: see Engine.failures)" if len(refused) > 1 else ""
            raise RecordRefused(first.lsn, f"{_reason(first)}{more}", first.memory_id)

    async def stats(self) -> Stats:
        """Counts and positions; cheap enough to call from a health check."""
        self._check_open()
        await trio.lowlevel.checkpoint()
        users, sessions, turns, live = self._buffer.counts()
        store = self._store
        data = store.path / "data.mdb"
        failures = await store.read(count_failures)
        embedded = max(self._embedder.embedded_lsn, store.embedded_lsn)
        return Stats(
            users=users,
            sessions=sessions,
            turns=turns,
            last_lsn=store.next_lsn - 1,
            committed_lsn=store.committed_lsn,
            queued=store.queued,
            live_windows=live,
            store_bytes=data.stat().st_size if data.exists() else 0,
            map_bytes=store.map_size(),
            schema_version=SCHEMA_VERSION,
            model=self._embedder.model.id,
            embedded_lsn=embedded,
            indexed_lsn=self._fulltext.indexed_lsn,
            failures=failures,
            degraded=self._degraded(),
            read_only=self._read_only,
            vector_lag_records=store.next_lsn - 1 - embedded,
            vector_lag_seconds=store.committed_since(embedded + 1),
            texts_embedded=self._embedder.texts_embedded,
            embed_cache_hits=self._embedder.cache_hits,
        )

    async def failures(self, user_id: str | None = None) -> list[Failure]:
        """The records some part of the engine could not take (a write the store refused, a
        record the text index or a long-term follower failed on), by lsn. Each part went on
        without that record; the rest of the store is whole.

        Args:
            user_id: only this user's (default: everyone's).

        Raises:
            InvalidInput: a bad user id.
        """
        self._check_open()
        if user_id is not None:
            self._check_ids(user_id)
        await self._store.wait_written()
        return await self._store.read(read_failures, user_id)

    # -- helpers -----------------------------------------------------------------------------

    def _now(self) -> datetime:
        """The engine clock's time, checked as a caller's ``at`` would be: the clock is the
        caller's too, and a time the text index cannot hold must not reach the store."""
        return v.check_at(self._clock(), "clock")

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosed("the engine is closed; open a new one with Engine.open(path)")
        self._store.check_usable()

    def _check_ids(self, user_id: Any, session_id: Any = None) -> None:
        v.check_id("user_id", user_id, self._config.max_id_chars)
        if session_id is not None:
            v.check_id("session_id", session_id, self._config.max_id_chars)


_BULK_CHUNK = 1024  # turns appended per step of add_turns: under ~10 ms of loop time each


async def _in_scope(scope: trio.CancelScope, task: Callable[..., Any], *args: Any,
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Run a background task under its own cancel scope, so close can stop it first."""
    with scope:
        await task(*args, task_status=task_status)


_ENCODE = msgspec.msgpack.Encoder().encode


def _check_fraction(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise InvalidInput(field, f"expected a number from 0 to 1, found {value!r}")
    return float(value)


def _check_count(field: str, value: Any, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise InvalidInput(field, f"expected an integer from {low} to {high}, found {value!r}")
    return value


def _choices(field: str, values: Iterable[str] | None,
             allowed: tuple[str, ...]) -> tuple[str, ...] | None:
    if values is None:
        return None
    if isinstance(values, str):
        values = (values,)
    try:
        values = tuple(values)
    except TypeError:
        raise InvalidInput(field, f"expected a list of {', '.join(allowed)}, found "
                                  f"{type(values).__name__}") from None
    for value in values:
        if value not in allowed:
            raise InvalidInput(field, f"expected values among {', '.join(allowed)}, "
                                      f"found {value!r}")
    return values or None


def _tags(tags: Iterable[str] | None) -> tuple[str, ...] | None:
    return v.check_words("tags", tags) or None


def _reason(exc: InvalidInput) -> str:
    return str(exc).split(": ", 1)[1]


def _translate(group: BaseExceptionGroup, body_error: BaseException | None) -> BaseException:
    """One error out of the engine's nursery: the caller's own, or EngineBroken from the group."""
    real = group.subgroup(lambda e: not isinstance(e, trio.Cancelled))
    if real is None:
        return group  # pure cancellation: trio's cancel scopes take it from here
    leaves = list(_leaves(real))
    if body_error is not None and all(e is body_error for e in leaves):
        return body_error
    if all(not isinstance(e, Exception) and type(e).__name__ != "PanicException"
           for e in leaves):
        # KeyboardInterrupt and the like pass through untouched; a native library's panic
        # (pyo3's PanicException, a BaseException) is the engine breaking, not the caller.
        return group
    damage = [e for e in leaves if isinstance(e, StoreCorrupt)]
    if damage:
        # A part found the store damaged; the other failures are its fallout (the store
        # closing under them). Say that, naming the first place; the group is the cause.
        first = damage[0]
        damaged = (StoreTampered(str(first), first.database, first.key, first.lsn)
                   if isinstance(first, StoreTampered)
                   else StoreCorrupt(str(first), first.database, first.key))
        damaged.__cause__ = group
        return damaged
    broken = EngineBroken(f"the engine failed: {'; '.join(repr(e) for e in leaves)}")
    broken.__cause__ = group
    return broken


def _leaves(group: BaseExceptionGroup) -> Iterable[BaseException]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc
