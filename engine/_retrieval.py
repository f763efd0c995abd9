"""The retrieval pipeline: what a bot calls before every reply.

1. Embed the query once (an LRU cache keyed by user and text).
2. In parallel: the vector leg (AnnIndex), the BM25 leg (FullText), the entity leg (memories
   mentioning an entity the query names, newest first, from the entity registry) and the window
   leg (turns acknowledged but not yet indexed, from the RAM windows, scored by shared terms).
3. Fuse the legs by reciprocal rank (k = 60); each leg brings CANDIDATES_PER_LEG candidates, so
   a keyword-only or vector-only hit still reaches the result.
4. Re-rank episodes by FSRS retrievability (score x retrievability, seed 001), and drop turns
   that a higher-ranked episode or fact already stands for.
5. Expand along links, breadth-first in both directions, to the focus level's depth.
6. Pack into a token budget and return typed hits (rendered as Markdown by ``retrieve_memory``).

Every leg is restricted to the user inside its index; records are then fetched from the store
by lsn with the user's key prefix checked once more.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from typing import Any, Literal

import msgspec
import trio

from actors.ann_index import AnnIndex, Filters
from actors.embedder import Embedder
from actors.fulltext import FullText, TextFilters
from actors.session_buffer import SessionBuffer
from actors.entities import Entities, extract_entities
from actors.episodic import memory_review_state, retrievability
from actors.facts import Facts
from actors.store import (
    Store,
    read_entities,
    read_links,
    read_memories_by_id,
    read_records,
    read_review_states,
    read_session_turns,
    read_turn_contexts,
    turn_tags,
)

from ._records import Episode, Fact, Note, Turn

__all__ = ["Hit", "Message", "EpisodicItem", "SemanticItem", "RetrieveResult", "FOCUS_LEVELS",
           "Retriever", "estimate_tokens"]

RRF_K = 60  # reciprocal rank fusion constant (Cormack et al.; seed 001)
CANDIDATES_PER_LEG = 100  # per leg before fusion, as in seed 001 (BM25 100, vector 100)
LINK_DECAY = 0.5  # a linked memory scores this fraction of the memory it was reached from
TAGGED_LIMIT = 100_000  # records a tag filter can admit to the vector leg

# Seed 000's focus levels: results, time window, link depth.
FOCUS_LEVELS = {
    0: {"limit": 2, "hours": 1, "link_depth": 0},
    1: {"limit": 5, "hours": 4, "link_depth": 1},
    2: {"limit": 8, "hours": 12, "link_depth": 1},
    3: {"limit": 10, "hours": 24, "link_depth": 2},
    4: {"limit": 15, "hours": 72, "link_depth": 3},
    5: {"limit": 20, "hours": 168, "link_depth": 3},
}


def estimate_tokens(text: str) -> int:
    """Prompt tokens a text costs: ~4 characters a token for English with a BPE tokenizer."""
    return max(1, (len(text) + 3) // 4)


class Hit(msgspec.Struct, frozen=True, kw_only=True):
    """One recalled memory.

    Attributes:
        id: the memory's id (a turn id for a turn).
        kind: turn, episode, fact or note.
        text: its text.
        score: fused score (higher is better); linked memories get a decayed share.
        session_id: the session it belongs to ("" for a note: notes belong to the user).
        at: when it was said or made.
        turn_ids: the turns it stands for (itself, for a turn).
        role: who said it (turns).
        via: the legs that found it: ``vector``, ``bm25``, ``window``, ``link``.
    """

    id: str
    kind: str
    text: str
    score: float
    session_id: str
    at: datetime
    turn_ids: tuple[str, ...]
    role: str | None = None
    via: tuple[str, ...] = ()


class Message(msgspec.Struct, frozen=True):
    role: str
    content: str


class SemanticItem(msgspec.Struct, frozen=True, kw_only=True):
    """A structured fact, in seed 001's raw shape (facts arrive with the long-term layer)."""

    id: str
    conversation_id: str | None
    category: str
    fact: str
    keywords: list[str]
    source_episodic_ids: list[str]
    valid_at: datetime | None
    invalid_at: datetime | None
    score: float


