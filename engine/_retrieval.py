"""The retrieval pipeline: what a bot calls before every reply.

1. Embed the query once (an LRU cache keyed by user and text).
2. In parallel: the vector leg (AnnIndex), the BM25 leg (FullText; stopwords and question words
   left out of the query), the entity leg (memories naming an entity the query names, when that
   entity is rare among the user's memories: a name in most of them carries no signal; the
   filters judged on the records' vector metadata) and the window leg (what the text index
   does not hold yet, by terms shared with the query: turns acknowledged, from the RAM
   windows; notes and facts stored, from the log's newest end).
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
   around it in its session (an answer sits next to its question) that have some relevance
   of their own (a leg found them, or they are like the query: not a filler); an episode
   lifts its best covered turn, scaled by its FSRS retrievability, instead of taking the
   slots of the ~10 turns it stands for (it is returned itself when ``kinds`` names
   episodes, or when its turns are gone); facts are returned, at most DERIVED_SHARE of the
   slots, and a turn a fact ranked above it stands for is dropped. A question that names one
   of the speakers of the candidate turns ("What did Caroline paint?") favours the turns that
   speaker said (:func:`speaker_of`: meta ``speaker`` or ``name``, or a transcript's
   "Caroline: " before the text) by SPEAKER_LIFT.
5. Expand along links, breadth-first in both directions, to the focus level's depth.
6. Pack into a token budget and return typed hits (``_hits.py``), each with ``explain``: its
   rank in each leg, fused score, lift and FSRS factor. seed 001's sections over this
   pipeline, and their Markdown, are ``_briefing.py``.

Every leg is restricted to the user inside its index; records are then fetched from the store
by lsn with the user's key prefix checked once more.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

import trio

from actors.ann_index import KINDS, AnnIndex, Filters
from actors.base.errors import EngineBroken, EngineClosed, EngineError
from actors.base.messages import Searchable
from actors.base.records import Episode, Fact, Note, Turn
from actors.base.text import composed, folded
from actors.base.where import Node, attributes
from actors.embedder import Embedder
from actors.entities import Entities, extract_entities
from actors.episodic import memory_review_state, retrievability
from actors.facts import Facts, known_at
from actors.fulltext import FullText, TextFilters
from actors.session_buffer import SessionBuffer
from actors.store import (
    LOG_FACT,
    LOG_NOTE,
    Store,
    lsn_key,
    read_episodes,
    read_facts,
    read_links,
    read_memories_by_id,
    read_records,
    read_review_states,
    read_session_turns,
    searchable_at,
    turn_tags,
)
from actors.store.integrity import unseal
from actors.store.replay import fact_searchable

from ._hits import Explain, Hit, estimate_tokens, hit_for

__all__ = ["FOCUS_LEVELS", "LEGS", "Retriever", "focus_settings", "fuse", "one_error", "pack"]

CANDIDATES_PER_LEG = 100  # per leg before fusion, at least (2 x limit when that is more)
# Weights of the legs' z-scores. BM25 and vectors weigh the same (chosen on the LoCoMo dev split
# among 0.3-0.7 for BM25, checked on the generated set); the window leg stands in for BM25 on
# turns not yet indexed; the entity leg only adds to what names a rare entity.
LEG_WEIGHTS = {"bm25": 0.5, "vector": 0.5, "window": 0.5, "entity": 0.1}
LEGS = ("vector", "bm25", "entity", "window")  # the search legs; recall(legs=) picks some
_LEG_ORDER = {leg: i for i, leg in enumerate(LEGS)}  # the order fusion sums them in
MIN_COSINE = 0.2  # a candidate only the vector leg found needs this similarity to the query
NEIGHBOUR_LIFT = (0.3, 0.1)  # share of a turn's fused score given to turns 1 and 2 seqs away
# (seqs away, share): the turn before, then the one after, nearest first.
_NEIGHBOURS = tuple((side * distance, share) for distance, share in enumerate(NEIGHBOUR_LIFT, 1)
                    for side in (-1, 1))
# A neighbour takes that lift only if it has some relevance of its own: a leg found it, or its
# similarity to the query reaches the relevance floor. An answer sits next to its question,
# but so do fillers ("Noted.", "Nice!") that say nothing about anything.
NEIGHBOUR_MIN_COSINE = MIN_COSINE
# An episode lifts its best covered turn by this share of what the episode's fused score
# exceeds the turn's own (the floor for a turn no leg found), and not at all when it does not.
# The episode matched the query through its turns' words: an episode no better than its best
# turn knows nothing that turn does not say, and lifting the turn anyway counts the same
# words twice, enough to pass a turn whose evidence counts once (on the LoCoMo dev split the
# lift by a share of the episode's whole score took two half-answered multi-hop questions'
# evidence out of the top 10, and gained as much at R@5 elsewhere: near-ties, either way). A
# summary that matches better than every turn it covers holds what is spread over them.
EPISODE_LIFT = 0.1
# An episode lifts one covered turn, the one that matches the query best: an episode matched
# because of what one of its turns says, the rest of it shares the topic only. Lifting more
# spends one match several times and lets one episode push several turns out of a cut (on the
# LoCoMo dev split lifting three cost half a question at R@20 against turns-only): with one,
# each prefix of the results differs from the turns-only ranking by at most one turn per
# lifting episode, as if the episode held a slot.
EPISODE_TURNS = 1
# Added to the fused score of a turn said by the one speaker the query names, when the
# candidates hold turns of others too. In a conversation between named people the name in a
# question says whose words hold the answer, yet BM25 weighs it little (it is in half the
# turns) and the entity leg not at all (no evidence of a topic). Measured on the LoCoMo dev
# split as a re-ranking of turns-only candidates: 0.5-2.0 all pay, the middle of that range
# is chosen; temporal questions start to lose above it.
SPEAKER_LIFT = 1.0
SPEAKER_PREFIX = 40  # characters of a turn's text a transcript's "Name: " may take
_SPEAKING = frozenset({"user", "assistant"})  # the roles whose turns a participant said
_WORDS = re.compile(r"[^\W\d_]+")  # runs of letters: a name's words, a query's
# A word of a name (O'Brien, Jean-Luc), and a transcript's "Name: ": one to three of them.
_NAME = r"[^\W\d_]+(?:['’.-][^\W\d_]+)*"
_NAMES = re.compile(_NAME)
_SPEAKER = re.compile(rf"({_NAME})\.?((?: {_NAME}\.?){{0,2}}): ")
DERIVED_SHARE = 0.2  # at most this share of the slots go to facts (and episodes, asked for)
RARE_ENTITY = 0.05  # an entity named in more than this share of the memories is no evidence
COMMON_AFTER = 8  # ... once it is named in more memories than this (a new user has few)
LINK_DECAY = 0.5  # a linked memory scores this fraction of the memory it was reached from
# Memories link expansion takes from any one memory, and per hit in all: a memory linked to
# thousands (a hub a caller made) turned a recall of three into 2,200 hits.
LINK_FANOUT = 8
TAGGED_LIMIT = 100_000  # records a tag filter can admit to the vector leg
# Log positions the window leg looks back over for notes and facts the text index does not hold
# yet: what a steady text index leaves uncommitted at most (fulltext.COMMIT_DOCS). Further
# behind (a bulk import, a rebuild) the newest writes are still covered. Read only while the
# text index is behind; a full look back costs ~1-2 ms of a worker thread here.
FRESH_SCAN = 4_096

# Seed 000's focus levels: results, time window, link depth.
FOCUS_LEVELS = {
    0: {"limit": 2, "hours": 1, "link_depth": 0},
    1: {"limit": 5, "hours": 4, "link_depth": 1},
    2: {"limit": 8, "hours": 12, "link_depth": 1},
    3: {"limit": 10, "hours": 24, "link_depth": 2},
    4: {"limit": 15, "hours": 72, "link_depth": 3},
    5: {"limit": 20, "hours": 168, "link_depth": 3},
}


@contextmanager
def one_error() -> Iterator[None]:
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
                     link_types: tuple[str, ...] | None = None,
                     tags: tuple[str, ...] | None = None,
                     only: list[int] | None = None,
                     legs: tuple[str, ...] = LEGS,
                     where: Node | None = None,
                     as_of: datetime | None = None
                     ) -> list[Hit]:
        """The pipeline; arguments are validated by the facade. ``only``: these lsns and no
        others (the facts a category or importance filter admits), applied in every index.
        ``legs``: the legs that run (the benchmark measures each alone). ``where``: a
        compiled metadata filter, applied inside every leg (a tantivy query in BM25's, the
        lsns it admits as the vector and entity legs' mask, the record itself in the window
        legs'). ``as_of``: answer as the store knew it then (see :meth:`_past`)."""
        ranked: dict[str, list[tuple[int, float]]] = {}
        hidden: list[int] = []
        past: dict[int, Fact] = {}
        if as_of is not None:
            # Every kind's index time is at or before when the store learned of it (a turn's
            # time, a note version's, an episode's end, a fact's recording), so the time range
            # does most of it inside each index; what it cannot tell is excluded by lsn.
            until = as_of if until is None else min(until, as_of)
            hidden, past = await self._past(user_id, as_of, kinds)
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
        matched: dict[int, int] = {}  # the chunk the vector leg found a long memory by

        def put(leg: str, part: str, found: list[tuple[int, float]]) -> None:
            (others if part else ranked)[leg] = found

        # Tags and ``where`` live in the text index's terms; the records they admit become
        # the vector and entity legs' mask.
        masked = tags is not None or where is not None
        mask: list[list[int]] = []
        mask_ready = trio.Event()  # set once ``mask`` holds what tags and ``where`` admit

        async def mask_leg() -> None:
            mask.append(await self._mask(user_id, tags, where))
            mask_ready.set()

        async def vector_leg() -> None:
            vector.append(await self.embedder.embed_query(query, user_id))
            lsns = None
            if masked:
                await mask_ready.wait()
                lsns = mask[0]
            if only is not None:
                lsns = only if lsns is None else sorted(set(lsns) & set(only))
            # Every part's search in one worker thread call (a round trip each cost more).
            found = await self.ann.search_each(
                user_id, vector[0], depth,
                [Filters(session_id, since, until, roles, part_kinds, lsns, hidden)
                 for part_kinds in searches.values()], matched)
            for part, hits in zip(searches, found, strict=True):
                put("vector", part, hits)

        async def past_leg() -> None:
            # Fact versions retired since as_of left both indexes: scored here, by meaning
            # and by the query's terms (the window leg's score), in the facts' list.
            facts = [f for f in past.values() if (only is None or f.lsn in only)
                     and _matches(f, session_id, since, until, roles, kinds, tags, where)]
            if not facts:
                return
            texts = [fact_searchable(f).text for f in facts]
            query_vector = await self.embedder.embed_query(query, user_id)
            vectors = await self.embedder.embed(texts, query=True)
            terms = set(self.fulltext.query_terms(query))
            part = "other" if split else ""
            cosines = [(f.lsn, float(x)) for f, x in zip(facts, (vectors @ query_vector).tolist(),
                                                          strict=True)]
            shared = [(f.lsn, float(len(terms.intersection(self.fulltext.terms(text)))))
                      for f, text in zip(facts, texts, strict=True)]
            retired["vector"] = (part, cosines)
            retired["window"] = (part, [(lsn, n) for lsn, n in shared if n > 0])

        # The text index holds times to the second, cut down: from ``since``'s second, so a
        # memory said later within it is not lost (the exact bound is checked on the records).
        text_since = None if since is None else since.replace(microsecond=0)

        # The query's embedding is the longest stage, and the vector leg and everything after
        # it wait for it: the legs that do not need it let the vector leg run first, so its
        # request is in the model before they take the loop (the order of tasks started
        # together is the scheduler's).
        embedding_first = "vector" in legs

        async def bm25_leg() -> None:
            if embedding_first:
                await trio.lowlevel.checkpoint()
            # Every part's search in one worker thread call, over one searcher.
            found = await self.fulltext.search_each(user_id, query, depth, [
                TextFilters(session_id, text_since, until, roles, part_kinds, tags, only, where,
                            hidden) for part_kinds in searches.values()])
            for part, hits in zip(searches, found, strict=True):
                put("bm25", part, hits)

        async def fresh_leg(part: str, fresh: tuple[str, ...]) -> None:
            found = await self._fresh_leg(user_id, query, fresh, where)
            if found:
                put("window", part, found)

        async def entity_leg() -> None:
            if embedding_first:
                await trio.lowlevel.checkpoint()
            found = await self._entity_leg(user_id, query)
            # The recall's filters inside the leg, as in the others: a memory they exclude
            # takes no place in its ranking nor in how its scores are normalised.
            filters = Filters(session_id, since, until, roles, kinds, None, hidden)
            if found and filters.any():
                admitted = await self.ann.admitted(user_id, [lsn for lsn, _ in found], filters)
                found = [pair for pair in found if pair[0] in admitted]
            if masked:
                await mask_ready.wait()
                admitted = set(mask[0])
                found = [pair for pair in found if pair[0] in admitted]
            if found:
                ranked["entity"] = found[:depth]

        retired: dict[str, tuple[str, list[tuple[int, float]]]] = {}
        with one_error():
            async with trio.open_nursery() as nursery:
                if masked and ("vector" in legs or "entity" in legs):
                    nursery.start_soon(mask_leg)
                if "vector" in legs:
                    nursery.start_soon(vector_leg)
                if past and legs != ("entity",):
                    nursery.start_soon(past_leg)
                if "bm25" in legs:
                    nursery.start_soon(bm25_leg)
                if "entity" in legs and only is None:
                    nursery.start_soon(entity_leg)
                if "window" in legs:
                    ranked["window"] = self._window_leg(user_id, query, session_id, since,
                                                        until, roles, kinds, tags, where)
                    # Notes and facts: in the other kinds' list, or the only list when the
                    # query admits no turns (then the turns' window above is empty).
                    part = "other" if split else ""
                    fresh = tuple(k for k in (searches[part] or KINDS) if k in ("note", "fact"))
                    if fresh and self.fulltext.indexed_lsn < self.store.committed_lsn:
                        nursery.start_soon(fresh_leg, part, fresh)
        for leg, (part, found) in retired.items():
            if leg in legs or (leg == "window" and "bm25" in legs):
                into = others if part else ranked
                into[leg] = sorted([*into.get(leg, ()), *found], key=lambda p: (-p[1], -p[0]))
        # The memories a leg chose from: all the vector leg could rank, up to its depth.
        population = len(ranked.get("vector", ())) or depth
        fused = fuse(ranked, population)
        # The other kinds, each on the scale of the same leg's (turn) candidates.
        added = fuse(others, population, ranked)
        cosine = dict(ranked.get("vector", ())) | dict(others.get("vector", ()))

        def head(scores: dict[int, tuple[float, dict[str, int]]]) -> list[int]:
            # The relevance floor: only the vector leg found it, and not by much. Best first,
            # equal scores newest first.
            kept = sorted([(-f[0], -lsn) for lsn, f in scores.items()
                           if len(f[1]) > 1 or "vector" not in f[1] or cosine[lsn] >= MIN_COSINE])
            return [-negative for _, negative in kept[: limit * 3 + 20]]

        first = head(fused)

        def above(n: int) -> float:
            # The score a memory of another kind needs to rank among the first n of one
            # ranking with the turns (whose places it does not take).
            return fused[first[n - 1]][0] if len(first) >= n else -math.inf

        bar = above(limit * 3 + 20)
        second = [lsn for lsn in head(added) if lsn not in fused and added[lsn][0] >= bar]
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
            memory = records.get(lsn) or past.get(lsn) or self.buffer.recent_turn(user_id, lsn)
            if (memory is not None and (allowed is None or lsn in allowed)
                    and (as_of is None or known_then(memory, as_of))):
                memories[lsn] = memory
        scored, explain_of = self._lift(user_id, memories, fused, lifting, around, covered,
                                        states, cosine, vector[0] if vector else None, kinds,
                                        primary, matched, query)
        hits: list[Hit] = []
        derived = 0
        cap = max(1, int(limit * DERIVED_SHARE))
        mixed = kinds is None or "turn" in kinds
        said: set[tuple[str, ...]] = set()  # the contents already shown, per scope
        # The turns an episode or a fact ranked above them stands for: their slots go to
        # memories that add something.
        represented: set[str] = set()
        for score, _, memory in scored:
            if (not _matches(memory, session_id, since, until, roles, kinds, tags, where)
                    or (as_of is not None and not known_then(memory, as_of))):
                continue  # deleted since it was indexed, or not quite what the filter asked
            if type(memory) in (Turn, Note):
                content = _content_key(memory)
                if content in said:
                    continue  # the same words again: the better-ranked one stands for both
                said.add(content)
                if type(memory) is Turn and memory.turn_id in represented:
                    continue
            if mixed and type(memory) in (Episode, Fact):
                if derived == cap:
                    continue
                derived += 1
            explain, via = explain_of(memory.lsn)
            hit = hit_for(memory, score, via, explain)
            if hit.kind in ("episode", "fact"):
                represented.update(hit.turn_ids)
            hits.append(hit)
            if len(hits) == limit:
                break
        if link_depth > 0 and hits:
            hits += await self._expand(
                user_id, hits, link_depth, link_types, as_of,
                lambda m: _matches(m, session_id, since, until, roles, kinds, tags, where))
        return pack(hits, budget_tokens)

    async def _mask(self, user_id: str, tags: tuple[str, ...] | None,
                    where: Node | None) -> list[int]:
        """The lsns of the user's records that carry one of ``tags`` and pass ``where``: those
        the text index holds (at most TAGGED_LIMIT), and with a ``where`` those it does not hold
        yet, judged on the records themselves (turns from the RAM windows, notes and facts
        from the log's newest end)."""
        indexed = self.fulltext.indexed_lsn  # before the search: its searcher covers this much
        lsns = await self.fulltext.tagged(user_id, tags, TAGGED_LIMIT, where)
        if where is None:
            return lsns
        fresh = [turn.lsn for turn in self.buffer.turns_after(user_id, indexed)
                 if _matches(turn, None, None, None, None, None, tags, where)]
        if indexed < self.store.committed_lsn:
            records = await self.store.read(_read_fresh, user_id, ("note", "fact"), indexed,
                                            self.store.committed_lsn)
            fresh += [r.lsn for r in records if _fresh_matches(r, tags, where)]
        return lsns + fresh if fresh else lsns

    async def _past(self, user_id: str, as_of: datetime, kinds: tuple[str, ...] | None
                    ) -> tuple[list[int], dict[int, Fact]]:
        """What a recall ``as_of`` must exclude from the indexes that their time range lets
        through, and the fact versions it must add that the indexes no longer hold.

        Excluded: facts recorded by ``as_of`` but not yet in force then (``valid_at`` later),
        and episodes of turns before ``as_of`` made after it. Added: fact versions the store
        held as true at ``as_of`` (:func:`known_at`) and retired by now (since, or before it
        but still in force then: superseded by a value in force from later), by lsn."""
        facts: list[Fact] = []
        episodes: list[Episode] = []
        if kinds is None or "fact" in kinds:
            await self.store.wait_logged()
            facts = await self.store.read(read_facts, user_id, False)
        if kinds is None or "episode" in kinds:
            episodes = await self.store.read(read_episodes, user_id, None)
        # Only what the time range lets through (index time at or before as_of) needs it.
        hidden = [f.lsn for f in facts
                  if f.status == "active" and f.created_at <= as_of < f.valid_at]
        hidden += [e.lsn for e in episodes if e.end_at <= as_of < e.created_at]
        past = {f.lsn: f for f in facts if f.status != "active" and known_at(f, as_of)}
        return hidden, past

    def _lift(self, user_id: str, memories: dict[int, Any],
              fused: dict[int, tuple[float, dict[str, int]]], lifting: set[int],
              around: dict[tuple[str, int], Turn], covered: dict[str, list[Turn]],
              states: dict[str, Any], cosine: dict[int, float], vector: Any,
              kinds: tuple[str, ...] | None, primary: dict[int, float],
              matched: dict[int, int] | None = None, query: str = ""
              ) -> tuple[list[tuple[float, int, Any]],
                         Callable[[int], tuple[Explain, tuple[str, ...]]]]:
        """Candidates with lifted scores, best first: each of ``lifting`` that is a turn lifts
        its neighbours, each that is an episode its best covered turn by what the episode
        matches beyond that turn (see EPISODE_LIFT; an episode drops out
        unless ``kinds`` names episodes or its turns are gone), and the turns of the one
        speaker ``query`` names take SPEAKER_LIFT (:func:`asked_speaker`). ``primary``: the
        fused scores from the turns' lists alone (see ``recall``). Returns [(score, lsn,
        memory)] and what explains a memory's score and says what found it (made only for the
        hits)."""
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

        # Neighbours with relevance of their own (see NEIGHBOUR_MIN_COSINE), by (session,
        # seq). Without the query's vector (the vector leg did not run), or the neighbour's
        # (not embedded yet), relevance cannot be judged and the neighbour counts.
        # The similarities both need (these neighbours', the covered turns of the episodes
        # that lift one), in one pass over the turns' rows.
        near: dict[int, float] = {}
        if vector is not None:
            wanted = [t.lsn for t in around.values() if t.lsn not in fused]
            for lsn, memory in memories.items():
                if (type(memory) is Episode and lsn in lifting and base[lsn] > 0
                        and covered.get(memory.episode_id)):
                    wanted += [t.lsn for t in covered[memory.episode_id]]
            if wanted:
                near = self.ann.similarities(user_id, vector, wanted, "turn")
        if vector is None:
            relevant = around
        else:
            relevant = {place: turn for place, turn in around.items()
                        if turn.lsn in fused or near.get(turn.lsn, NEIGHBOUR_MIN_COSINE)
                        >= NEIGHBOUR_MIN_COSINE}

        now = self.clock()
        fsrs: dict[int, float] = {}
        standing: set[int] = set()  # episodes returned themselves
        for lsn, memory in memories.items():
            kind = type(memory)
            if kind is Turn and lsn in lifting:
                if not relevant:
                    continue
                score = base[lsn]
                session, seq = memory.session_id, memory.seq
                by = (memory.turn_id, "neighbour")
                for offset, share in _NEIGHBOURS:
                    other = relevant.get((session, seq + offset))
                    if other is not None:  # give(), inline: the most frequent call here
                        near_lsn = other.lsn
                        if near_lsn not in memories:
                            extra[near_lsn] = other
                        lift[near_lsn] = lift.get(near_lsn, 0.0) + share * score
                        sources = lifted_by.get(near_lsn)
                        if sources is None:
                            lifted_by[near_lsn] = [by]
                        else:
                            sources.append(by)
            elif kind is Episode:
                state = states.get(memory.episode_id) or memory_review_state(memory)
                r = fsrs[lsn] = retrievability(state.stability, state.last_review, now)
                turns = covered.get(memory.episode_id, [])
                if not turns or (kinds is not None and "episode" in kinds):
                    standing.add(lsn)
                if lsn in lifting and turns and base[lsn] > 0:
                    score = base[lsn]
                    best = sorted(turns, key=lambda t: (t.lsn not in base, -base.get(t.lsn, 0.0),
                                                        -near.get(t.lsn, -1.0)))
                    for turn in best[:EPISODE_TURNS]:
                        beyond = score - base.get(turn.lsn, floor)
                        if beyond > 0:
                            give(turn, EPISODE_LIFT * r * beyond, memory.episode_id, "episode")
        # ``extra`` holds turns only: the neighbours and episodes' turns lifted.
        speakers = {lsn: speaker_of(m) for lsn, m in memories.items() if type(m) is Turn}
        speakers.update((lsn, speaker_of(m)) for lsn, m in extra.items())
        asked = asked_speaker(query, speakers.values())
        bonus = {lsn for lsn, who in speakers.items() if who == asked} if asked else set()
        out = []
        exp = math.exp
        # logistic(total), inline (its clamp too, without the min and max calls): this runs
        # for every candidate of every recall. (score, lsn, memory) sorted in reverse: best
        # first, equal scores newest first; lsns are unique, so no memory is ever compared.
        for lsn, memory in memories.items():
            if type(memory) is Episode and lsn not in standing:
                continue
            total = base[lsn] + lift.get(lsn, 0.0)
            if lsn in bonus:
                total += SPEAKER_LIFT
            total = total if total < 50.0 else 50.0
            total = total if total > -50.0 else -50.0
            out.append((1.0 / (1.0 + exp(-total)) * fsrs.get(lsn, 1.0), lsn, memory))
        for lsn, memory in extra.items():  # no fused score of their own, no FSRS factor
            total = floor + lift[lsn]
            if lsn in bonus:
                total += SPEAKER_LIFT
            total = total if total < 50.0 else 50.0
            total = total if total > -50.0 else -50.0
            out.append((1.0 / (1.0 + exp(-total)), lsn, memory))
        out.sort(reverse=True)

        def explain_of(lsn: int) -> tuple[Explain, tuple[str, ...]]:
            ranks = fused[lsn][1] if lsn in memories else {}
            sources = lifted_by.get(lsn, ())
            explain = Explain(ranks=dict(ranks), fused=base.get(lsn, 0.0),
                              lift=lift.get(lsn, 0.0),
                              lifted_by=tuple(dict.fromkeys(s for s, _ in sources)),
                              fsrs=fsrs.get(lsn, 1.0),
                              speaker=SPEAKER_LIFT if lsn in bonus else 0.0,
                              cosine=cosine.get(lsn),
                              chunk=None if matched is None else matched.get(lsn))
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
        registry = await self.entities.lookup(user_id, names)
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
                    tags: tuple[str, ...] | None, where: Node | None = None
                    ) -> list[tuple[int, float]]:
        """Turns acknowledged but not yet in the text index, scored by terms shared with the
        query, then recency: read-your-writes for recall."""
        if kinds is not None and "turn" not in kinds:
            return []
        terms = set(self.fulltext.query_terms(query))
        if not terms:
            return []
        scored = []
        for turn in self.buffer.turns_after(user_id, self.fulltext.indexed_lsn):
            if not _matches(turn, session_id, since, until, roles, None, tags, where):
                continue
            shared = len(terms.intersection(self.fulltext.terms(turn.text)))
            if shared:
                scored.append((-shared, -turn.lsn, turn.lsn))
        scored.sort()
        return [(lsn, float(-shared)) for shared, _, lsn in scored[:CANDIDATES_PER_LEG]]

    async def _fresh_leg(self, user_id: str, query: str, kinds: tuple[str, ...],
                         where: Node | None = None) -> list[tuple[int, float]]:
        """Notes and facts stored but not yet in the text index, scored by terms shared with
        the query, then recency: read-your-writes for what the RAM windows do not hold.
        ``where`` applies here; the other filters but ``kinds`` to the records read for the
        results."""
        terms = set(self.fulltext.query_terms(query))
        if not terms:
            return []
        records = await self.store.read(_read_fresh, user_id, kinds, self.fulltext.indexed_lsn,
                                        self.store.committed_lsn)
        scored = []
        for record in records:
            if not _fresh_matches(record, None, where):
                continue
            shared = len(terms.intersection(self.fulltext.terms(record.text)))
            if shared:
                scored.append((-shared, -record.lsn, record.lsn))
        scored.sort()
        return [(lsn, float(-shared)) for shared, _, lsn in scored[:CANDIDATES_PER_LEG]]

    async def _expand(self, user_id: str, hits: list[Hit], depth: int,
                      types: tuple[str, ...] | None, as_of: datetime | None,
                      admits: Callable[[Any], bool]) -> list[Hit]:
        """Breadth-first along links in both directions (of ``types`` only, if given);
        memories already found are skipped, and those the query's filters do not admit
        (``admits``: kinds, session, time range, roles, tags, ``where``), which still lead
        on to the memories linked to them; with ``as_of``, links and memories made later
        too. At most LINK_FANOUT memories are taken from any one memory, and LINK_FANOUT per
        hit in all."""
        seen = {h.id for h in hits}
        score_of = {h.id: h.score for h in hits}
        frontier = [h.id for h in hits]
        found: list[tuple[str, float]] = []
        room = LINK_FANOUT * len(hits)
        for _ in range(depth):
            links = await self.store.read(read_links, user_id, frontier)
            next_frontier = []
            for source in frontier:
                taken = 0
                for link in links.get(source, []):
                    if taken == LINK_FANOUT or len(found) == room:
                        break
                    if ((types is not None and link.type not in types)
                            or (as_of is not None and link.at > as_of)):
                        continue
                    other = link.to_id if link.from_id == source else link.from_id
                    if other not in seen:
                        seen.add(other)
                        score_of[other] = score_of[source] * LINK_DECAY
                        found.append((other, score_of[other]))
                        next_frontier.append(other)
                        taken += 1
            frontier = next_frontier
            if not frontier or len(found) == room:
                break
        memories = await self.store.read(read_memories_by_id, user_id, [i for i, _ in found])
        return [hit_for(memories[i], score, ("link",)) for i, score in found if i in memories
                and admits(memories[i]) and _current(memories[i], as_of)]

