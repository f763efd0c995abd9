"""Forget means gone: after a deletion, the bytes it removed leave every file of the store.

A forget (or a deleted note) commits at once; what it removed can still sit in three places,
which the Scrubber clears in the background, and which ``Engine.flush`` (and a clean close)
waits for:

- the text index: tantivy marks a deleted document and keeps its terms in the segment until
  a merge, so the segments holding deletions are indexed again (``FullText.purge``);
- LMDB's file: the old copies of the pages the deletion changed (free pages), the free space
  inside pages, overflow tails and padding, where LMDB leaves bytes of any record it wrote
  from a reused page buffer; ``Store.scrub`` opens the environment afresh (no old buffers)
  and overwrites all of that with zeros in place (``actors/store/pages.py``), honouring the
  snapshots readers of any process hold, so it waits for a reader older than the deletion;
- saved hnswlib graphs: dropped, or scrubbed in memory, by the AnnIndex as the deletion
  commits (``AnnIndex.removed``), so that is done before the Scrubber runs.

A crash before a scrub finished leaves the store's scrub marker: the next engine scrubs
again on open, and drops every saved graph (one may hold forgotten vectors).

``Forgetting`` is the facade's ``forget_session`` / ``forget_user``: each part that holds the
user's data is told (the session buffer, the embedder's caches, the compressor, the store with
the vector index in commit order, the facts and entities), then the Scrubber is asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import trio

from actors.ann_index import AnnIndex
from actors.base.errors import EngineClosed, InvalidInput
from actors.base.messages import DeleteNote, Forget
from actors.base.keys import MAX_KEY_BYTES
from actors.fulltext import FullText
from actors.store import Store, read_episodes, read_facts

from ._browse import read_notes, list_notes
from ._reflections import reflections_quoting
from ._parts import Parts

__all__ = ["Forgetting", "Scrubber"]


class Scrubber:
    """Runs the scrubs that deletions ask for, one at a time, each covering every deletion
    committed before it started."""

    def __init__(self, store: Store, fulltext: FullText, ann: AnnIndex) -> None:
        self._store = store
        self._fulltext = fulltext
        self._ann = ann
        self._asked = 0  # scrubs asked for so far
        self._done = 0  # every scrub asked for up to this count is done
        # Parked: the scrubber, until a scrub is asked for.
        self._wake = trio.lowlevel.ParkingLot()
        # Parked: callers of wait, until a scrub finishes (or the scrubber stops).
        self._finished = trio.lowlevel.ParkingLot()
        self._stopped = False

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        if self._store.scrub_pending:  # a crash cut the last scrub short
            await trio.to_thread.run_sync(self._ann.drop_saved_graphs)
            self._asked += 1
        elif self._store.scrub_owed:  # an older build scrubbed it: once more, this way
            self._asked += 1
        task_status.started()
        try:
            while True:
                while self._done >= self._asked:
                    await self._wake.park()
                asked = self._asked
                await self._fulltext.purge(self._store.committed_lsn)
                await self._store.scrub()
                self._done = asked
                self._finished.unpark_all()
        except EngineClosed:
            return  # the store's scrub marker has the next engine scrub again
        finally:
            self._stopped = True
            self._finished.unpark_all()

    def ask(self) -> None:
        """A deletion committed: scrub what it freed."""
        self._asked += 1
        self._wake.unpark_all()

    @property
    def pending(self) -> bool:
        """Whether a scrub asked for is not done yet."""
        return self._done < self._asked and not self._stopped

    async def wait(self) -> None:
        """Return once every scrub asked for before the call is done (or the scrubber
        stopped: the engine is closing, and the store's marker says to scrub on next open)."""
        target = self._asked
        while self._done < target and not self._stopped:
            await self._finished.park()
        await trio.lowlevel.checkpoint()


class Forgetting:
    """The facade's deletions of a session or a whole user."""

    def __init__(self, parts: Parts, scrubber: Scrubber) -> None:
        self._parts = parts
        self._scrubber = scrubber

    async def forget_session(self, user_id: Any, session_id: Any) -> None:
        parts = self._parts
        parts.check_open()
        parts.check_session(user_id, session_id, lookup=True)
        if len(user_id.encode()) + len(session_id.encode()) + 10 > MAX_KEY_BYTES:
            # Two legacy-length ids: no turn key of theirs fits LMDB, so no such session was
            # ever stored (and a key built from them would be refused by the store).
            await trio.lowlevel.checkpoint()
            return
        store = parts.store
        # Until the forget is queued a reflection pass writes no note (it checks in the step
        # that queues its note, Maintenance._write; after, the forgets' count has moved): one
        # queued before is committed by the read below and judged with the others, so none
        # quoting the session is left.
        parts.forgetting += 1
        try:
            # What of the session a reflection may quote, read before the forget is queued.
            await parts.committed()
            made = [m.created_at for m in (
                *await store.read(read_episodes, user_id, session_id),
                *[f for f in await store.read(read_facts, user_id, False)
                  if f.session_id == session_id])]
            notes = await store.read(read_notes, user_id) if made else []
            doomed = sorted(reflections_quoting(notes, made))
            lsn = await self._queue(user_id, session_id, doomed)
        finally:
            parts.forgetting -= 1
        try:
            await store.wait_committed(lsn + len(doomed))
        finally:
            if parts.notes_md is not None:
                with trio.CancelScope(shield=True):  # it commits, the caller cancelled or not
                    for at, note_id in enumerate(doomed, lsn + 1):
                        await parts.notes_md.remove(user_id, note_id, at)

    async def forget_scope(self, user_id: Any, agent_id: Any, run_id: Any,
                           delete_note: Any) -> dict[str, int]:
        parts = self._parts
        parts.check_open()
        parts.check_lookup_ids(user_id)
        if agent_id is None and run_id is None:
            raise InvalidInput("agent_id", "expected agent_id or run_id (or both), found "
                                           "neither; forget_user forgets the whole user")
        for field, value in (("agent_id", agent_id), ("run_id", run_id)):
            if value is not None:
                parts.check_lookup_id(field, value)
        sessions = parts.buffer.sessions_in_scope(user_id, agent_id, run_id)
        for session_id in sessions:
            await self.forget_session(user_id, session_id)
        notes = [n.note_id for n in await list_notes(parts, user_id)
                 if (agent_id is None or n.agent_id == agent_id)
                 and (run_id is None or n.run_id == run_id)]
        gone = [note_id for note_id in notes if await delete_note(user_id, note_id)]
        return {"sessions": len(sessions), "notes": len(gone)}

    async def forget_user(self, user_id: Any) -> None:
        parts = self._parts
        parts.check_open()
        parts.check_lookup_ids(user_id)
        lsn = await self._queue(user_id, None)
        try:
            await parts.store.wait_committed(lsn)
        finally:
            if parts.notes_md is not None:
                with trio.CancelScope(shield=True):  # it commits, the caller cancelled or not
                    await parts.notes_md.remove_user(user_id, lsn)

    async def _queue(self, user_id: str, session_id: str | None,
                     notes: Sequence[str] = ()) -> int:
        """Queue the deletion of a session (or, ``session_id`` None, a user); returns its lsn.
        The user's ``notes`` (reflections quoting the session) are deleted in the same write
        transaction, at the lsns that follow.

        Once there is room in the store's queue, the RAM copies are dropped and the op queued
        in one step, no checkpoint between: a turn of the user added while the wait for room
        lasted must not stay in the session buffer once the store deletes it. What follows
        the commit runs in the commit's own step (``committed``, on the trio thread), not in
        the caller's task: the op commits even if the caller is cancelled while it waits, and
        then the caches built on what it deleted must go and the scrub must run all the same.
        """
        parts = self._parts
        store = parts.store
        await store.reserve(1 + len(notes))  # cancel-safe: nothing is taken yet
        parts.check_open()
        parts.forgets += 1
        if session_id is None:
            parts.buffer.drop_user(user_id)
            parts.embedder.forget_user(user_id)
        else:
            parts.buffer.drop_session(user_id, session_id)
            parts.embedder.forget_texts()
        parts.compressor.forget(user_id, session_id)

        def committed(lsns: list[int]) -> None:
            parts.ann.removed(user_id, lsns, session_id is None)
            self._scrubber.ask()
            parts.facts.forget(user_id)  # the facts extracted from what went, with it
            parts.entities.forget(user_id)  # ...and the entities only it mentioned

        def notes_committed(lsns: list[int]) -> None:
            parts.ann.removed(user_id, lsns, False)
            if lsns:
                self._scrubber.ask()
                parts.entities.forget(user_id)  # the registry records it rewrote

        lsn = store.next_lsn
        store.hold_together(1 + len(notes))
        store.submit(Forget(lsn, user_id, session_id, committed))
        for note_id in notes:
            store.submit(DeleteNote(store.next_lsn, user_id, note_id, notes_committed))
        return lsn