class EpisodicItem(msgspec.Struct, frozen=True, kw_only=True):
    """An episodic memory in seed 001's raw shape (no embedding). Until episodes exist, each
    recalled turn is one, with its neighbouring turns as ``messages``."""

    id: str
    conversation_id: str
    messages: list[Message]
    title: str
    summary: str
    stability: float
    difficulty: float
    surprise: float
    start_at: datetime
    end_at: datetime
    created_at: datetime
    last_reviewed_at: datetime | None
    consolidated_at: datetime | None
    score: float
    kind: str = "turn"


class RetrieveResult(msgspec.Struct, frozen=True):
    """What ``retrieve_memory_raw`` returns: seed 001's ``semantic`` and ``episodic`` lists."""

    semantic: list[SemanticItem]
    episodic: list[EpisodicItem]


Detail = Literal["auto", "none", "low", "high"]
KEY_MOMENT = 0.7  # surprise at or above which an episode is a "key moment" (seed 001)


class Retriever:
    """The pipeline over the engine's actors. Runs in the caller's task; holds no state of its
    own beyond references."""

    def __init__(self, store: Store, buffer: SessionBuffer, embedder: Embedder, ann: AnnIndex,
                 fulltext: FullText, facts: Facts, entities: Entities, clock: Any) -> None:
        self.store, self.buffer, self.embedder = store, buffer, embedder
        self.ann, self.fulltext, self.facts, self.entities = ann, fulltext, facts, entities
        self.clock = clock

    async def recall(self, user_id: str, query: str, *, limit: int, session_id: str | None,
                     since: datetime | None, until: datetime | None,
                     roles: tuple[str, ...] | None, kinds: tuple[str, ...] | None,
                     link_depth: int, budget_tokens: int | None,
                     tags: tuple[str, ...] | None = None,
                     only: list[int] | None = None,
                     legs: tuple[str, ...] = ("vector", "bm25", "entity", "window")
                     ) -> list[Hit]:
        """The pipeline; arguments are validated by the facade. ``only``: these lsns and no
        others (the facts a category or importance filter admits), applied in every index."""
        ranked: dict[str, list[int]] = {}
        text_filters = TextFilters(session_id, since, until, roles, kinds, tags, only)

        async def vector_leg() -> None:
            vector = await self.embedder.embed_query(query, user_id)
            # Tags live in the text index's term lists; they become the vector search's mask.
            lsns = (None if tags is None
                    else await self.fulltext.tagged(user_id, tags, TAGGED_LIMIT))
            if only is not None:
                lsns = only if lsns is None else sorted(set(lsns) & set(only))
            filters = Filters(session_id, since, until, roles, kinds, lsns)
            found = await self.ann.search(user_id, vector, CANDIDATES_PER_LEG, filters)
            ranked["vector"] = [lsn for lsn, _ in found]

        async def bm25_leg() -> None:
            found = await self.fulltext.search(user_id, query, CANDIDATES_PER_LEG, text_filters)
            ranked["bm25"] = [lsn for lsn, _ in found]

        async def entity_leg() -> None:
            known = await self.entities.keys(user_id)
            names = [name for name in _entity_keys(query) if name in known]
            if not names:
                return
            registry = await self.store.read(read_entities, user_id, names)
            lsns = sorted({lsn for e in registry.values() if e.type != "alias"
                           for lsn in e.lsns}, reverse=True)
            if lsns:
                ranked["entity"] = lsns[:CANDIDATES_PER_LEG]

        async with trio.open_nursery() as nursery:
            if "vector" in legs:
                nursery.start_soon(vector_leg)
            if "bm25" in legs:
                nursery.start_soon(bm25_leg)
            if "entity" in legs and only is None:
                nursery.start_soon(entity_leg)
            if "window" in legs:
                ranked["window"] = self._window_leg(user_id, query, session_id, since, until,
                                                    roles, kinds, tags)
        fused = fuse(ranked)
        records = await self.store.read(read_records, user_id,
                                        [lsn for lsn, _, _ in fused[: limit * 3]])
        hits: list[Hit] = []
        allowed = None if only is None else set(only)
        for lsn, score, via in fused:
            memory = records.get(lsn) or self.buffer.recent_turn(user_id, lsn)
            if (memory is None or (allowed is not None and lsn not in allowed)
                    or not _matches(memory, session_id, since, until, roles, kinds, tags)):
                continue  # deleted since it was indexed, or not quite what the filter asked
            hits.append(_hit(memory, score, via))
            if len(hits) == limit * 2:
                break
        hits = _dedupe(await self._rerank(user_id, hits, records))[:limit]
        if link_depth > 0 and hits:
            hits += await self._expand(user_id, hits, link_depth)
        return pack(hits, budget_tokens)

    async def _rerank(self, user_id: str, hits: list[Hit], records: dict[int, Any]
                      ) -> list[Hit]:
        """Episodes: score x FSRS retrievability (seed 001); others keep their fused score."""
        shown = {h.id for h in hits}
        episodes = {m.episode_id: m for m in records.values()
                    if type(m) is Episode and m.episode_id in shown}
        if not episodes:
            return hits
        states = await self.store.read(read_review_states, user_id, list(episodes))
        now = self.clock()
        out = []
        for hit in hits:
            episode = episodes.get(hit.id)
            if episode is not None:
                state = states.get(hit.id) or memory_review_state(episode)
                r = retrievability(state.stability, state.last_review, now)
                hit = msgspec.structs.replace(hit, score=hit.score * r)
            out.append(hit)
        out.sort(key=lambda h: -h.score)
        return out

    def _window_leg(self, user_id: str, query: str, session_id: str | None,
                    since: datetime | None, until: datetime | None,
                    roles: tuple[str, ...] | None, kinds: tuple[str, ...] | None,
                    tags: tuple[str, ...] | None) -> list[int]:
        """Turns acknowledged but not yet in the text index, ranked by terms shared with the
        query, then recency: read-your-writes for recall."""
        if kinds is not None and "turn" not in kinds:
            return []
        terms = set(self.fulltext.terms(query))
        if not terms:
            return []
        scored = []
        for turn in self.buffer.turns_after(user_id, self.fulltext.indexed_lsn):
            if not _matches(turn, session_id, since, until, roles, None, tags):
                continue
            shared = len(terms.intersection(self.fulltext.terms(turn.text)))
            if shared:
                scored.append((-shared, -turn.lsn, turn.lsn))
        scored.sort()
        return [lsn for _, _, lsn in scored[:CANDIDATES_PER_LEG]]

    async def _expand(self, user_id: str, hits: list[Hit], depth: int) -> list[Hit]:
        """Breadth-first along links in both directions; memories already found are skipped."""
        seen = {h.id for h in hits}
        score_of = {h.id: h.score for h in hits}
        frontier = [h.id for h in hits]
        found: list[tuple[str, float]] = []
        for _ in range(depth):
            links = await self.store.read(read_links, user_id, frontier)
            next_frontier = []
            for source in frontier:
                for link in links.get(source, []):
                    other = link.to_id if link.from_id == source else link.from_id
                    if other not in seen:
                        seen.add(other)
                        score_of[other] = score_of[source] * LINK_DECAY
                        found.append((other, score_of[other]))
                        next_frontier.append(other)
            frontier = next_frontier
            if not frontier:
                break
        memories = await self.store.read(read_memories_by_id, user_id, [i for i, _ in found])
        return [_hit(memories[i], score, ("link",)) for i, score in found if i in memories]

    async def retrieve(self, user_id: str, query: str, *, conversation_id: str | None,
                       episodic_limit: int, semantic_limit: int, category: str | None,
                       min_importance: float, episodic: bool) -> RetrieveResult:
        """seed 001's retrieval: the semantic leg (active facts matching the query, then the
        user's most important standing facts) and the episodic leg (episodes, FSRS-re-ranked,
        and turns no shown episode covers yet, each with its neighbouring turns)."""
        semantic: list[SemanticItem] = []
        items: list[EpisodicItem] = []
        async with trio.open_nursery() as nursery:
            if semantic_limit:
                async def semantic_leg() -> None:
                    semantic.extend(await self._semantic(user_id, query, semantic_limit,
                                                         category, min_importance))
                nursery.start_soon(semantic_leg)
            if episodic and episodic_limit:
                async def episodic_leg() -> None:
                    items.extend(await self._episodic(user_id, query, episodic_limit))
                nursery.start_soon(episodic_leg)
        return RetrieveResult(semantic, items)

    async def _semantic(self, user_id: str, query: str, limit: int, category: str | None,
                        min_importance: float) -> list[SemanticItem]:
        profile = await self.facts.profile(user_id, category, min_importance)
        if not profile:
            return []
        by_lsn = {f.lsn: f for f in profile}
        hits = await self.recall(user_id, query, limit=limit, session_id=None, since=None,
                                 until=None, roles=None, kinds=("fact",), link_depth=0,
                                 budget_tokens=None, only=sorted(by_lsn), legs=("vector", "bm25"))
        by_id = {f.fact_id: f for f in profile}
        chosen: list[tuple[Fact, float]] = [(by_id[h.id], h.score) for h in hits
                                            if h.id in by_id]
        # Read-your-writes: facts stored but not yet in the text index, by shared terms.
        indexed = self.fulltext.indexed_lsn
        fresh = [f for f in profile if f.lsn > indexed]
        if fresh:
            terms = set(self.fulltext.terms(query))
            for fact in fresh:
                shared = len(terms.intersection(self.fulltext.terms(fact.text)))
                if shared:
                    chosen.append((fact, shared / (RRF_K + 1)))
            chosen.sort(key=lambda pair: -pair[1])
        # The deterministic part: standing facts (name, allergies, instructions...) always
        # come along, after the ones the query found.
        seen = {f.fact_id for f, _ in chosen}
        for fact in profile:
            if len(chosen) >= limit:
                break
            if fact.fact_id not in seen and fact.importance >= STANDING_IMPORTANCE:
                chosen.append((fact, 0.0))
        return [SemanticItem(id=f.fact_id, conversation_id=f.session_id or None,
                             category=f.category, fact=f.text, keywords=list(f.keywords),
                             source_episodic_ids=list(f.source_episode_ids or f.source_turn_ids),
                             valid_at=f.valid_at, invalid_at=f.invalid_at, score=score)
                for f, score in chosen[:limit]]

    async def _episodic(self, user_id: str, query: str, limit: int) -> list[EpisodicItem]:
        hits = await self.recall(user_id, query, limit=limit, session_id=None, since=None,
                                 until=None, roles=None, kinds=("episode", "turn"), link_depth=0,
                                 budget_tokens=None)
        episode_ids = [h.id for h in hits if h.kind == "episode"]
        turn_ids = [h.id for h in hits if h.kind == "turn"]
        episodes, contexts, states = await self.store.read(
            _read_episodic, user_id, episode_ids, turn_ids)
        covered = {t for e, _ in episodes.values() for t in e.turn_ids}
        items: list[EpisodicItem] = []
        for hit in hits:
            if hit.kind == "episode" and hit.id in episodes:
                episode, turns = episodes[hit.id]
                reviewed = states.get(hit.id)
                state = reviewed or memory_review_state(episode)
                items.append(EpisodicItem(
                    id=episode.episode_id, conversation_id=episode.session_id,
                    messages=[Message(t.role, t.text) for t in turns], title=episode.title,
                    summary=episode.summary,
                    stability=state.stability, difficulty=state.difficulty,
                    surprise=episode.surprise, start_at=episode.start_at, end_at=episode.end_at,
                    created_at=episode.created_at,
                    last_reviewed_at=reviewed.last_review if reviewed else None,
                    consolidated_at=episode.consolidated_at, score=hit.score, kind="episode"))
            elif hit.kind == "turn" and hit.id not in covered:
                # A turn found in the RAM window may not be on disk yet: it stands alone.
                context = contexts.get(hit.id)
                messages = ([Message(t.role, t.text) for t in context] if context
                            else [Message(hit.role or "user", hit.text)])
                times = [t.at for t in context or ()] or [hit.at]
                # The state review() would start from, until the turn is first reviewed.
                reviewed = states.get(hit.id)
                state = reviewed or memory_review_state(hit)
                items.append(EpisodicItem(
                    id=hit.id, conversation_id=hit.session_id, messages=messages,
                    title=_title(hit.text), summary=hit.text,
                    stability=state.stability, difficulty=state.difficulty, surprise=0.0,
                    start_at=times[0], end_at=times[-1], created_at=hit.at,
                    last_reviewed_at=reviewed.last_review if reviewed else None,
                    consolidated_at=None, score=hit.score))
        return items


