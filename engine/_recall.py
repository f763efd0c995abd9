"""The retrieval entry points: ``recall``, ``retrieve_memory(_raw)`` and ``context_pre_retrieve``
as the facade takes them. Each checks its arguments, resolves the focus level, runs the
pipeline (``_retrieval.py``) or seed 001's sections over it (``_briefing.py``), flags the legs
whose index was incomplete, and records what it showed: a pending review of the episodes, a
use of the facts (both queued, never awaited: the reply does not wait for a write). On a
cluster node (:func:`recorded_by`) what a read records is a log entry instead, applied by
:func:`record_shown` on every node that applies the log.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import timezone
from typing import Any

import msgspec

from actors.base import validate as v
from actors.base.errors import InvalidInput
from actors.base.messages import PutState
from actors.base.records import PendingReview
from actors.base.where import Node, category_in, conjunction
from actors.base.where import parse as parse_where
from actors.store import read_memories_by_id, user_prefix

from ._args import check_count, check_fraction, check_labels, choices, shown, words
from ._briefing import Briefing, render_markdown
from ._hits import Hits, RetrieveResult
from ._parts import Parts
from ._retrieval import FOCUS_LEVELS, LEGS, Retriever, focus_settings

__all__ = ["Recall", "count_use", "record_shown", "recorded_by"]

_ENCODE = msgspec.msgpack.Encoder().encode
ROLES = ("user", "assistant", "system", "tool")
KINDS = ("turn", "episode", "fact", "note")
MAX_SHOWN = 1_000  # ids a logged record_shown may name (a read shows at most a few hundred)

# Set by a cluster node around a read it answers (:func:`recorded_by`): what the read would
# record goes there, as a logged ``record_shown``'s arguments, instead of to this store.
_recording: ContextVar[Callable[[str, dict[str, Any]], None] | None] = ContextVar(
    "engram_recording", default=None)


@contextmanager
def recorded_by(publish: Callable[[str, dict[str, Any]], None]) -> Iterator[None]:
    """Within the block, a read of this task records nothing in the store: it hands
    ``publish`` the user id and the arguments of :func:`record_shown` (once per read, if it
    showed anything to record), to log. ``publish`` must not block: the reply waits for it."""
    token = _recording.set(publish)
    try:
        yield
    finally:
        _recording.reset(token)


def count_use(parts: Parts, user_id: str, fact_ids: list[str]) -> None:
    """Facts shown in a prompt were used: their decay restarts, queued, not awaited, so the
    reply does not wait for the write (``flush`` does); on a cluster node
    (:func:`recorded_by`) handed to be logged as a ``record_shown`` instead."""
    if not fact_ids or parts.read_only:
        return
    publish = _recording.get()
    if publish is None:
        parts.facts.touch(user_id, fact_ids)
    else:
        publish(user_id, {"fact_ids": list(fact_ids)})


async def record_shown(parts: Parts, user_id: Any, *, conversation_id: Any = None,
                       query: Any = "", memory_ids: Any = (), texts: Any = (),
                       fact_ids: Any = ()) -> None:
    """Record what a read on a cluster node showed, as the read itself records it on a
    single node: a pending review of the episodic memories (``memory_ids`` with their
    ``texts``, found by ``query``, for ``conversation_id``'s next reply to rate) and a use of
    the facts (``fact_ids``: their decay restarts). A cluster's applier runs it for a logged
    ``record_shown`` entry, with the engine's clock reading the entry's time; it is no
    engine method (a caller would forge reviews with it).

    Every node that applies the entry writes the same: memories gone by the entry's place in
    the log are left out (none left: no pending review), the facts are read from the store
    when they are not cached, and the review and the uses go in one write.

    Raises:
        InvalidInput: a bad argument (ids, a summary per memory id, a query if any memory).
    """
    parts.check_open()
    parts.check_ids(user_id)
    if conversation_id is not None:
        parts.check_id("conversation_id", conversation_id)
    memory_ids = _shown_ids(parts, "memory_ids", memory_ids)
    fact_ids = _shown_ids(parts, "fact_ids", fact_ids)
    if (not isinstance(texts, list | tuple) or len(texts) != len(memory_ids)
            or any(type(t) is not str for t in texts)):
        raise InvalidInput("texts", f"expected a list of {len(memory_ids)} summaries (str), "
                                    f"one per memory id, found {_cut(texts)}")
    puts: tuple[tuple[bytes, bytes, bytes | None, int], ...] = ()
    if memory_ids:
        parts.check_text("query", query)
        await parts.committed()  # the memories shown, as the log held them before the entry
        found = await parts.store.read(read_memories_by_id, user_id, memory_ids)
        kept = [(m, t) for m, t in zip(memory_ids, texts, strict=True) if m in found]
        if kept:
            pending = PendingReview(tuple(m for m, _ in kept), tuple(t for _, t in kept),
                                    query, parts.clock().astimezone(timezone.utc))
            key = user_prefix(user_id) + (conversation_id or "").encode()
            puts = ((b"pending", key, _ENCODE(pending), 0),)
    await parts.facts.count_use(user_id, fact_ids, puts)


def _shown_ids(parts: Parts, field: str, value: Any) -> list[str]:
    if not isinstance(value, list | tuple) or len(value) > MAX_SHOWN:
        raise InvalidInput(field, f"expected a list of at most {MAX_SHOWN} ids, found "
                                  f"{_cut(value)}")
    return [parts.check_id(f"{field}[{i}]", item) for i, item in enumerate(value)]


def _cut(value: Any) -> str:
    """A found value for an error message, cut short."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class Recall:
    """The facade's retrieval methods, over one retriever and its briefing."""

    def __init__(self, parts: Parts, retriever: Retriever, briefing: Briefing) -> None:
        self._parts = parts
        self._retriever = retriever
        self._briefing = briefing

    async def recall(self, user_id: Any, query: Any, limit: Any, *, focus: Any,
                     session_id: Any, since: Any, until: Any, roles: Iterable[str] | None,
                     kinds: Iterable[str] | None, tags: Iterable[str] | None, link_depth: Any,
                     budget_tokens: Any, legs: Iterable[str] | None = None,
                     link_types: Iterable[str] | None = None, where: Any = None,
                     category: Any = None, min_importance: Any = None,
                     emotion: Any = None, as_of: Any = None, agent_id: Any = None,
                     run_id: Any = None) -> Hits:
        parts = self._parts
        parts.check_open()
        parts.check_lookup_ids(user_id)
        parts.check_text("query", query)
        if focus is not None and (type(focus) is not int or focus not in FOCUS_LEVELS):
            raise InvalidInput("focus", f"expected an integer from 0 to 5, found {focus!r}")
        # Times in UTC from here on: two times of one zone compare by their wall clocks, and in
        # a DST fall-back hour the earlier of two can read later (fold).
        if as_of is not None:
            as_of = v.check_at(as_of, "as_of").astimezone(timezone.utc)
        now = parts.clock()
        # The focus level's window reaches back from the time the answer is given as of.
        settings = focus_settings(focus, now if as_of is None else min(now, as_of))
        limit = settings["limit"] if limit is None else check_count("limit", limit, 1, 1000)
        link_depth = (settings["link_depth"] if link_depth is None
                      else check_count("link_depth", link_depth, 0, 5))
        if since is not None:
            since = v.check_at(since, "since").astimezone(timezone.utc)
        if until is not None:
            until = v.check_at(until, "until").astimezone(timezone.utc)
            if since is not None and until < since:
                raise InvalidInput("until", f"expected a time at or after since "
                                            f"({since.isoformat()}), found {until.isoformat()}")
        if since is None:
            since = settings["since"]
        if session_id is not None:
            parts.check_lookup_id("session_id", session_id)
        if budget_tokens is not None:
            check_count("budget_tokens", budget_tokens, 1, 1_000_000)
        compiled = conjunction(None if where is None else parse_where(where),
                               *self._seed_filters(category, min_importance, emotion),
                               *self._scope_filters(agent_id, run_id))
        tags = words("tags", tags)
        masked = tags is not None or compiled is not None  # the text index masks other legs
        degraded = parts.degraded(masked)  # before the search: a leg that completes meanwhile
        hits = await self._retriever.recall(  # may or may not have served this query
            user_id, query, limit=limit, session_id=session_id, since=since, until=until,
            roles=choices("roles", roles, ROLES), kinds=choices("kinds", kinds, KINDS),
            link_depth=link_depth, budget_tokens=budget_tokens, tags=tags,
            legs=choices("legs", legs, LEGS) or LEGS,
            link_types=words("link_types", link_types), where=compiled,
            as_of=as_of)
        return Hits(hits, _during(degraded, parts.degraded(masked)))

    def _scope_filters(self, agent_id: Any, run_id: Any) -> list[Node]:
        """mem0's scopes as ``where`` conditions (inside every leg, like any filter)."""
        return [Node("eq", ("f", field), self._parts.check_lookup_id(field, value))
                for field, value in (("agent_id", agent_id), ("run_id", run_id))
                if value is not None]

    def _seed_filters(self, category: Any, min_importance: Any, emotion: Any) -> list[Node]:
        """Seed 000's filters as ``where`` conditions (importance filters, never ranks: seed
        000 ranks by similarity alone)."""
        nodes = []
        if category is not None:
            items = [category] if isinstance(category, str) else category
            if not isinstance(items, list | tuple) or not items or not all(
                    type(c) is str for c in items):
                raise InvalidInput("category", "expected a category or a non-empty list of "
                                               f"them, found {shown(category)}")
            nodes.append(category_in(tuple(self._parts.check_lookup_id("category", c)
                                           for c in items)))
        if min_importance is not None:
            nodes.append(Node("gte", ("f", "importance"),
                              check_fraction("min_importance", min_importance)))
        labels = check_labels("emotion", emotion)
        if labels is not None:
            nodes.append(Node("in", ("f", "emotion"), labels))
        return nodes

    async def retrieve_memory(self, user_id: Any, query: Any, conversation_id: Any,
                              episodic_limit: Any, semantic_limit: Any, detail: Any,
                              category: Any, min_importance: Any,
                              legs: Iterable[str] | None = None, record: bool = True) -> str:
        result = await self.retrieve_memory_raw(user_id, query, conversation_id,
                                                episodic_limit, semantic_limit, detail,
                                                category, min_importance, legs, record)
        return render_markdown(result, self._parts.clock(), detail)

    async def retrieve_memory_raw(self, user_id: Any, query: Any, conversation_id: Any,
                                  episodic_limit: Any, semantic_limit: Any, detail: Any,
                                  category: Any, min_importance: Any,
                                  legs: Iterable[str] | None = None,
                                  record: bool = True) -> RetrieveResult:
        parts = self._parts
        self._check(user_id, query, conversation_id, semantic_limit, category, min_importance)
        check_count("episodic_limit", episodic_limit, 1, 100)
        if type(record) is not bool:
            raise InvalidInput("record", f"expected True or False, found {record!r}")
        legs = choices("legs", legs, LEGS)
        if detail not in ("auto", "none", "low", "high"):
            raise InvalidInput("detail", "expected one of 'auto', 'none', 'low', 'high', "
                                         f"found {detail!r}")
        forgets = parts.forgets
        degraded = parts.degraded()
        result = await self._briefing.retrieve(
            user_id, query, conversation_id=conversation_id, episodic_limit=episodic_limit,
            semantic_limit=semantic_limit, category=category, min_importance=min_importance,
            episodic=True, legs=legs)
        degraded = _during(degraded, parts.degraded())
        if degraded:
            result = msgspec.structs.replace(result, degraded=degraded)
        if not record:  # a look, not a use: nothing to rate, no decay restarted
            return result
        # A deletion meanwhile: what was shown may be gone, so no review of it.
        self._record(user_id, conversation_id, query, result, forgets == parts.forgets)
        return result

    async def context_pre_retrieve(self, user_id: Any, query: Any, conversation_id: Any,
                                   semantic_limit: Any, category: Any,
                                   min_importance: Any) -> str:
        self._check(user_id, query, conversation_id, semantic_limit, category, min_importance)
        result = await self._briefing.retrieve(
            user_id, query, conversation_id=conversation_id, episodic_limit=0,
            semantic_limit=semantic_limit, category=category, min_importance=min_importance,
            episodic=False)
        self._record(user_id, conversation_id, query, result, False)
        return render_markdown(result, self._parts.clock(), "none", episodic=False)

    def _check(self, user_id: Any, query: Any, conversation_id: Any, semantic_limit: Any,
               category: Any, min_importance: Any) -> None:
        parts = self._parts
        parts.check_open()
        parts.check_ids(user_id)
        parts.check_text("query", query)
        if conversation_id is not None:
            parts.check_id("conversation_id", conversation_id)
        check_count("semantic_limit", semantic_limit, 0, 100)
        if category is not None:
            parts.check_id("category", category)
        check_fraction("min_importance", min_importance)

    def _record(self, user_id: str, conversation_id: str | None, query: str,
                result: RetrieveResult, review: bool) -> None:
        """Record what a read showed: a pending review of its episodic memories (if
        ``review``) and a use of its facts; or, on a cluster node (:func:`recorded_by`),
        hand them to be logged as one ``record_shown``."""
        publish = _recording.get()
        if publish is None:
            if review:
                self._record_pending(user_id, conversation_id, query, result)
            count_use(self._parts, user_id, [f.id for f in result.semantic])
            return
        args: dict[str, Any] = {}
        if review and result.episodic:
            args.update(conversation_id=conversation_id, query=query,
                        memory_ids=[i.id for i in result.episodic],
                        texts=[i.summary for i in result.episodic])
        if result.semantic:
            args["fact_ids"] = [f.id for f in result.semantic]
        if args and not self._parts.read_only:
            publish(user_id, args)

    def _record_pending(self, user_id: str, conversation_id: str | None, query: str,
                        result: RetrieveResult) -> None:
        """Remember what a retrieval showed, for the review that rates it (seed 001). Not
        awaited: the reply must not wait for this write."""
        parts = self._parts
        if not result.episodic or parts.read_only:
            return
        pending = PendingReview(tuple(i.id for i in result.episodic),
                                tuple(i.summary for i in result.episodic), query,
                                parts.clock().astimezone(timezone.utc))
        key = user_prefix(user_id) + (conversation_id or "").encode()
        parts.store.submit(PutState(((b"pending", key, _ENCODE(pending), 0),)))


def _during(before: tuple[str, ...], after: tuple[str, ...]) -> tuple[str, ...]:
    """The legs degraded at any point of a search: before it (a leg that completed meanwhile
    may or may not have served it) or after it (one that broke meanwhile)."""
    return before + tuple(leg for leg in after if leg not in before)
