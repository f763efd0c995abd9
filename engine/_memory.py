"""Long-term memory as the facade offers it: facts, notes, rolling session summaries,
episodes and their FSRS reviews, entities.

Facts go to the Facts actor (``actors/facts.py``: supersede by rule, history kept); episodes
to the EpisodicCompressor (``actors/episodic.py``); notes, summaries and review states are
written through the store's group commit (``actors/store.py``), notes logged (so they are
embedded and indexed like turns), summaries and review states not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from datetime import timezone
from typing import Any

import msgspec
import trio

from actors.base import validate as v
from actors.base.errors import InvalidInput, NotFound
from actors.base.messages import DeleteNote, PutNote, PutState, WriteSummary
from actors.base.records import Entity, Episode, Fact, Note, ReviewState, SummaryState, Turn
from actors.base.text import composed, folded
from actors.episodic import RATINGS, memory_review_state, review_state
from actors.extraction import Candidate, jaccard, words
from actors.facts import DEDUP_JACCARD
from actors.session_buffer import new_turn_id
from actors.store import (
    read_entities,
    read_episodes,
    read_memories_by_id,
    read_records,
    read_review_states,
    read_summary,
    user_prefix,
)

from ._args import check_count, check_fraction, check_label
from ._browse import read_notes
from ._forget import Scrubber
from ._hits import Hit, hit_for
from ._parts import Parts
from ._reflections import reflections_quoting

__all__ = ["EntityInfo", "Memory"]

_ENCODE = msgspec.msgpack.Encoder().encode
# Seed 000's fields and the scope: an update keeps those it does not name.
NOTE_FIELDS = ("importance", "emotion", "category", "agent_id", "run_id")


class EntityInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What ``entity_info`` returns: the entity and the memories that mention it, newest
    first."""

    entity: Entity
    memories: list[Hit]