STANDING_IMPORTANCE = 0.8  # facts at least this important join every semantic section


def _read_episodic(txn: Any, dbs: dict[bytes, Any], user_id: str, episode_ids: list[str],
                   turn_ids: list[str]) -> tuple[dict[str, tuple[Episode, list[Turn]]],
                                                 dict[str, list[Turn]], dict[str, Any]]:
    """Episodes with their turns, turns with their neighbours, and review states: one read."""
    episodes = {}
    for memory_id, memory in read_memories_by_id(txn, dbs, user_id, episode_ids).items():
        if type(memory) is Episode:
            turns = read_session_turns(txn, dbs, user_id, memory.session_id, memory.first_seq,
                                       memory.last_seq)
            episodes[memory_id] = (memory, turns)
    contexts = read_turn_contexts(txn, dbs, user_id, turn_ids)
    states = read_review_states(txn, dbs, user_id, episode_ids + turn_ids)
    return episodes, contexts, states


def _dedupe(hits: list[Hit]) -> list[Hit]:
    """Drop a turn that an episode or a fact ranked above it already stands for: its slot
    goes to a memory that adds something."""
    represented: set[str] = set()
    out = []
    for hit in hits:
        if hit.kind == "turn" and hit.id in represented:
            continue
        if hit.kind in ("episode", "fact"):
            represented.update(hit.turn_ids)
        out.append(hit)
    return out


