"""The retrieval pipeline: what a bot calls before every reply.

1. Embed the query once (an LRU cache keyed by user and text).
2. In parallel: the vector leg (AnnIndex), the BM25 leg (FullText; stopwords and question words
   left out of the query), the entity leg (memories naming an entity the query names, when that
   entity is rare among the user's memories: a name in most of them carries no signal) and the
   window leg (turns acknowledged but not yet indexed, from the RAM windows, by shared terms).
   Each leg brings ``max(CANDIDATES_PER_LEG, 2 x limit)`` candidates with scores. When the
   query admits turns and other kinds, the vector and BM25 legs search the turns and the other
   kinds (episodes, facts, notes) as two lists of that depth: the turns' list is exactly what a
   turns-only recall has, so the other kinds never push a turn out of a leg's candidates nor
   change how its score is normalised; they only add (their hits, their lifts).
3. Fuse: each leg's scores become z-scores (how far above that leg's typical candidate), summed
   with LEG_WEIGHTS. A strong head of one leg keeps its lead; the long tail of a weak leg cannot
   outvote it the way reciprocal-rank fusion lets it (the other kinds' scores are measured
   against the same leg's turn candidates). A relevance floor drops candidates only
   the vector leg found, below MIN_COSINE: a query with no good match returns fewer hits.
4. Lift, from one store read of every candidate with its neighbouring turns, the turns episodes
   cover and the episodes' FSRS state: a turn passes a share of its fused score to the turns
   around it in its session (an answer sits next to its question); an episode lifts its best
   covered turns, scaled by its FSRS retrievability, instead of taking the slots of the ~10
   turns it stands for (it is returned itself when ``kinds`` names episodes, or when its turns
   are gone); facts are returned, at most DERIVED_SHARE of the slots, and a turn a fact ranked
   above it stands for is dropped.
5. Expand along links, breadth-first in both directions, to the focus level's depth.
6. Pack into a token budget and return typed hits (rendered as Markdown by ``retrieve_memory``),
   each with ``explain``: its rank in each leg, fused score, lift and FSRS factor.

Every leg is restricted to the user inside its index; records are then fetched from the store
by lsn with the user's key prefix checked once more.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any, Literal

import msgspec
import trio

from actors.ann_index import KINDS, AnnIndex, Filters
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

from actors.base.records import Episode, Fact, Note, Turn
from actors.base.errors import EngineBroken, EngineClosed, EngineError

__all__ = ["Hit", "Explain", "Message", "EpisodicItem", "SemanticItem", "RetrieveResult",
           "FOCUS_LEVELS", "Retriever", "estimate_tokens"]

CANDIDATES_PER_LEG = 100  # per leg before fusion, at least (2 x limit when that is more)
# Weights of the legs' z-scores. BM25 and vectors weigh the same (chosen on the LoCoMo dev split
# among 0.3-0.7 for BM25, checked on the generated set); the window leg stands in for BM25 on
# turns not yet indexed; the entity leg only adds to what names a rare entity.
LEG_WEIGHTS = {"bm25": 0.5, "vector": 0.5, "window": 0.5, "entity": 0.1}
MIN_COSINE = 0.2  # a candidate only the vector leg found needs this similarity to the query
NEIGHBOUR_LIFT = (0.3, 0.1)  # share of a turn's fused score given to turns 1 and 2 seqs away
EPISODE_LIFT = 0.1  # share of an episode's fused score given to each of its best turns
EPISODE_TURNS = 3  # covered turns an episode lifts
DERIVED_SHARE = 0.2  # at most this share of the slots go to facts (and episodes, asked for)
RARE_ENTITY = 0.05  # an entity named in more than this share of the memories is no evidence
COMMON_AFTER = 8  # ... once it is named in more memories than this (a new user has few)
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


class Explain(msgspec.Struct, frozen=True, kw_only=True):
    """Why a hit ranks where it does.

    Attributes:
        ranks: its rank (from 1) in each leg that found it.
        fused: the weighted sum of its legs' z-scores (0 for a turn only lifted).
        lift: what neighbouring turns and covering episodes added to ``fused``.
        lifted_by: the memories (turn or episode ids) that lifted it.
        fsrs: the FSRS retrievability factor the score was multiplied by (1.0 but episodes).
        cosine: its similarity to the query, when the vector leg scored it.
    """

    ranks: dict[str, int]
    fused: float
    lift: float = 0.0
    lifted_by: tuple[str, ...] = ()
    fsrs: float = 1.0
    cosine: float | None = None


class Hit(msgspec.Struct, frozen=True, kw_only=True):
    """One recalled memory.

    Attributes:
        id: the memory's id (a turn id for a turn).
        kind: turn, episode, fact or note.
        text: its text.
        score: relevance in (0, 1), the logistic of fused score plus lift, times the FSRS
            factor (higher is better); linked memories get a decayed share.
        session_id: the session it belongs to ("" for a note: notes belong to the user).
        at: when it was said or made.
        turn_ids: the turns it stands for (itself, for a turn).
        role: who said it (turns).
        via: what found it: the legs ``vector``, ``bm25``, ``entity``, ``window``; for a turn
            no leg found, ``neighbour`` / ``episode`` (lifted by a neighbouring turn or a
            covering episode); ``link`` (reached along a link).
        explain: per-leg ranks, fused score, lift and FSRS factor (None for a linked memory).
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
    explain: Explain | None = None


