"""Context for a new session (seed 004's injection, in seed 002's prompt shape).

``Engine.context_for_prompt(user_id, session_id, budget_tokens=)`` gives what a bot should
know before the first reply of a session: the user's standing facts (most important first),
the latest weekly reflection, and the episodes of *other* sessions most relevant to this one
(never the current session's own: its turns are in the prompt already): those relevant to
``query`` if given, else to the current session's latest turns, then the most recent ones. Everything fits ``budget_tokens`` (~4 characters a
token), in that order of priority: a line that does not fit is left out whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from actors.base.records import Episode, Fact, Note
from actors.store import read_episodes, user_prefix

from ._briefing import block_text, in_force_note, one_line, relative_time
from ._hits import estimate_tokens
from ._recall import count_use

if TYPE_CHECKING:
    from ._parts import Parts
    from ._retrieval import Retriever

__all__ = ["context_for_prompt"]

RECENT_TURNS = 4  # of the current session, standing for the query when none is given
EPISODES = 5  # episodes from other sessions, at most
SUMMARY_CHARS = 240  # of an episode's summary shown
REFLECTION_TAG = "reflection"

_decode_note = msgspec.msgpack.Decoder(Note).decode


def _latest_reflection(txn: Any, dbs: dict[bytes, Any], user_id: str) -> Note | None:
    prefix = user_prefix(user_id)
    latest = None
    cursor = txn.cursor(dbs[b"notes"])
    if cursor.set_range(prefix):
        for key, value in cursor:
            if not key.startswith(prefix):
                break
            note = _decode_note(value)
            if REFLECTION_TAG in note.tags and (latest is None
                                                or note.updated_at > latest.updated_at):
                latest = note
    return latest


async def _episodes(parts: Parts, retriever: Retriever, user_id: str, session_id: str,
                    query: str | None) -> list[Episode]:
    """Other sessions' episodes: the relevant ones first, then the most recent."""
    store = parts.store
    await store.wait_logged()
    others = [e for e in await store.read(read_episodes, user_id, None)
              if e.session_id != session_id]
    if not others:
        return []
    if query is None:
        recent = await parts.buffer.history(user_id, session_id, RECENT_TURNS)
        query = " ".join(t.text for t in recent) or None
    if query is None:
        return sorted(others, key=lambda e: e.end_at, reverse=True)[:EPISODES]
    by_lsn = {e.lsn: e for e in others}
    # The search runs inside these episodes only (an lsn mask in every index), so the
    # current session's episodes never take a place.
    hits = await retriever.recall(
        user_id, query, limit=EPISODES, session_id=None, since=None, until=None, roles=None,
        kinds=("episode",), link_depth=0, budget_tokens=None, only=sorted(by_lsn),
        legs=("vector", "bm25"))
    by_id = {e.episode_id: e for e in others}
    relevant = [by_id[h.id] for h in hits if h.id in by_id]
    # Then the most recent of the rest: what the user did lately is context too.
    rest = sorted((e for e in others if e not in relevant), key=lambda e: e.end_at,
                  reverse=True)
    return (relevant + rest)[:EPISODES]


async def context_for_prompt(parts: Parts, retriever: Retriever, user_id: str,
                             session_id: str, budget_tokens: int, query: str | None) -> str:
    now = parts.clock()
    shown_facts = await parts.facts.for_prompt(user_id, now=now)
    reflection = await parts.store.read(_latest_reflection, user_id)
    episodes = await _episodes(parts, retriever, user_id, session_id, query)
    left = budget_tokens
    out: list[str] = []

    def section(title: str, groups: list[list[str]]) -> list[int]:
        """Add the groups of lines that fit what is left, each whole, in order; returns
        their positions."""
        nonlocal left
        kept: list[int] = []
        cost = estimate_tokens(title + "\n")
        for i, lines in enumerate(groups):
            need = sum(estimate_tokens(line + "\n") for line in lines) + (0 if kept else cost)
            if need <= left:
                kept.append(i)
                left -= need
        if kept:
            out.extend(([""] if out else []) + [title, *(line for i in kept for line in groups[i])])
        return kept

    # Stored texts are shown on lines of their own making: see _briefing.block_text. A value
    # due later and the versions held until it are kept or cut together.
    groups: list[list[Fact]] = []
    held: list[Fact] = []
    for fact, then in shown_facts:
        if then is not None:
            held.append(fact)
        else:
            groups.append([*held, fact])
            held = []
    kept = section("## What I know about you", [
        [f"- {block_text(f.text)}{in_force_note(f.valid_at, f.invalid_at, now)}" for f in group]
        for group in groups])
    shown = [f.fact_id for i in kept for f in groups[i] if f.status == "active"]
    if reflection is not None:
        section("## Latest reflection", [[block_text(reflection.text)]])
    section("## From earlier conversations", [[
        f"- {relative_time(e.end_at, now)}, turns {e.first_seq}-{e.last_seq}: "
        f"{one_line(e.title)}: {_cut(e.summary)}"] for e in episodes])
    count_use(parts, user_id, shown)  # shown in a prompt: their decay restarts
    return "\n".join(out) + ("\n" if out else "")


def _cut(text: str) -> str:
    text = one_line(text)
    return text if len(text) <= SUMMARY_CHARS else text[:SUMMARY_CHARS - 3].rstrip() + "..."