def fuse(ranked: dict[str, list[int]]) -> list[tuple[int, float, tuple[str, ...]]]:
    """Reciprocal rank fusion: score = sum over legs of 1 / (RRF_K + rank), rank from 1."""
    scores: dict[int, float] = {}
    via: dict[int, list[str]] = {}
    for leg, lsns in ranked.items():
        for rank, lsn in enumerate(lsns, 1):
            scores[lsn] = scores.get(lsn, 0.0) + 1.0 / (RRF_K + rank)
            via.setdefault(lsn, []).append(leg)
    order = sorted(scores, key=lambda lsn: (-scores[lsn], -lsn))
    return [(lsn, scores[lsn], tuple(via[lsn])) for lsn in order]


def pack(hits: list[Hit], budget_tokens: int | None) -> list[Hit]:
    """The best hits that fit the budget, in rank order (a long one is skipped, not a stop)."""
    if budget_tokens is None:
        return hits
    packed, used = [], 0
    for hit in hits:
        cost = estimate_tokens(hit.text)
        if used + cost <= budget_tokens:
            packed.append(hit)
            used += cost
    return packed


def _matches(memory: Turn | Note | Episode | Fact, session_id: str | None,
             since: datetime | None, until: datetime | None, roles: tuple[str, ...] | None,
             kinds: tuple[str, ...] | None, tags: tuple[str, ...] | None) -> bool:
    kind = type(memory)
    if kind is Episode:  # a session's, no role, no tags
        return ((session_id is None or memory.session_id == session_id)
                and (since is None or memory.end_at >= since)
                and (until is None or memory.end_at <= until)
                and roles is None and tags is None and (kinds is None or "episode" in kinds))
    if kind is Fact:  # user-level; its category is its tag
        return (session_id is None and roles is None
                and (since is None or memory.created_at >= since)
                and (until is None or memory.created_at <= until)
                and (kinds is None or "fact" in kinds)
                and (tags is None or memory.category in tags))
    if kind is Note:  # user-level: no session, no role
        return (session_id is None and roles is None
                and (since is None or memory.updated_at >= since)
                and (until is None or memory.updated_at <= until)
                and (kinds is None or "note" in kinds)
                and (tags is None or not set(tags).isdisjoint(memory.tags)))
    turn = memory
    return ((session_id is None or turn.session_id == session_id)
            and (since is None or turn.at >= since) and (until is None or turn.at <= until)
            and (roles is None or turn.role in roles) and (kinds is None or "turn" in kinds)
            and (tags is None or not set(tags).isdisjoint(turn_tags(turn))))


