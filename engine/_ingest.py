"""Ingest and history: a turn from the caller into the session buffer, and back out.

``Engine.add_turn`` checks the turn here (:meth:`Ingest.check_turn`), waits for room in the
store's queue (backpressure when the disk falls behind) and appends it to the session buffer
(``actors/session_buffer.py``), which assigns its id and seq, keeps it in the session's RAM
window and submits it to the store's group commit. The facade does those two steps itself:
on a path of ~5 µs a hop through one more coroutine costs a measurable share. Everything after
that (the log, the embedder, both indexes, the long-term followers) follows the store's log;
``flush`` waits for all of it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

import trio

from actors.base import validate as v
from actors.base.errors import InvalidInput, RecordRefused
from actors.base.records import NewTurn, SessionInfo, Turn
from actors.session_buffer import Receipt
from actors.store import read_memories_by_id

from ._args import check_count, reason
from ._forget import Scrubber
from ._parts import Parts, read_clock

__all__ = ["Ingest"]

# Turns appended per step of add_turns, as one store op: the writer never cuts a batch inside
# an op, and while a caller waits for a flush it takes batches of 256 ops
# (writer.BATCH_MAX_WHILE_WAITED), so a durable receipt never waits behind a longer run.
# About 0.5 ms of loop time each; bigger steps save nothing measurable.
BULK_CHUNK = 256
# Rounds a flush waits for the long-term followers: the turns acknowledged before it, then what
# they logged meanwhile (a fact a turn stated), which the other followers take in too. A bound,
# so that a flush beside a steady stream of other callers' turns does not chase it for ever.
DERIVED_ROUNDS = 3
_NONE = type(None)



def other_scope(session_id: str, field: str, own: str, given: str) -> InvalidInput:
    """The error of a turn naming another scope than its session's."""
    return InvalidInput(field, f"expected {own!r}, the {field} of session {session_id!r} (a "
                               f"session belongs to one agent and run: its first turn's), "
                               f"found {given!r}; start another session for another scope")

