"""Maintenance: the engine's periodic upkeep, on trio timers in its nursery.

Every ``Config.maintenance_seconds`` of the engine's trio clock (so tests with trio's
``autojump_clock`` run weeks of it instantly):

1. decay and prune facts (seed 004: confidence x exp(-rate x days since use), retired below
   ``actors.facts.PRUNE_BELOW``; confirmed facts never decay), of every user with a session
   or a fact;
2. consolidate finished sessions (idle for ``Config.session_idle_seconds``): their remaining
   turns become an episode;
3. drop pending reviews nobody answered within a day;
4. write weekly reflections (seed 004): once per ISO week per user with at least three new
   facts or episodes in the past seven days, an extractive note tagged ``reflection`` and
   ``weekly``; notes never decay.

Besides the timer, with ``Config.consolidate_on_new_session`` a new session's consolidation of
the user's earlier ones updates the user's session reflection (``follow_switches``): one note,
``reflection-latest``, tagged ``reflection`` and ``session``, rewritten from the facts and
episodes of the past seven days once every follower has passed the switch; extractive, or the
LLM's when the engine has one (its failure falls back to the extractive text). It runs in the
background, never on ``add_turn``'s path.

Index checkpoints need no timer: the text index commits on its own size/time threshold and the
vector watermark moves with every batch.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone
from typing import Any

import msgspec
import trio

from actors.base.errors import EngineClosed
from actors.base.messages import PutState
from actors.base.text import folded
from actors.episodic import keyphrases
from actors.facts import spelling
from actors.store import failure_put, read_episodes, read_facts, read_pending, user_prefix

from ._browse import users_with
from ._memory import Memory
from ._parts import Parts
from ._reflections import REFLECTION_WINDOW, SESSION_REFLECTION, weekly_note_id

__all__ = ["Maintenance", "MaintenanceReport"]

log = logging.getLogger("engram.maintenance")

PENDING_TTL = timedelta(days=1)  # a pending review nobody rated by then is dropped
REFLECTION_MIN_ITEMS = 3  # new facts + episodes in a week before a reflection is worth writing
# Characters of one title or fact a reflection quotes: a caller's fact text may be as long as
# a turn, and six of them would make a note longer than a note may be.
QUOTED_CHARS = 300


class MaintenanceReport(msgspec.Struct, frozen=True, kw_only=True):
    """What one maintenance pass did."""

    pruned_facts: int
    consolidated_sessions: int
    dropped_reviews: int
    reflections: int


class Maintenance:
    """The passes, over the actors they tend and the notes service the reflections go to."""

    def __init__(self, parts: Parts, memory: Memory) -> None:
        self._parts = parts
        self._memory = memory
        # Held by a pass: the timer and an explicit ``Engine.maintain`` never overlap.
        self._lock = trio.Lock()
        self._reflecting = False  # follow_switches holds switches it has not written yet
        self._following = False  # follow_switches runs
        # Parked: callers of wait_reflected, until follow_switches has written what it took.
        self._reflected = trio.lowlevel.ParkingLot()
        parts.settling.append(self.wait_reflected)

    async def run(self, interval: float, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await trio.sleep(interval)
            try:
                await self.run_once()
            except Exception as exc:  # a failed pass is retried at the next tick
                if self._parts.closed:
                    return
                log.warning("maintenance pass failed: %r", exc)

    async def run_once(self) -> MaintenanceReport:
        async with self._lock:
            parts = self._parts
            now = parts.clock().astimezone(timezone.utc)
            # Users with a session, and those whose facts all came from remember_fact (no
            # turn said): their facts fade and their weeks are reflected on alike.
            await parts.committed()
            users = sorted(set(parts.buffer.users())
                           | await parts.store.read(users_with, (b"facts",)))
            pruned = await parts.facts.decay_and_prune(users)
            consolidated = 0
            idle = parts.buffer.idle_sessions(
                now - timedelta(seconds=parts.config.session_idle_seconds))
            await parts.compressor.prefetch([(i.user_id, i.session_id) for i in idle])
            for info in idle:
                try:
                    if await parts.compressor.consolidate(info.user_id, info.session_id,
                                                          info.turn_count):
                        consolidated += 1
                except EngineClosed:
                    raise
                except Exception as exc:
                    # One session's failure (a text the embedding model fails on, already a
                    # failure record of the embedder's) stops no other session's.
                    log.warning("consolidating session %r of user %r failed: %r",
                                info.session_id, info.user_id, exc)
            dropped = await self._drop_stale_reviews(now)
            reflections = 0
            for user_id in users:
                try:
                    if await self._reflect(user_id, now):
                        reflections += 1
                except EngineClosed:
                    raise
                except Exception as exc:  # one user's (a legacy id no write takes) stops no other's
                    log.warning("weekly reflection for user %r failed: %r", user_id, exc)
            return MaintenanceReport(pruned_facts=pruned, consolidated_sessions=consolidated,
                                     dropped_reviews=dropped, reflections=reflections)

    async def follow_switches(self, *,
                              task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                              ) -> None:
        """Update a user's session reflection each time a new session consolidates their
        earlier ones (the compressor reports it), until the engine closes."""
        compressor = self._parts.compressor
        self._following = True
        task_status.started()
        try:
            while True:
                switched = await compressor.switches()
                self._reflecting = True
                for user_id, lsn in switched.items():
                    try:
                        await self.reflect_on_switch(user_id, lsn)
                    except EngineClosed:
                        return
                    except Exception as exc:  # the next switch writes it again
                        if self._parts.closed:
                            return
                        log.warning("reflection for a new session failed: %r", exc)
                self._reflecting = False
                self._reflected.unpark_all()
        finally:
            self._following = self._reflecting = False
            self._reflected.unpark_all()

    async def wait_reflected(self) -> None:
        """Return once every session switch reported so far has its reflection written
        (``Engine.flush`` waits for it, as for the followers)."""
        while self._following and (self._reflecting or self._parts.compressor.switched):
            await self._reflected.park()
        await trio.lowlevel.checkpoint()

    async def reflect_on_switch(self, user_id: str, lsn: int) -> bool:
        """Rewrite the user's session reflection from what the followers derived before the
        log position ``lsn`` (the new session's first turn). Returns whether one was written
        (nothing is, for a user with no facts or episodes in the window)."""
        parts = self._parts
        for follower in parts.followers:
            if follower is not parts.compressor.follower:  # it reported the switch itself
                await follower.wait(lsn - 1)
        now = parts.clock().astimezone(timezone.utc)
        forgets = await self._settled()
        facts, episodes = await self._recent(user_id, now)
        if not facts and not episodes:
            return False
        text = None
        if parts.tasks is not None:
            try:
                text = await parts.tasks.reflect(
                    [f.text for f in facts if f.status == "active"],
                    [f"{e.title}: {e.summary}" for e in episodes])
            except Exception as exc:  # the offline text stands in, as for summaries
                log.warning("the model's reflection failed, writing the extractive one: %r",
                            exc)
                # Kept as the new session's first turn's failure (gone with it if forgotten).
                parts.store.submit(PutState((failure_put(lsn, "reflection", user_id,
                                                         SESSION_REFLECTION, exc),)))
        if text is None:
            text = reflection_text(now, facts, episodes,
                                   f"Reflection after a conversation, {now.date().isoformat()}.")
        exists = await self._memory.get_note(user_id, SESSION_REFLECTION) is not None
        return await self._write(user_id, text, SESSION_REFLECTION, ("reflection", "session"),
                                 exists, forgets)

    async def _settled(self) -> int:
        """The count of forgets so far, once every forget it counts has committed: a read
        after this sees none of what they removed."""
        forgets = self._parts.forgets
        await self._parts.committed()
        return forgets

    async def _write(self, user_id: str, text: str, note_id: str, tags: tuple[str, ...],
                     replace: bool, forgets: int) -> bool:
        """Write a reflection made from what was read after :meth:`_settled` returned
        ``forgets``, unless a forget was queued since, or one of a session is under way: the
        note would quote what it removed, and one landing after the forget of its user would
        bring the user back. Returns whether the note was written.

        The check and the note's submit are one step (no checkpoint between them), so a
        forget queued after the check commits after the note and deletes it in its own
        transaction (:func:`reflections_quoting`): no moment, and no crash, leaves a note
        quoting a forgotten session.
        """
        parts = self._parts
        # A note may be no longer than a turn (Config.max_text_chars may be set low).
        text = text[:parts.config.max_text_chars]
        return await self._memory.put_note(
            user_id, text, note_id, tags, replace=replace,
            unless=lambda: parts.forgets != forgets or parts.forgetting > 0) is not None

    async def _recent(self, user_id: str, now: datetime) -> tuple[list[Any], list[Any]]:
        """The user's facts and episodes made in the REFLECTION_WINDOW up to ``now``: none made
        after it (a clock stepped back), which a forget of what they came from would not look
        for in this reflection (:func:`reflections_quoting`)."""
        since = now - REFLECTION_WINDOW
        store = self._parts.store
        facts = [f for f in await store.read(read_facts, user_id, False)
                 if since <= f.created_at <= now]
        episodes = [e for e in await store.read(read_episodes, user_id, None)
                    if since <= e.created_at <= now]
        return facts, episodes

    async def _drop_stale_reviews(self, now: datetime) -> int:
        store = self._parts.store
        stale = [(b"pending", user_prefix(u) + c.encode(), None, 0)
                 for u, c, p in await store.read(read_pending) if now - p.shown_at > PENDING_TTL]
        if stale:
            await store.write_unlogged(PutState(tuple(stale), (), trio.Event()))
        return len(stale)

    async def _reflect(self, user_id: str, now: datetime) -> bool:
        note_id = weekly_note_id(now)
        forgets = await self._settled()
        if await self._memory.get_note(user_id, note_id) is not None:
            return False
        facts, episodes = await self._recent(user_id, now)
        if len(facts) + len(episodes) < REFLECTION_MIN_ITEMS:
            return False
        text = reflection_text(now, facts, episodes)
        return await self._write(user_id, text, note_id, ("reflection", "weekly"), False,
                                 forgets)


def reflection_text(now: datetime, facts: list[Any], episodes: list[Any],
                    heading: str | None = None) -> str:
    """The offline reflection: the week's key moments, what was learned, recurring topics."""
    lines = [heading or f"Weekly reflection, week ending {now.date().isoformat()}."]
    moments = sorted(episodes, key=lambda e: -e.surprise)[:3]
    if moments:
        lines.append("Key moments: " + "; ".join(_quoted(e.title) for e in moments) + ".")
    active = [f for f in facts if f.status == "active"]
    # A superseded version whose value is in force again (a plan forgotten put it back as a
    # new version) did not change.
    standing = {(*spelling(f.category, f.key), folded(f.value)) for f in active}
    changed = [f for f in facts if f.status == "superseded"
               and (*spelling(f.category, f.key), folded(f.value)) not in standing]
    if active:
        lines.append("Learned: " + "; ".join(_quoted(f.text) for f in active[:6]) + ".")
    if changed:
        lines.append("Changed: " + "; ".join(f"{_quoted(f.text)} (no longer)"
                                             for f in changed[:4]) + ".")
    # Never a retracted fact's words: forget_fact deleted the notes that quoted it.
    topics = keyphrases([" ".join(e.keywords) for e in episodes]
                        + [f.text for f in facts if f.status != "retracted"], 5)
    if topics:
        lines.append("Recurring topics: " + ", ".join(topics) + ".")
    return "\n".join(lines)


def _quoted(text: str) -> str:
    return text if len(text) <= QUOTED_CHARS else text[:QUOTED_CHARS].rstrip() + "..."