def _hit(memory: Turn | Note | Episode | Fact, score: float, via: tuple[str, ...]) -> Hit:
    kind = type(memory)
    if kind is Episode:
        return Hit(id=memory.episode_id, kind="episode", text=f"{memory.title}: {memory.summary}",
                   score=score, session_id=memory.session_id, at=memory.end_at,
                   turn_ids=memory.turn_ids, via=via)
    if kind is Fact:
        return Hit(id=memory.fact_id, kind="fact", text=memory.text, score=score, session_id="",
                   at=memory.created_at, turn_ids=memory.source_turn_ids, via=via)
    if kind is Note:
        return Hit(id=memory.note_id, kind="note", text=memory.text, score=score,
                   session_id="", at=memory.updated_at, turn_ids=(), via=via)
    return Hit(id=memory.turn_id, kind="turn", text=memory.text, score=score,
               session_id=memory.session_id, at=memory.at, turn_ids=(memory.turn_id,),
               role=memory.role, via=via)


def _entity_keys(query: str) -> list[str]:
    """Registry keys a query may name: its entities, and its words and word pairs lower-cased
    (people ask "what did maya say", not "Maya")."""
    keys = [name.lower() for name, kind in extract_entities(query) if kind != "date"]
    words = [w for w in re.findall(r"[\w@#'.-]+", query.lower()) if len(w) > 2]
    words = [w.strip(".'") for w in words]
    keys += words + [f"{a} {b}" for a, b in zip(words, words[1:])]
    return sorted(set(k for k in keys if k))[:64]