class Hits(list):
    """What ``recall`` returns: a list of :class:`Hit`, best first (it is a plain ``list``
    for every other purpose), that also says which search legs were degraded.

    Attributes:
        degraded: the legs whose index was being rebuilt (or catching up with what the store
            held when the engine opened) when the query ran: ``bm25`` (the text index) and/or
            ``vector`` (the embeddings). Empty when every leg searched a complete index. A
            degraded leg may miss memories the others then cannot make up for.
    """

    __slots__ = ("degraded",)

    def __init__(self, hits: Iterable[Hit] = (), degraded: tuple[str, ...] = ()) -> None:
        super().__init__(hits)
        self.degraded = degraded

    @property
    def partial(self) -> bool:
        """True if a leg was degraded: the answer may lack memories a complete index finds."""
        return bool(self.degraded)


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


class RetrieveResult(msgspec.Struct, frozen=True, omit_defaults=True):
    """What ``retrieve_memory_raw`` returns: seed 001's ``semantic`` and ``episodic`` lists,
    and ``degraded``: the search legs being rebuilt when it ran (see :class:`Hits`; left out
    of the JSON when empty)."""

    semantic: list[SemanticItem]
    episodic: list[EpisodicItem]
    degraded: tuple[str, ...] = ()


Detail = Literal["auto", "none", "low", "high"]
KEY_MOMENT = 0.7  # surprise at or above which an episode is a "key moment" (seed 001)


@contextmanager
def _one_error() -> Iterator[None]:
    """The legs run in a nursery, whose failures come as a group: the caller gets one error
    of the engine's own. A lone engine error is raised as it is, EngineClosed from several
    legs (the engine closing under them) as one EngineClosed, anything else as EngineBroken
    with the group as its cause. Cancellation and KeyboardInterrupt pass through."""
    try:
        yield
    except BaseExceptionGroup as group:
        real = group.subgroup(lambda e: not isinstance(e, trio.Cancelled))
        if real is None:
            raise
        leaves = list(_leaves(real))
        if all(not isinstance(e, Exception) for e in leaves):
            raise
        if len(leaves) == 1 and isinstance(leaves[0], EngineError):
            raise leaves[0]  # the one failure, as it was raised (the group is its context)
        if all(isinstance(e, EngineClosed) for e in leaves):
            raise EngineClosed(str(leaves[0])) from group
        raise EngineBroken(f"a search failed: {'; '.join(repr(e) for e in leaves)}") from group


