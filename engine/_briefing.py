"""seed 001's retrieve: what a prompt shows before a reply, and its Markdown.

Two sections, searched in parallel through the recall pipeline (``_retrieval.py``):

- **semantic**: the user's active facts the query matches (vector and BM25 over facts alone,
  facts not yet indexed by shared terms), then the standing facts (importance at least
  STANDING_IMPORTANCE) that every prompt should carry;
- **episodic**: episodes and turns, an episode replacing the turns it covers, each with the
  messages it stands for and its FSRS state.

``render_markdown`` turns a :class:`RetrieveResult` into seed 001's Markdown.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from typing import Any, Literal

import trio

from actors.base.records import Episode, Fact, Turn
from actors.episodic import memory_review_state
from actors.store import (
    read_memories_by_id,
    read_review_states,
    read_session_turns,
    read_turn_contexts,
)

from ._hits import EpisodicItem, Hit, Message, RetrieveResult, SemanticItem
from ._retrieval import LEGS, Retriever, logistic, one_error

__all__ = ["Briefing", "Detail", "render_markdown", "relative_time", "one_line", "block_text",
           "in_force_note"]

Detail = Literal["auto", "none", "low", "high"]
KEY_MOMENT = 0.7  # surprise at or above which an episode is a "key moment" (seed 001)
STANDING_IMPORTANCE = 0.8  # facts at least this important join every semantic section
EPISODIC_POOL = 3  # hits recall brings per episodic item: covered turns give way to episodes
FACT_LEGS = ("vector", "bm25")  # the legs that search facts for the semantic section


class Briefing:
    """seed 001's sections over the recall pipeline. Runs in the caller's task; holds no state
    of its own beyond the retriever."""

    def __init__(self, retriever: Retriever) -> None:
        self.retriever = retriever

    async def retrieve(self, user_id: str, query: str, *, conversation_id: str | None,
                       episodic_limit: int, semantic_limit: int, category: str | None,
                       min_importance: float, episodic: bool,
                       legs: tuple[str, ...] | None = None) -> RetrieveResult:
        """seed 001's retrieval: the semantic leg (active facts matching the query, then the
        user's most important standing facts) and the episodic leg (episodes, FSRS-re-ranked,
        and turns no shown episode covers yet, each with its neighbouring turns). ``legs``:
        the search legs that run (None: all)."""
        semantic: list[SemanticItem] = []
        items: list[EpisodicItem] = []
        with one_error():
            async with trio.open_nursery() as nursery:
                if semantic_limit:
                    async def semantic_leg() -> None:
                        semantic.extend(await self._semantic(user_id, query, semantic_limit,
                                                             category, min_importance, legs))
                    nursery.start_soon(semantic_leg)
                if episodic and episodic_limit:
                    async def episodic_leg() -> None:
                        items.extend(await self._episodic(user_id, query, episodic_limit,
                                                          legs))
                    nursery.start_soon(episodic_leg)
        return RetrieveResult(semantic, items)

    async def _semantic(self, user_id: str, query: str, limit: int, category: str | None,
                        min_importance: float,
                        legs: tuple[str, ...] | None = None) -> list[SemanticItem]:
        shown = await self.retriever.facts.for_prompt(user_id, category, min_importance)
        if not shown:
            return []
        # The search runs over the active versions. A version held true until one due later
        # is in neither index (it was retired): it comes along right before that one, or
        # stands alone where the filters left that one out (Facts.for_prompt).
        profile = [f for f, _ in shown if f.status == "active"]
        kept = {f.fact_id for f in profile}
        along: dict[str, list[Fact]] = {}
        alone: list[Fact] = []
        for fact, then in shown:
            if then is not None and then.fact_id in kept:
                along.setdefault(then.fact_id, []).append(fact)
            elif then is not None:
                alone.append(fact)
        companions = {f.fact_id for held in along.values() for f in held}
        by_lsn = {f.lsn: f for f in profile}
        # Facts are searched by meaning and by words; the other legs find turns.
        search = tuple(leg for leg in FACT_LEGS if legs is None or leg in legs)
        hits = await self.retriever.recall(user_id, query, limit=limit, session_id=None,
                                           since=None, until=None, roles=None, kinds=("fact",),
                                           link_depth=0, budget_tokens=None, only=sorted(by_lsn),
                                           legs=search) if search and profile else []
        by_id = {f.fact_id: f for f in profile}
        chosen: list[tuple[Fact, float]] = [(by_id[h.id], h.score) for h in hits
                                            if h.id in by_id]
        # Read-your-writes: facts stored but not yet in the text index, by shared terms (what
        # recall's window leg does for notes and facts); so are held versions standing alone.
        indexed = self.retriever.fulltext.indexed_lsn
        fresh = ([f for f in profile if f.lsn > indexed] + alone
                 if legs is None or "window" in legs else [])
        if fresh:
            terms = set(self.retriever.fulltext.query_terms(query))
            # The vectors may hold a fact the text index does not yet: it is shown once, with
            # the better of its two scores.
            place = {f.fact_id: i for i, (f, _) in enumerate(chosen)}
            for fact in fresh:
                shared = len(terms.intersection(self.retriever.fulltext.terms(fact.text)))
                if shared:
                    # The share of the query's terms it has, on the hits' (0, 1) scale.
                    score = logistic(shared / len(terms))
                    i = place.get(fact.fact_id)
                    if i is None:
                        chosen.append((fact, score))
                    elif score > chosen[i][1]:
                        chosen[i] = (fact, score)
            chosen.sort(key=lambda pair: -pair[1])
        # The deterministic part: standing facts (name, allergies, instructions...) always
        # come along, after the ones the query found.
        seen = {f.fact_id for f, _ in chosen}
        for fact, _ in shown:
            if len(chosen) >= limit:
                break
            if (fact.fact_id not in seen and fact.fact_id not in companions
                    and fact.importance >= STANDING_IMPORTANCE):
                chosen.append((fact, 0.0))
        # Cut first: a held version rides along with the one it gives way to, taking no place.
        chosen = [(f, score) for fact, score in chosen[:limit]
                  for f in (*along.get(fact.fact_id, ()), fact)]
        # Conversations, not sources: a fact restated three times in one session came from
        # one conversation. One read finds the sessions of every shown fact's sources.
        sources = sorted({s for f, _ in chosen for s in (f.source_episode_ids
                                                          or f.source_turn_ids)})
        found = (await self.retriever.store.read(read_memories_by_id, user_id, sources)
                 if sources else {})

        def conversations(f: Fact) -> int:
            sessions = {found[s].session_id for s in (f.source_episode_ids or f.source_turn_ids)
                        if s in found}
            return len(sessions or ({f.session_id} - {""}))

        return [SemanticItem(id=f.fact_id, conversation_id=f.session_id or None,
                             category=f.category, fact=f.text, keywords=list(f.keywords),
                             source_episodic_ids=list(f.source_episode_ids or f.source_turn_ids),
                             valid_at=f.valid_at, invalid_at=f.invalid_at, score=score,
                             conversations=conversations(f))
                for f, score in chosen]

    async def _episodic(self, user_id: str, query: str, limit: int,
                        legs: tuple[str, ...] | None = None) -> list[EpisodicItem]:
        found = await self.retriever.recall(user_id, query, limit=limit * EPISODIC_POOL,
                                            session_id=None, since=None, until=None, roles=None,
                                            kinds=("episode", "turn"), link_depth=0,
                                            budget_tokens=None, legs=legs or LEGS)
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
        episodes, contexts, states = await self.retriever.store.read(
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
                    start_at=min(times), end_at=max(times), created_at=hit.at,
                    last_reviewed_at=reviewed.last_review if reviewed else None,
                    consolidated_at=None, score=hit.score))
        return items


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


def _title(text: str, words: int = 8) -> str:
    first = text.strip().split("\n", 1)[0].split()
    return " ".join(first[:words]) + ("..." if len(first) > words else "")


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


def in_force_note(valid_at: datetime, invalid_at: datetime | None, now: datetime) -> str:
    """' (from 2026-04-10)' for a fact due later (' (from 2026-04-10 until 2026-05-01)' if it
    gives way to another then), ' (until 2026-04-10)' for one in force until a time to come,
    else nothing: how a prompt line says when a fact holds (:func:`moment`)."""
    if valid_at > now:
        until = "" if invalid_at is None else f" until {moment(invalid_at)}"
        return f" (from {moment(valid_at)}{until})"
    if invalid_at is not None and invalid_at > now:
        return f" (until {moment(invalid_at)})"
    return ""


def moment(at: datetime) -> str:
    """A time as a prompt says it: '2026-04-10' at midnight UTC, else with its hour and the
    zone it was given in ('2026-04-10 00:00 +01:00'), so that a date is never a day off."""
    if at.utcoffset() == timedelta(0) and (at.hour, at.minute, at.second) == (0, 0, 0):
        return at.date().isoformat()
    zone = at.strftime("%z")
    zone = "UTC" if zone in ("+0000", "") else f"{zone[:3]}:{zone[3:]}"
    return f"{at:%Y-%m-%d %H:%M} {zone}"


# What may start a block of its own at the start of a Markdown line (CommonMark): a heading, a
# quote, a list item, a rule, a code fence, HTML, a link definition, an ordered list's number.
_BLOCK_START = re.compile(r"[#>+*_=`~<\[-]|\d{1,9}[.)](?!\S)")


def one_line(text: str) -> str:
    """``text`` with each run of whitespace, line breaks of every kind included, as one space:
    a stored text stays inside the Markdown line it is shown in, whatever the user typed."""
    return " ".join(text.split())


def block_text(text: str) -> str:
    """:func:`one_line`, for the start of a line or list item: a leading character that would
    start a block (a heading, a code fence...) is backslash-escaped, which shows it as is."""
    line = one_line(text)
    m = _BLOCK_START.match(line)
    return line if m is None else f"{line[:m.end() - 1]}\\{line[m.end() - 1:]}"


def render_markdown(result: RetrieveResult, now: datetime, detail: Detail,
                    episodic: bool = True) -> str:
    """seed 001's Markdown: semantic facts with [category], then ranked episodes."""
    lines: list[str] = []
    if result.semantic:
        lines.append("## Semantic Memory")
        for fact in result.semantic:
            n = fact.conversations
            lines.append(f"- [{one_line(fact.category)}] {one_line(fact.fact)}"
                         f"{in_force_note(fact.valid_at, fact.invalid_at, now)} "
                         f"(sources: {n} conversation{'s' if n != 1 else ''})")
    if episodic:
        if lines:
            lines.append("")
        lines.append("## Episodic Memories")
        if not result.episodic:
            lines += ["", "No matching memories."]
        for rank, item in enumerate(result.episodic, 1):
            key = item.surprise >= KEY_MOMENT
            lines += ["", f"### {one_line(item.title)} [rank: {rank}, score: {item.score:.2f}"
                          f"{', key moment' if key else ''}]",
                      f"**When:** {relative_time(item.end_at, now)}",
                      f"**Summary:** {one_line(item.summary)}"]
            if _show_details(detail, rank, key):
                lines += ["", "**Details:**"]
                lines += [f'- {m.role}: "{one_line(m.content)}"' for m in item.messages]
    return "\n".join(lines) + ("\n" if lines else "")


def _show_details(detail: Detail, rank: int, key: bool) -> bool:
    if detail == "high":
        return True
    if detail == "none":
        return False
    if detail == "low":
        return rank == 1 and key
    return rank <= 2 and key  # auto