def _read_fresh(txn: Any, dbs: dict[bytes, Any], user_id: str, kinds: tuple[str, ...],
                after: int, upto: int) -> list[Any]:
    """The user's notes and facts of ``kinds`` logged in (after, upto] and still current (a
    note's latest version, an active fact), newest first, among the last FRESH_SCAN log
    positions at most; turns are passed over by their log entry's first byte."""
    cursor = txn.cursor(dbs[b"log"])
    # The newest position at or below ``upto``.
    if cursor.set_range(lsn_key(upto + 1)):
        if not cursor.prev():
            return []
    elif not cursor.last():
        return []
    marks = {{"note": LOG_NOTE, "fact": LOG_FACT}[k] for k in kinds}
    found = []
    # Raw values: a sealed entry's first byte is its kind; only notes' and facts' are checked.
    for looked, (key, raw) in enumerate(cursor.raw.iterprev()):
        lsn = int.from_bytes(key, "big")
        if lsn <= after or looked == FRESH_SCAN:
            break
        if raw[:1] in marks:
            record = searchable_at(txn, dbs, lsn, unseal(raw, b"log", key))
            if record is not None and record.user_id == user_id:
                found.append(record)
    return found


def _content_key(memory: Turn | Note) -> tuple[str, ...]:
    """What makes two turns or notes the same memory for recall (seed 003 indexes a content
    hash once per scope): kind, role, scope and the words, ignoring case, spacing and
    Unicode's composed or decomposed forms."""
    role = memory.role if type(memory) is Turn else ""
    return (type(memory).__name__, role, memory.agent_id, memory.run_id,
            folded(memory.text))


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
        lsn -> (fused score, {leg: rank from 1 in the list that found it}), the legs summed
        and ranked in LEGS' order whatever order ``ranked`` holds them in (the order the
        legs' searches finished): the same store gives the same scores to the last bit.
    """
    out: dict[int, tuple[float, dict[str, int]]] = {}
    for leg in sorted(ranked, key=_LEG_ORDER.__getitem__):
        found = ranked[leg]
        if not found:
            continue
        values = [score for _, score in ((scale.get(leg) or found) if scale else found)]
        n = len(values) if leg == "vector" else max(len(values), population)
        mean = sum(values) / n
        spread = math.sqrt((sum([(v - mean) ** 2 for v in values])
                            + (n - len(values)) * mean * mean) / n)
        weight = LEG_WEIGHTS[leg]
        alike = not spread > 1e-9  # one candidate, or all alike: each is one deviation above
        for rank, (lsn, score) in enumerate(found, 1):
            z = 1.0 if alike else (score - mean) / spread
            entry = out.get(lsn)
            if entry is None:
                out[lsn] = (0.0 + weight * z, {leg: rank})
            else:
                entry[1][leg] = rank
                out[lsn] = (entry[0] + weight * z, entry[1])
    return out


def logistic(x: float) -> float:
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


def speaker_of(turn: Turn) -> str | None:
    """Who said a turn, as the lower-case first word of their name (O'Brien, Jean-Luc kept
    whole): meta ``speaker`` or ``name`` (the participant's name in OpenAI's chat messages)
    when it is text, else a transcript's "Name: " at the start of the text (one to three
    capitalised words, within SPEAKER_PREFIX characters). A one-letter first word names
    nobody ("A: " in a Q&A transcript). A tool's or the system's turn has no speaker (a tool
    message's ``name`` is its function's, "Error: ..." is no name). None when neither says."""
    if turn.role not in _SPEAKING:
        return None
    meta = turn.meta
    if meta:
        for key in ("speaker", "name"):
            value = meta.get(key)
            if type(value) is str:
                return _name_key(composed(value))
    text = turn.text
    # Most turns name no one. An ASCII text is its own composed form (and CPython keeps
    # whether a string is ASCII as a flag: no scan), so no ": " among its first
    # SPEAKER_PREFIX characters says so without copying and composing them.
    if text.isascii() and text.find(": ", 0, SPEAKER_PREFIX) < 0:
        return None
    text = composed(text[:SPEAKER_PREFIX])  # a name sent decomposed is the name
    if text.find(": ", 0, SPEAKER_PREFIX) < 0:
        return None
    found = _SPEAKER.match(text, 0, SPEAKER_PREFIX)
    if found is None:
        return None
    first, rest = found.groups()
    if not first[0].isupper() or len(first) < 2 or (
            rest and not all(w[0].isupper() for w in rest[1:].split(" "))):
        return None
    return first.lower()


def _name_key(name: str) -> str | None:
    found = _NAMES.search(name)
    return found[0].lower() if found and len(found[0]) > 1 else None


def asked_speaker(query: str, speakers: Iterable[str | None]) -> str | None:
    """The one speaker among ``speakers`` (:func:`speaker_of` of the candidate turns) that
    ``query`` names, when the candidates hold turns of others too: naming two, or a
    conversation of one voice, says nothing about whose words hold the answer."""
    present = set(speakers)
    if len(present) < 2:
        return None
    query = composed(query).lower()  # its words, and its names whole ("Caroline's": caroline)
    asked = present.intersection([*_WORDS.findall(query), *_NAMES.findall(query)])
    return asked.pop() if len(asked) == 1 else None


def _matches(memory: Turn | Note | Episode | Fact, session_id: str | None,
             since: datetime | None, until: datetime | None, roles: tuple[str, ...] | None,
             kinds: tuple[str, ...] | None, tags: tuple[str, ...] | None,
             where: Node | None = None) -> bool:
    if where is not None and not where.matches(attributes(memory)):
        return False
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


def _fresh_matches(record: Searchable, tags: tuple[str, ...] | None, where: Node | None
                   ) -> bool:
    """Whether tags and ``where`` admit a note or fact read back as the text index takes it
    (:func:`_read_fresh`): its ``tags`` (a fact's are its category) and ``attrs`` are what
    the index holds of it, so it is admitted exactly as it will be once indexed."""
    return ((tags is None or not set(tags).isdisjoint(record.tags))
            and (where is None or where.matches(record.attrs)))


def _current(memory: Turn | Note | Episode | Fact, as_of: datetime | None) -> bool:
    """Whether a memory a link reaches may be shown: as it was known at ``as_of``, or, now,
    any but a fact version retired since it was linked (forgotten, corrected, decayed), which
    the search legs no longer find either."""
    if as_of is not None:
        return known_then(memory, as_of)
    return type(memory) is not Fact or memory.status == "active"


def known_then(memory: Turn | Note | Episode | Fact, as_of: datetime) -> bool:
    """Whether the store knew this memory, as it is, at ``as_of``: a turn said by then, a
    note version written by then (earlier versions are not kept), an episode made by then,
    a fact version held as true then (recorded, in force and not yet retired)."""
    kind = type(memory)
    if kind is Fact:
        return known_at(memory, as_of)
    if kind is Episode:
        return memory.created_at <= as_of
    if kind is Note:
        return memory.updated_at <= as_of
    return memory.at <= as_of


def _entity_keys(query: str) -> list[str]:
    """Registry keys a query may name: its entities, and its words and word pairs lower-cased
    (people ask "what did maya say", not "Maya"), as composed text like the registry's."""
    query = composed(query)
    keys = [name.lower() for name, kind in extract_entities(query) if kind != "date"]
    words = [w for w in re.findall(r"[\w@#'.-]+", query.lower()) if len(w) > 2]
    words = [w.strip(".'") for w in words]
    keys += words + [f"{a} {b}" for a, b in zip(words, words[1:])]
    return sorted(set(k for k in keys if k))[:64]


def focus_settings(focus: int | None, now: datetime) -> dict[str, Any]:
    """limit, since and link depth for a focus level (None: no window, no links)."""
    if focus is None:
        return {"limit": 10, "since": None, "link_depth": 0}
    level = FOCUS_LEVELS[focus]
    return {"limit": level["limit"], "since": now - timedelta(hours=level["hours"]),
            "link_depth": level["link_depth"]}