class Ingest:
    """The checks of ``add_turn`` (which the facade runs itself: the hot path has no hop to
    spare), ``add_turns``, the history reads, and ``flush``."""

    def __init__(self, parts: Parts, scrubber: Scrubber) -> None:
        self._parts = parts
        self._config = parts.config
        self._scrubber = scrubber

    def check_turn(self, user_id: Any, session_id: Any, role: Any, text: Any, at: Any,
                   meta: Any) -> tuple[datetime, dict[str, Any] | None]:
        """One turn's arguments, as ``add_turn`` and ``add_turn_nowait`` take them; returns
        the time it is stamped with (the engine clock's, checked, when ``at`` is None) and its
        meta."""
        config = self._config  # the hot path: the checks are called directly
        v.check_id("user_id", user_id, config.max_id_chars)
        v.check_id("session_id", session_id, config.max_id_chars)
        v.check_role(role)
        v.check_text("text", text, config.max_text_chars)
        at = self._parts.turn_now() if at is None else v.check_at(at)
        return at, v.check_meta(meta, config.max_meta_bytes)

    def check_scope(self, user_id: str, session_id: str, agent_id: Any, run_id: Any,
                    fresh: dict[tuple[str, str], tuple[str, str]] | None = None) -> None:
        """A turn's scope: valid ids, and its session's if the session exists (a session
        belongs to one agent and run, its first turn's: forgetting a scope forgets whole
        sessions, and nothing of another scope goes with them). ``fresh``: the scopes of
        sessions a batch begins, by its earlier items."""
        config = self._config
        if agent_id is not None:
            v.check_id("agent_id", agent_id, config.max_id_chars)
        if run_id is not None:
            v.check_id("run_id", run_id, config.max_id_chars)
        held = self._parts.buffer.scope(user_id, session_id)
        if held is None and fresh is not None:
            held = fresh.get((user_id, session_id))
            if held is None:
                fresh[(user_id, session_id)] = (agent_id or "", run_id or "")
                return
        if held is None:
            return
        for field, given, own in (("agent_id", agent_id, held[0]), ("run_id", run_id, held[1])):
            if given is not None and given != own:
                raise other_scope(session_id, field, own, given)

    async def add_turns(self, items: Iterable[NewTurn | Mapping[str, Any]],
                        durable: bool) -> list[Receipt]:
        parts = self._parts
        parts.check_open()
        await trio.lowlevel.checkpoint_if_cancelled()
        v.check_flag("durable", durable)
        if type(items) is not list:
            if isinstance(items, (str, bytes, Mapping)) or not isinstance(items, Iterable):
                raise InvalidInput("items", "expected a list (or an iterable) of NewTurn values "
                                            f"or mappings, found {type(items).__name__}; wrap "
                                            "one turn in a list: [turn]")
            items = list(items)
        columns = self._check_columns(items)
        if columns is None:  # some item may be bad: check one at a time, the first raises
            sessions: set[tuple[str, str]] = set()  # (user, session) pairs whose ids passed
            fresh: dict[tuple[str, str], tuple[str, str]] = {}  # scopes of sessions it begins
            now = parts.turn_now()
            checked = [self._check_item(i, item, sessions, fresh, now)
                       for i, item in enumerate(items)]
            columns = [list(column) for column in zip(*checked, strict=True)]
            del columns[6]  # the turn ids: made by the buffer
        receipts: list[Receipt] = []
        buffer, store = parts.buffer, parts.store
        # Each chunk is appended without yielding, so its turns stay contiguous in a session.
        for start in range(0, len(items), BULK_CHUNK):
            end = min(start + BULK_CHUNK, len(items))
            await store.reserve(end - start)
            parts.check_open()
            receipts += buffer.append_many(*(column[start:end] for column in columns))
        if durable and receipts:
            await receipts[-1].durable()
        return receipts

    def _check_columns(self, items: list[NewTurn | Mapping[str, Any]]) -> list[list[Any]] | None:
        """The items of ``add_turns`` checked as ``add_turn`` checks its arguments, a column at
        a time (:mod:`actors.base.validate`'s column checks, and each distinct user and
        session once); None if some check does not pass, so that the caller checks one item
        at a time, whose error names the first bad one. Returns the columns ``append_many``
        takes: user and session ids, roles, texts, times, metas, agent and run ids."""
        if not items:
            return [[] for _ in range(8)]
        if set(map(type, items)) != {NewTurn}:
            if not all(isinstance(item, (NewTurn, Mapping)) for item in items):
                return None
            try:
                items = [item if isinstance(item, NewTurn) else NewTurn(**item)
                         for item in items]
            except TypeError:
                return None
        config = self._config
        users = [item.user_id for item in items]
        sessions = [item.session_id for item in items]
        roles = [item.role for item in items]
        texts = [item.text for item in items]
        ats = [item.at for item in items]
        metas = [item.meta for item in items]
        agents = [item.agent_id for item in items]
        runs = [item.run_id for item in items]
        if set(map(type, users)) != {str} or set(map(type, sessions)) != {str}:
            return None
        if not (v.roles_pass(roles) and v.texts_pass(texts, config.max_text_chars)):
            return None
        n = len(items)
        try:
            for user_id in dict.fromkeys(users):
                v.check_id("user_id", user_id, config.max_id_chars)
            for session_id in dict.fromkeys(sessions):
                v.check_id("session_id", session_id, config.max_id_chars)
            if _NONE in set(map(type, ats)):
                # One reading of the clock for the call, checked as the caller's times are:
                # its turns arrive together (a reading per turn was an eighth of an import).
                now = read_clock(self._parts.turn_clock)
                ats = [now if at is None else at for at in ats]
            if not v.ats_pass(ats):
                ats = [v.check_at(at) for at in ats]
            if set(map(type, metas)) == {_NONE}:
                # One empty dict for all (a record's meta is read-only): an allocation per
                # turn is what makes the garbage collector walk the heap mid-import.
                metas = [{}] * n
            else:
                metas = [v.check_meta(meta, config.max_meta_bytes) for meta in metas]
            if set(map(type, agents)) != {_NONE} or set(map(type, runs)) != {_NONE}:
                seen: set[tuple[str, str]] = set()
                fresh: dict[tuple[str, str], tuple[str, str]] = {}
                for user_id, session_id, agent_id, run_id in zip(users, sessions, agents, runs):
                    if (user_id, session_id) not in seen:
                        seen.add((user_id, session_id))
                        self.check_scope(user_id, session_id, agent_id, run_id, fresh)
                    elif agent_id is not None or run_id is not None:
                        self.check_scope(user_id, session_id, agent_id, run_id, fresh)
        except InvalidInput:
            return None
        return [users, sessions, roles, texts, ats, metas, agents, runs]

    def _check_item(self, index: int, item: NewTurn | Mapping[str, Any],
                    sessions: set[tuple[str, str]],
                    fresh: dict[tuple[str, str], tuple[str, str]],
                    now: datetime) -> tuple[Any, ...]:
        """One item of ``add_turns``, checked as ``add_turn`` checks its arguments (``now``:
        the time of an item given none, the call's one reading of the clock); a user and
        session id pair already in ``sessions`` (an import repeats them turn after turn) is
        not checked again, nor its scope unless the item names one (``fresh``: the scopes of
        the sessions the call begins)."""
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
        user_id, session_id = item.user_id, item.session_id
        try:
            if type(user_id) is str and type(session_id) is str and (
                    (user_id, session_id) in sessions):
                config = self._config
                v.check_role(item.role)
                v.check_text("text", item.text, config.max_text_chars)
                at = now if item.at is None else v.check_at(item.at)
                meta = v.check_meta(item.meta, config.max_meta_bytes)
                if item.agent_id is not None or item.run_id is not None:
                    self.check_scope(user_id, session_id, item.agent_id, item.run_id, fresh)
            else:
                at, meta = self.check_turn(user_id, session_id, item.role, item.text,
                                           now if item.at is None else item.at, item.meta)
                self.check_scope(user_id, session_id, item.agent_id, item.run_id, fresh)
                sessions.add((user_id, session_id))
        except InvalidInput as exc:
            raise InvalidInput(f"items[{index}].{exc.field}", reason(exc)) from None
        return (user_id, session_id, item.role, item.text, at, meta, None, item.agent_id,
                item.run_id)

    # -- history -----------------------------------------------------------------------------

    async def session_history(self, user_id: Any, session_id: Any, limit: Any) -> list[Turn]:
        parts = self._parts
        parts.check_open()
        parts.check_session(user_id, session_id, lookup=True)
        check_count("limit", limit, 1, 1_000_000)
        return await parts.buffer.history(user_id, session_id, limit)

    async def list_sessions(self, user_id: Any) -> list[SessionInfo]:
        parts = self._parts
        parts.check_open()
        parts.check_lookup_ids(user_id)
        await trio.lowlevel.checkpoint()
        return parts.buffer.sessions(user_id)

    async def get_turn(self, user_id: Any, turn_id: Any) -> Turn | None:
        parts = self._parts
        parts.check_open()
        parts.check_lookup_ids(user_id)
        parts.check_lookup_id("turn_id", turn_id)
        await parts.committed()
        found = (await parts.store.read(read_memories_by_id, user_id, [turn_id])).get(turn_id)
        return found if type(found) is Turn else None

    # -- everything acknowledged, through every part -----------------------------------------

    async def flush(self) -> None:
        parts = self._parts
        parts.check_open()
        if parts.read_only:  # nothing acknowledged here; the owner indexes, not this engine
            await trio.lowlevel.checkpoint()
            return
        store = parts.store
        target = store.next_lsn - 1
        await store.wait_written()  # logged or not: use counts and reviews too
        for _ in range(DERIVED_ROUNDS):
            for follower in parts.followers:
                await follower.wait(target)
            for settle in parts.settling:
                await settle()
            derived = store.next_lsn - 1  # what the long-term layer logged meanwhile (facts)
            await store.wait_written()
            if derived == target:
                break
            target = derived  # the other followers take those in too, as the index does
        await parts.fulltext.wait_indexed(target)
        if parts.config.background_embedding:
            await parts.embedder.wait_embedded(target)
        await self._scrubber.wait()  # what forgets and deleted notes removed left every file
        refused = store.take_refused(target)
        if refused:
            first = refused[0]
            more = (f" (and {len(refused) - 1} more: see Engine.failures)" if len(refused) > 1
                    else "")
            raise RecordRefused(first.lsn, f"{reason(first)}{more}", first.memory_id)