def _leaves(group: BaseExceptionGroup) -> Iterator[BaseException]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc


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
        others (the facts a category or importance filter admits), applied in every index.
        ``legs``: the legs that run (the benchmark measures each alone)."""
        ranked: dict[str, list[tuple[int, float]]] = {}
        # Turns and the other kinds (episodes, facts, notes) are searched as separate candidate
        # lists when the query admits both: the turns' list, its depth and its statistics are
        # then exactly what a turns-only recall has, so the other kinds never push a turn out
        # of a leg's list nor shift how the turns' scores are normalised. They only add: their
        # own hits and the lifts they give.
        split = kinds is None or ("turn" in kinds and len(kinds) > 1)
        searches: dict[str, tuple[str, ...] | None] = {"": ("turn",) if split else kinds}
        if split:
            searches["other"] = tuple(k for k in KINDS if k != "turn"
                                      and (kinds is None or k in kinds))
        others: dict[str, list[tuple[int, float]]] = {}
        depth = max(CANDIDATES_PER_LEG, 2 * limit)
        vector: list[Any] = []

        def put(leg: str, part: str, found: list[tuple[int, float]]) -> None:
            (others if part else ranked)[leg] = found

        async def vector_leg() -> None:
            vector.append(await self.embedder.embed_query(query, user_id))
            # Tags live in the text index's term lists; they become the vector search's mask.
            lsns = (None if tags is None
                    else await self.fulltext.tagged(user_id, tags, TAGGED_LIMIT))
            if only is not None:
                lsns = only if lsns is None else sorted(set(lsns) & set(only))
            async with trio.open_nursery() as parts:
                for part, part_kinds in searches.items():
                    parts.start_soon(vector_search, part,
                                     Filters(session_id, since, until, roles, part_kinds, lsns))

        async def vector_search(part: str, filters: Filters) -> None:
            put("vector", part, await self.ann.search(user_id, vector[0], depth, filters))

        async def bm25_search(part: str, filters: TextFilters) -> None:
            put("bm25", part, await self.fulltext.search(user_id, query, depth, filters))

        async def entity_leg() -> None:
            found = await self._entity_leg(user_id, query)
            if found:
                ranked["entity"] = found[:depth]

        with _one_error():
            async with trio.open_nursery() as nursery:
                if "vector" in legs:
                    nursery.start_soon(vector_leg)
                if "bm25" in legs:
                    for part, part_kinds in searches.items():
                        nursery.start_soon(bm25_search, part, TextFilters(
                            session_id, since, until, roles, part_kinds, tags, only))
                if "entity" in legs and only is None:
                    nursery.start_soon(entity_leg)
                if "window" in legs:
                    ranked["window"] = self._window_leg(user_id, query, session_id, since,
                                                        until, roles, kinds, tags)
        # The memories a leg chose from: all the vector leg could rank, up to its depth.
        population = len(ranked.get("vector", ())) or depth
        fused = fuse(ranked, population)
        # The other kinds, each on the scale of the same leg's (turn) candidates.
        added = fuse(others, population, ranked)
        cosine = dict(ranked.get("vector", ())) | dict(others.get("vector", ()))

        def head(scores: dict[int, tuple[float, dict[str, int]]]) -> list[int]:
            # The relevance floor: only the vector leg found it, and not by much.
            kept = [lsn for lsn, f in scores.items()
                    if len(f[1]) > 1 or "vector" not in f[1] or cosine[lsn] >= MIN_COSINE]
            return sorted(kept, key=lambda lsn: (-scores[lsn][0], -lsn))[: limit * 3 + 20]

        first = head(fused)

        def above(n: int) -> float:
            # The score a memory of another kind needs to rank among the first n of one
            # ranking with the turns (whose places it does not take).
            return fused[first[n - 1]][0] if len(first) >= n else -math.inf

        second = [lsn for lsn in head(added)
                  if lsn not in fused and added[lsn][0] >= above(limit * 3 + 20)]
        # The candidates that lift others: a positive fused score, near enough to the head
        # that what they lift can reach the results.
        lifting = ({lsn for lsn in first[: 2 * limit + 10] if fused[lsn][0] > 0}
                   | {lsn for lsn in second
                      if added[lsn][0] > 0 and added[lsn][0] >= above(2 * limit + 10)})
        primary = {lsn: fused[lsn][0] for lsn in first}
        # A memory both lists found (the entity leg's are in the turns' list) sums its legs.
        for lsn, (score, ranks) in added.items():
            if lsn in fused:
                fused[lsn] = (fused[lsn][0] + score, fused[lsn][1] | ranks)
            else:
                fused[lsn] = (score, ranks)
        order = first + second
        records, around, covered, states = await self.store.read(
            _read_candidates, user_id, order, lifting,
            len(NEIGHBOUR_LIFT) if kinds is None or "turn" in kinds else 0)
        allowed = None if only is None else set(only)
        memories: dict[int, Any] = {}
        for lsn in order:
            memory = records.get(lsn) or self.buffer.recent_turn(user_id, lsn)
            if memory is not None and (allowed is None or lsn in allowed):
                memories[lsn] = memory
        scored, explain_of = self._lift(user_id, memories, fused, lifting, around, covered,
                                        states, cosine, vector[0] if vector else None, kinds,
                                        primary)
        hits: list[Hit] = []
        derived = 0
        cap = max(1, int(limit * DERIVED_SHARE))
        mixed = kinds is None or "turn" in kinds
        for score, memory in scored:
            if not _matches(memory, session_id, since, until, roles, kinds, tags):
                continue  # deleted since it was indexed, or not quite what the filter asked
            if mixed and type(memory) in (Episode, Fact):
                if derived == cap:
                    continue
                derived += 1
            explain, via = explain_of(memory.lsn)
            hits.append(_hit(memory, score, via, explain))
            if len(hits) == limit * 2:
                break
        hits = _dedupe(hits)[:limit]
        if link_depth > 0 and hits:
            hits += await self._expand(user_id, hits, link_depth)
        return pack(hits, budget_tokens)

    def _lift(self, user_id: str, memories: dict[int, Any],
              fused: dict[int, tuple[float, dict[str, int]]], lifting: set[int],
              around: dict[tuple[str, int], Turn], covered: dict[str, list[Turn]],
              states: dict[str, Any], cosine: dict[int, float], vector: Any,
              kinds: tuple[str, ...] | None, primary: dict[int, float]
              ) -> tuple[list[tuple[float, Any]], Callable[[int], tuple[Explain, tuple[str, ...]]]]:
        """Candidates with lifted scores, best first: each of ``lifting`` that is a turn lifts
        its neighbours, each that is an episode its best covered turns (an episode drops out
        unless ``kinds`` names episodes or its turns are gone). ``primary``: the fused scores
        from the turns' lists alone (see ``recall``). Returns [(score, memory)] and what
        explains a memory's score and says what found it (made only for the hits)."""
        base = {lsn: fused[lsn][0] for lsn in memories}
        # Where a turn no leg found starts: below every candidate of the turns' lists (the
        # other kinds' lists leave it where turns-only has it), and never above a leg's
        # typical candidate (z = 0), however few candidates there are.
        floor = min([0.0, *(primary[lsn] for lsn in memories if lsn in primary)])
        lift: dict[int, float] = {}
        lifted_by: dict[int, list[tuple[str, str]]] = {}
        extra: dict[int, Turn] = {}

        def give(turn: Turn, amount: float, source: str, way: str) -> None:
            lsn = turn.lsn
            if lsn not in memories:
                extra[lsn] = turn
            lift[lsn] = lift.get(lsn, 0.0) + amount
            lifted_by.setdefault(lsn, []).append((source, way))

        now = self.clock()
        fsrs: dict[int, float] = {}
        standing: set[int] = set()  # episodes returned themselves
        for lsn, memory in memories.items():
            kind = type(memory)
            if kind is Turn and lsn in lifting:
                score = base[lsn]
                for distance, share in enumerate(NEIGHBOUR_LIFT, 1):
                    for seq in (memory.seq - distance, memory.seq + distance):
                        other = around.get((memory.session_id, seq))
                        if other is not None:
                            give(other, share * score, memory.turn_id, "neighbour")
            elif kind is Episode:
                state = states.get(memory.episode_id) or memory_review_state(memory)
                r = fsrs[lsn] = retrievability(state.stability, state.last_review, now)
                turns = covered.get(memory.episode_id, [])
                if not turns or (kinds is not None and "episode" in kinds):
                    standing.add(lsn)
                if lsn in lifting and turns and base[lsn] > 0:
                    score = base[lsn]
                    sims = (self.ann.similarities(user_id, vector, [t.lsn for t in turns])
                            if vector is not None else {})
                    best = sorted(turns, key=lambda t: (t.lsn not in base, -base.get(t.lsn, 0.0),
                                                        -sims.get(t.lsn, -1.0)))
                    for turn in best[:EPISODE_TURNS]:
                        give(turn, EPISODE_LIFT * r * score, memory.episode_id, "episode")
        out = []
        for lsn, memory in (*memories.items(), *extra.items()):
            if type(memory) is Episode and lsn not in standing:
                continue
            total = base.get(lsn, floor) + lift.get(lsn, 0.0)
            out.append((_logistic(total) * fsrs.get(lsn, 1.0), memory))
        out.sort(key=lambda item: (-item[0], -item[1].lsn))

        def explain_of(lsn: int) -> tuple[Explain, tuple[str, ...]]:
            ranks = fused[lsn][1] if lsn in memories else {}
            sources = lifted_by.get(lsn, ())
            explain = Explain(ranks=dict(ranks), fused=base.get(lsn, 0.0),
                              lift=lift.get(lsn, 0.0),
                              lifted_by=tuple(dict.fromkeys(s for s, _ in sources)),
                              fsrs=fsrs.get(lsn, 1.0), cosine=cosine.get(lsn))
            # What found it: its legs; a turn no leg found, what lifted it.
            return explain, tuple(ranks) or tuple(sorted({w for _, w in sources}))

        return out, explain_of

    async def _entity_leg(self, user_id: str, query: str) -> list[tuple[int, float]]:
        """Memories naming the query's rare entities, scored by the entities' inverse document
        frequency summed. A name in more than RARE_ENTITY of the user's memories (the user's
        own, a partner's in a two-person chat) is no evidence and never makes the leg fire
        (once it is in more than COMMON_AFTER of them)."""
        known = await self.entities.keys(user_id)
        names = [name for name in _entity_keys(query) if name in known]
        if not names:
            return []
        registry = await self.store.read(read_entities, user_id, names)
        total = max(await self.ann.count(user_id), 1)
        scores: dict[int, float] = {}
        for entity in {e.name: e for e in registry.values() if e.type != "alias"}.values():
            if entity.mentions > max(RARE_ENTITY * total, COMMON_AFTER):
                continue
            weight = math.log(1 + total / max(entity.mentions, 1))
            for lsn in entity.lsns:
                scores[lsn] = scores.get(lsn, 0.0) + weight
        return sorted(scores.items(), key=lambda pair: (-pair[1], -pair[0]))

    def _window_leg(self, user_id: str, query: str, session_id: str | None,
                    since: datetime | None, until: datetime | None,
                    roles: tuple[str, ...] | None, kinds: tuple[str, ...] | None,
                    tags: tuple[str, ...] | None) -> list[tuple[int, float]]:
        """Turns acknowledged but not yet in the text index, scored by terms shared with the
        query, then recency: read-your-writes for recall."""
        if kinds is not None and "turn" not in kinds:
            return []
        terms = set(self.fulltext.query_terms(query))
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
        return [(lsn, float(-shared)) for shared, _, lsn in scored[:CANDIDATES_PER_LEG]]

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
        with _one_error():
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
            terms = set(self.fulltext.query_terms(query))
            for fact in fresh:
                shared = len(terms.intersection(self.fulltext.terms(fact.text)))
                if shared:
                    # The share of the query's terms it has, on the hits' (0, 1) scale.
                    chosen.append((fact, _logistic(shared / len(terms))))
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
        found = await self.recall(user_id, query, limit=limit * EPISODIC_POOL, session_id=None,
                                  since=None, until=None, roles=None, kinds=("episode", "turn"),
                                  link_depth=0, budget_tokens=None)
        # Up to ``limit`` items in rank order: an episode replaces the turns it covers that were
        # picked before it, and a turn a picked episode covers is skipped, so the section fills
        # with memories that each add something.
        hits: list[Hit] = []
        shown: set[str] = set()
        for hit in found:
            if len(hits) == limit:
                break
            if hit.kind == "turn" and hit.id in shown:
                continue
            if hit.kind == "episode":
                shown.update(hit.turn_ids)
                hits = [h for h in hits if h.kind != "turn" or h.id not in shown]
            hits.append(hit)
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
EPISODIC_POOL = 3  # hits recall brings per episodic item: covered turns give way to episodes


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