class Memory:
    """The facade's long-term methods. Each checks its arguments, then asks the owning actor."""

    def __init__(self, parts: Parts, scrubber: Scrubber) -> None:
        self._parts = parts
        # Held while a new note is checked against the user's notes and written: the same
        # note stored twice at once is still one note.
        self._new_notes = trio.Lock()
        self._scrubber = scrubber  # a deleted note's bytes leave the files in the background

    # -- structured facts --------------------------------------------------------------------

    async def remember_fact(self, user_id: Any, category: Any, key: Any, value: Any, *,
                            text: Any, confidence: Any, importance: Any, keywords: Any,
                            valid_at: Any) -> Fact:
        candidate = self._candidate(user_id, category, key, value, text, confidence, importance,
                                    keywords)
        valid_at = None if valid_at is None else v.check_at(valid_at, "valid_at")
        outcome = await self._parts.facts.propose(user_id, candidate, origin="api",
                                                  valid_at=valid_at)
        if outcome.status == "refused":
            rival = outcome.previous
            raise InvalidInput("confidence", f"expected at least the active value's confidence "
                                             f"({outcome.needed:.2f} for {rival.value!r}), "
                                             f"found {confidence:.2f}; call correct_fact to "
                                             "replace it")
        return outcome.fact

    async def correct_fact(self, user_id: Any, category: Any, key: Any, value: Any, *,
                           text: Any, importance: Any, keywords: Any, valid_at: Any) -> Fact:
        candidate = self._candidate(user_id, category, key, value, text, 1.0, importance,
                                    keywords)
        valid_at = None if valid_at is None else v.check_at(valid_at, "valid_at")
        outcome = await self._parts.facts.propose(user_id, candidate, origin="api", force=True,
                                                  valid_at=valid_at)
        return outcome.fact

    async def confirm_fact(self, user_id: Any, category: Any, key: Any) -> Fact:
        self._check_fact_key(user_id, category, key)
        self._parts.now()  # a decision is stamped with the clock: a time the index can hold
        fact = await self._parts.facts.confirm(user_id, category, key)
        if fact is None:
            raise NotFound("key", f"expected an active fact ({category!r}, {key!r}) of user "
                                  f"{user_id!r}, found none")
        return fact

    async def forget_fact(self, user_id: Any, category: Any, key: Any) -> bool:
        self._check_fact_key(user_id, category, key)
        parts = self._parts
        parts.now()
        doomed: list[tuple[str, int]] = []  # reflections deleted, at their ops' lsns
        found: list[bool] = []  # set once there is a fact to retire

        def deletion(note_id: str, lsn: int) -> DeleteNote:
            doomed.append((note_id, lsn))
            return self._note_deletion(user_id, note_id, lambda lsns: None, lsn)

        async def reflections(retired: list[Fact]) -> list[Callable[[int], DeleteNote]]:
            """The reflections that may quote the facts, deleted in the retirement's
            transaction, as a forgotten session's are: read once every note a pass queued
            before is committed (one queued after is refused: Maintenance._write)."""
            found.append(True)
            await parts.committed()
            notes = await parts.store.read(read_notes, user_id)
            return [partial(deletion, note_id) for note_id in
                    sorted(reflections_quoting(notes, [f.created_at for f in retired]))]

        parts.forgetting += 1
        try:
            retired = await parts.facts.retire(user_id, [(category, key)], "retracted",
                                               along=reflections)
        finally:
            # Counted once it is queued (it lands, the caller cancelled or not): a pass that
            # read the facts before, while it was under way, writes no note (_write). One that
            # found nothing to retire changed nothing a pass read.
            if found:
                parts.forgets += 1
            parts.forgetting -= 1
            if parts.notes_md is not None and doomed:
                with trio.CancelScope(shield=True):  # they commit, the caller cancelled or not
                    for note_id, lsn in doomed:
                        await parts.notes_md.remove(user_id, note_id, lsn)
        return bool(retired)

    async def profile(self, user_id: Any, category: Any, min_importance: Any,
                      as_of: Any = None) -> list[Fact]:
        parts = self._parts
        parts.check_open()
        parts.check_lookup_ids(user_id)
        if category is not None:
            parts.check_id("category", category)
        check_fraction("min_importance", min_importance)
        if as_of is not None:
            as_of = v.check_at(as_of, "as_of")
        return await parts.facts.profile(user_id, category, min_importance, as_of)

    async def fact_history(self, user_id: Any, category: Any, key: Any) -> list[Fact]:
        self._check_fact_key(user_id, category, key)
        return await self._parts.facts.history(user_id, category, key)

    def _check_fact_key(self, user_id: Any, category: Any, key: Any) -> None:
        parts = self._parts
        parts.check_open()
        parts.check_ids(user_id)
        parts.check_id("category", category)
        parts.check_id("key", key)

    def _candidate(self, user_id: Any, category: Any, key: Any, value: Any, text: Any,
                   confidence: Any, importance: Any, keywords: Iterable[str]) -> Candidate:
        parts = self._parts
        self._check_fact_key(user_id, category, key)
        parts.now()
        parts.check_text("value", value)
        if text is not None:
            parts.check_text("text", text)
        check_fraction("confidence", confidence)
        check_fraction("importance", importance)
        words = v.check_words("keywords", keywords)
        return Candidate(category, key, value, text or f"{key}: {value}", float(confidence),
                         float(importance), words)

    # -- notes -------------------------------------------------------------------------------

    async def put_note(self, user_id: Any, text: Any, note_id: Any,
                       tags: Iterable[str] | None, replace: bool, importance: Any = None,
                       emotion: Any = None, category: Any = None, agent_id: Any = None,
                       run_id: Any = None, unless: Callable[[], bool] | None = None
                       ) -> Note | None:
        """Store a new note (``replace`` False: the id must be free) or replace one (True:
        it must exist). A new note without an id of its own that repeats one of the user's
        notes (the same text: skipped) or nearly does (word Jaccard >= DEDUP_JACCARD: merged,
        the new wording and both notes' tags) is not stored twice (seeds 003 and 004).
        ``importance`` / ``emotion`` / ``category`` None: a new note's defaults, an update
        keeps the note's (a merge too, and keeps the higher importance).

        ``unless`` (a note with an id): asked in the same step that queues the note, nothing
        run between; if it holds, nothing is written and None returned (the maintenance
        passes' reflections: see ``Maintenance._write``)."""
        parts = self._parts
        parts.check_open()
        parts.check_ids(user_id)
        parts.check_text("text", text)
        if note_id is not None or replace:  # an update names the note it changes
            parts.check_id("note_id", note_id)
        tags = v.check_words("tags", tags)
        given: dict[str, Any] = {}
        if importance is not None:
            given["importance"] = check_fraction("importance", importance)
        if emotion is not None:
            given["emotion"] = check_label("emotion", emotion)
        if category is not None:
            given["category"] = category if category == "" else parts.check_id("category",
                                                                                  category)
        for field, value in (("agent_id", agent_id), ("run_id", run_id)):
            if value is not None:
                given[field] = parts.check_id(field, value)
        if note_id is not None and not replace:
            # Notes are keyed apart from the other memories: a note sharing a turn's or a
            # fact's id would be hidden by it (get_note, links) and make the export unreadable.
            await parts.committed()
            taken = (await parts.store.read(read_memories_by_id, user_id, [note_id])
                     ).get(note_id)
            if taken is not None and type(taken) is not Note:
                raise InvalidInput("note_id", f"expected a new note id, found {note_id!r} in "
                                              f"use by a {type(taken).__name__.lower()} of "
                                              f"user {user_id!r}; choose another id")
        if note_id is not None or replace:
            return await self._write_note(user_id, text, note_id, tags, replace, given, unless)
        async with self._new_notes:
            twin = await parts.store.read(_twin_note, user_id, text,
                                          (given.get("agent_id", ""), given.get("run_id", "")))
            if twin is None:
                return await self._write_note(user_id, text, "n_" + new_turn_id()[2:], tags,
                                              False, given)
            merged = tuple(dict.fromkeys((*twin.tags, *tags)))
            into = dict(given)
            if "importance" in into:
                into["importance"] = max(into["importance"], twin.importance)
            if (folded(twin.text) == folded(text) and merged == twin.tags
                    and all(getattr(twin, f) == value for f, value in into.items())):
                return twin  # said before: nothing new to keep
            try:
                return await self._write_note(user_id, text, twin.note_id, merged, True, into)
            except NotFound:
                # The note it merges into was deleted meanwhile (delete_note takes no part
                # in this lock): the caller named no note, so this one stands on its own.
                return await self._write_note(user_id, text, "n_" + new_turn_id()[2:], tags,
                                              False, given)

    async def _write_note(self, user_id: str, text: str, note_id: str, tags: tuple[str, ...],
                          replace: bool, given: dict[str, Any],
                          unless: Callable[[], bool] | None = None) -> Note | None:
        parts = self._parts
        now = parts.now().astimezone(timezone.utc)
        store = parts.store
        await store.reserve(1)
        parts.check_open()
        if unless is not None and unless():
            return None
        lsn = store.next_lsn
        note = Note(lsn, note_id, user_id, text, tags, now, now, **given)
        # An update keeps what it does not name (read in the write transaction).
        keep = tuple(f for f in NOTE_FIELDS if f not in given) if replace else ()
        outcome: list[tuple[Note | None, str | None, int]] = []

        def committed(result: tuple[Note | None, str | None, int]) -> None:
            outcome.append(result)
            if result[2]:  # the replaced version leaves the vector index in commit order
                parts.ann.removed(user_id, [result[2]], False)

        store.submit(PutNote(lsn, note, 1 if replace else -1, committed, keep))
        # Queued, the note lands whether or not its caller stays for it: the wait is shielded,
        # so its file follows (the mirror orders the files of concurrent calls by lsn) and the
        # next call's duplicate check, under the lock this one holds, finds it.
        with trio.CancelScope(shield=True):
            try:
                await store.wait_committed(lsn)
            finally:
                if parts.notes_md is not None and outcome and outcome[0][0] is not None:
                    await parts.notes_md.write(outcome[0][0])
        stored, refused, _ = outcome[0]
        if refused == "exists":
            raise InvalidInput("note_id", f"expected a new note id, found {note_id!r} in use; "
                                          "call update_note to change it")
        if refused == "missing":
            raise NotFound("note_id", f"expected the id of a note of user {user_id!r}, "
                                      f"found none with id {note_id!r}")
        return stored

    async def get_note(self, user_id: Any, note_id: Any) -> Note | None:
        parts = self._parts
        parts.check_open()
        parts.check_lookup_ids(user_id)
        parts.check_lookup_id("note_id", note_id)
        await parts.committed()
        found = (await parts.store.read(read_memories_by_id, user_id, [note_id])).get(note_id)
        return found if type(found) is Note else None

    async def delete_note(self, user_id: Any, note_id: Any) -> bool:
        parts = self._parts
        parts.check_open()
        parts.check_lookup_ids(user_id)
        parts.check_lookup_id("note_id", note_id)
        store = parts.store
        await store.reserve(1)
        parts.check_open()
        lsn = store.next_lsn
        deleted: list[list[int]] = []
        store.submit(self._note_deletion(user_id, note_id, deleted.append, lsn))
        try:
            await store.wait_committed(lsn)
        finally:
            # Not landed yet (the caller was cancelled): it will, so the file goes now.
            if parts.notes_md is not None and (not deleted or deleted[0]):
                with trio.CancelScope(shield=True):
                    await parts.notes_md.remove(user_id, note_id, lsn)
        return bool(deleted[0])

    def _note_deletion(self, user_id: str, note_id: str,
                       deleted: Callable[[list[int]], None], lsn: int) -> DeleteNote:
        """The op deleting a note at ``lsn``; ``deleted`` gets the lsns it removed."""
        parts = self._parts

        def committed(lsns: list[int]) -> None:
            # In the commit's own step: a caller cancelled meanwhile still has it scrubbed.
            deleted(lsns)
            parts.ann.removed(user_id, lsns, False)
            if lsns:
                self._scrubber.ask()
                parts.entities.forget(user_id)  # the registry records it rewrote

        return DeleteNote(lsn, user_id, note_id, committed)

    # -- rolling session summaries -----------------------------------------------------------

    async def session_summary(self, user_id: Any, session_id: Any) -> SummaryState | None:
        parts = self._parts
        parts.check_open()
        parts.check_session(user_id, session_id, lookup=True)
        await parts.committed()
        return await parts.store.read(read_summary, user_id, session_id)

    async def write_session_summary(self, user_id: Any, session_id: Any, summary: Any,
                                    upper_seq: Any, expected_epoch: Any) -> bool:
        parts = self._parts
        parts.check_open()
        parts.check_session(user_id, session_id)
        parts.check_text("summary", summary)
        turns = self._session_turns(user_id, session_id)
        check_count("upper_seq", upper_seq, 0, turns)
        check_count("expected_epoch", expected_epoch, 0, 2**62)
        state = SummaryState(expected_epoch + 1, summary, upper_seq,
                             parts.clock().astimezone(timezone.utc))
        applied: list[bool] = []
        await parts.store.write_unlogged(WriteSummary(user_id, session_id, state,
                                                      expected_epoch, trio.Event(),
                                                      applied.append))
        return applied[0]

    def _session_turns(self, user_id: str, session_id: str) -> int:
        """How many turns the session has; InvalidInput if the user has no such session."""
        turns = self._parts.buffer.next_seq(user_id, session_id)
        if turns is None:
            raise NotFound("session_id", f"expected a session of user {user_id!r}, found "
                                         f"none called {session_id!r}")
        return turns

    # -- episodes and reviews ----------------------------------------------------------------

    async def episodes(self, user_id: Any, session_id: Any) -> list[Episode]:
        parts = self._parts
        parts.check_open()
        parts.check_lookup_ids(user_id, session_id)
        await parts.committed()
        return await parts.store.read(read_episodes, user_id, session_id)

    async def close_session(self, user_id: Any, session_id: Any) -> bool:
        parts = self._parts
        parts.check_open()
        parts.check_session(user_id, session_id)
        turns = self._session_turns(user_id, session_id)
        return await parts.compressor.consolidate(user_id, session_id, turns)

    async def review(self, user_id: Any, memory_id: Any, rating: Any) -> ReviewState:
        parts = self._parts
        parts.check_open()
        parts.check_ids(user_id)
        parts.check_id("memory_id", memory_id)
        if type(rating) not in (str, int) or rating not in RATINGS:  # 1.0 == 1, [] unhashable
            raise InvalidInput("rating", "expected again/hard/good/easy or 1-4, found "
                                         f"{rating!r}")
        store = parts.store
        await parts.committed()
        memory = (await store.read(read_memories_by_id, user_id, [memory_id])).get(memory_id)
        if type(memory) not in (Episode, Turn):
            raise NotFound("memory_id", f"expected the id of an episode or turn of user "
                                        f"{user_id!r}, found {memory_id!r}")
        current = (await store.read(read_review_states, user_id, [memory_id])).get(memory_id)
        state = review_state(current or memory_review_state(memory), RATINGS[rating],
                             parts.clock().astimezone(timezone.utc))
        key = user_prefix(user_id) + memory_id.encode()
        await store.write_unlogged(PutState(((b"reviews", key, _ENCODE(state), memory.lsn),),
                                            (), trio.Event()))
        return state

    # -- entities ----------------------------------------------------------------------------

    async def entity_info(self, user_id: Any, name: Any, limit: Any) -> EntityInfo | None:
        parts = self._parts
        parts.check_open()
        parts.check_lookup_ids(user_id)
        parts.check_text("name", name)
        check_count("limit", limit, 1, 1000)
        key = composed(name.strip()).lower()  # as the registry keys names (extract_entities)
        store = parts.store
        registry = await store.read(read_entities, user_id, [key])
        found = registry.get(key)
        if found is not None and found.type == "alias":
            found = registry.get(found.aliases[0])
        if found is None:
            return None
        lsns = sorted(found.lsns, reverse=True)
        records = await store.read(read_records, user_id, lsns[: limit * 2])
        memories = [hit_for(records[lsn], 1.0, ("entity",)) for lsn in lsns if lsn in records]
        return EntityInfo(entity=found, memories=memories[:limit])


_decode_note = msgspec.msgpack.Decoder(Note).decode


def _twin_note(txn: Any, dbs: dict[bytes, Any], user_id: str, text: str,
               scope: tuple[str, str]) -> Note | None:
    """The user's note of this scope (agent_id, run_id) that ``text`` repeats: the same text,
    else the one whose words it shares most if at least DEDUP_JACCARD of them (seed 004's
    threshold for facts)."""
    prefix = user_prefix(user_id)
    wanted, mine = folded(text), words(text)
    best, best_score = None, DEDUP_JACCARD
    cursor = txn.cursor(dbs[b"notes"])
    if cursor.set_range(prefix):
        for key, value in cursor:
            if not key.startswith(prefix):
                break
            note = _decode_note(value)
            if (note.agent_id, note.run_id) != scope:
                continue
            if folded(note.text) == wanted:
                return note
            score = jaccard(mine, words(note.text))
            if score >= best_score:
                best, best_score = note, score
    return best