def _title(text: str, words: int = 8) -> str:
    first = text.strip().split("\n", 1)[0].split()
    return " ".join(first[:words]) + ("..." if len(first) > words else "")


# -- rendering ---------------------------------------------------------------------------------


def relative_time(at: datetime, now: datetime) -> str:
    """'just now', '5 minutes ago', 'yesterday', '3 weeks ago'..., as a person says it."""
    seconds = (now - at).total_seconds()
    if seconds < 0:
        return "in the future"
    for limit, unit, size in ((60, None, 1), (3600, "minute", 60), (86400, "hour", 3600)):
        if seconds < limit:
            if unit is None:
                return "just now"
            n = int(seconds // size)
            return f"{n} {unit}{'s' if n != 1 else ''} ago"
    days = int(seconds // 86400)
    if days == 1:
        return "yesterday"
    for limit, unit, size in ((14, "day", 1), (60, "week", 7), (730, "month", 30)):
        if days < limit:
            n = days // size
            return f"{n} {unit}{'s' if n != 1 else ''} ago"
    return f"{days // 365} years ago"


def render_markdown(result: RetrieveResult, now: datetime, detail: Detail,
                    episodic: bool = True) -> str:
    """seed 001's Markdown: semantic facts with [category], then ranked episodes."""
    lines: list[str] = []
    if result.semantic:
        lines.append("## Semantic Memory")
        for fact in result.semantic:
            sources = len(fact.source_episodic_ids)
            lines.append(f"- [{fact.category}] {fact.fact} "
                         f"(sources: {sources} conversation{'s' if sources != 1 else ''})")
    if episodic:
        if lines:
            lines.append("")
        lines.append("## Episodic Memories")
        if not result.episodic:
            lines += ["", "No matching memories."]
        for rank, item in enumerate(result.episodic, 1):
            key = item.surprise >= KEY_MOMENT
            lines += ["", f"### {item.title} [rank: {rank}, score: {item.score:.2f}"
                          f"{', key moment' if key else ''}]",
                      f"**When:** {relative_time(item.end_at, now)}",
                      f"**Summary:** {item.summary}"]
            if _show_details(detail, rank, key):
                lines += ["", "**Details:**"]
                lines += [f'- {m.role}: "{" ".join(m.content.split())}"' for m in item.messages]
    return "\n".join(lines) + ("\n" if lines else "")


def _show_details(detail: Detail, rank: int, key: bool) -> bool:
    if detail == "high":
        return True
    if detail == "none":
        return False
    if detail == "low":
        return rank == 1 and key
    return rank <= 2 and key  # auto


def focus_settings(focus: int | None, now: datetime) -> dict[str, Any]:
    """limit, since and link depth for a focus level (None: no window, no links)."""
    if focus is None:
        return {"limit": 10, "since": None, "link_depth": 0}
    level = FOCUS_LEVELS[focus]
    return {"limit": level["limit"], "since": now - timedelta(hours=level["hours"]),
            "link_depth": level["link_depth"]}