def fuse(ranked: dict[str, list[tuple[int, float]]], population: int,
         scale: dict[str, list[tuple[int, float]]] | None = None
         ) -> dict[int, tuple[float, dict[str, int]]]:
    """Weighted z-score fusion: per leg, (score - mean) / standard deviation over its
    candidates, times LEG_WEIGHTS[leg], summed over the legs that found a memory (a leg that
    did not find it adds nothing). A lexical leg (BM25, entity, window) that found fewer than
    ``population`` memories counts the others at score 0, as they are: two keyword matches
    among many memories are both strong, not one above and one below the mean.

    Args:
        ranked: leg -> [(lsn, score)], best first.
        population: the memories the legs chose from (see above).
        scale: leg -> the candidates whose mean and spread the leg's scores are measured
            against (the turns' list, for the other kinds' list); by default ``ranked``'s own.

    Returns:
        lsn -> (fused score, {leg: rank from 1 in the list that found it}).
    """
    out: dict[int, tuple[float, dict[str, int]]] = {}
    for leg, found in ranked.items():
        if not found:
            continue
        values = [score for _, score in ((scale.get(leg) or found) if scale else found)]
        n = len(values) if leg == "vector" else max(len(values), population)
        mean = sum(values) / n
        spread = math.sqrt((sum((v - mean) ** 2 for v in values)
                            + (n - len(values)) * mean * mean) / n)
        weight = LEG_WEIGHTS[leg]
        for rank, (lsn, score) in enumerate(found, 1):
            # One candidate, or all alike: each is one deviation above the typical one.
            z = (score - mean) / spread if spread > 1e-9 else 1.0
            total, ranks = out.get(lsn, (0.0, {}))
            ranks[leg] = rank
            out[lsn] = (total + weight * z, ranks)
    return out


def _logistic(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-max(-50.0, min(50.0, x))))


def _read_candidates(txn: Any, dbs: dict[bytes, Any], user_id: str, lsns: list[int],
                     lifting: set[int], span: int
                     ) -> tuple[dict[int, Any], dict[tuple[str, int], Turn],
                                dict[str, list[Turn]], dict[str, Any]]:
    """What the lift stage needs, in one read: the candidates' records; the turns up to
    ``span`` seqs around each candidate turn in ``lifting`` (those with a positive fused
    score: the others lift nothing), by (session, seq); the turns of each episode in
    ``lifting`` (of any other episode, its first turn: whether its turns are still there);
    and the episodes' review states."""
    records = read_records(txn, dbs, user_id, lsns)
    wanted: dict[str, list[int]] = {}
    covered: dict[str, list[Turn]] = {}
    for lsn, memory in records.items():
        if type(memory) is Turn and span and lsn in lifting:
            wanted.setdefault(memory.session_id, []).append(memory.seq)
        elif type(memory) is Episode:
            last = memory.last_seq if lsn in lifting else memory.first_seq
            covered[memory.episode_id] = read_session_turns(
                txn, dbs, user_id, memory.session_id, memory.first_seq, last)
    around: dict[tuple[str, int], Turn] = {}
    for session_id, seqs in wanted.items():
        # Overlapping windows merge, so each stretch of the session is read once.
        seqs.sort()
        first = last = None
        for seq in seqs:
            if first is not None and seq - span <= last + 1:
                last = seq + span
                continue
            if first is not None:
                for turn in read_session_turns(txn, dbs, user_id, session_id, first, last):
                    around[(session_id, turn.seq)] = turn
            first, last = max(0, seq - span), seq + span
        if first is not None:
            for turn in read_session_turns(txn, dbs, user_id, session_id, first, last):
                around[(session_id, turn.seq)] = turn
    states = read_review_states(txn, dbs, user_id, list(covered))
    return records, around, covered, states


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


def _hit(memory: Turn | Note | Episode | Fact, score: float, via: tuple[str, ...],
         explain: Explain | None = None) -> Hit:
    kind = type(memory)
    if kind is Episode:
        return Hit(id=memory.episode_id, kind="episode", text=f"{memory.title}: {memory.summary}",
                   score=score, session_id=memory.session_id, at=memory.end_at,
                   turn_ids=memory.turn_ids, via=via, explain=explain)
    if kind is Fact:
        return Hit(id=memory.fact_id, kind="fact", text=memory.text, score=score, session_id="",
                   at=memory.created_at, turn_ids=memory.source_turn_ids, via=via,
                   explain=explain)
    if kind is Note:
        return Hit(id=memory.note_id, kind="note", text=memory.text, score=score,
                   session_id="", at=memory.updated_at, turn_ids=(), via=via, explain=explain)
    return Hit(id=memory.turn_id, kind="turn", text=memory.text, score=score,
               session_id=memory.session_id, at=memory.at, turn_ids=(memory.turn_id,),
               role=memory.role, via=via, explain=explain)


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

