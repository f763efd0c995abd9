"""The SessionBuffer: the short-term windows, the session counters and the hot append path.

Driven bare over a real Store (tests/actors/ground.py), as the engine's ingest drives it: the
facade validates a turn, then ``append`` puts it in the window and on the Store's queue.
add_turn's checks and history through the facade are tested through the engine
(tests/test_engine.py, tests/test_scopes.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta, timezone
from pathlib import Path
from typing import Any

import msgspec
import pytest

import actors.store as store_mod
from actors.base.config import Config
from actors.session_buffer import Receipt, SessionBuffer

from .ground import T0, Ground, running_store


@asynccontextmanager
async def running_buffer(path: Path, config: Config | None = None
                         ) -> AsyncIterator[tuple[Ground, SessionBuffer]]:
    """A store at ``path`` and a session buffer over it, loaded as the engine loads it."""
    config = config or Config()
    async with running_store(path, config) as ground:
        buffer = SessionBuffer(ground.store, config)
        await buffer.load()
        yield ground, buffer


def say(buffer: SessionBuffer, user_id: str, session_id: str, text: str, minute: int,
        **scope: str | None) -> Receipt:
    """Append one user turn said ``minute`` minutes after T0, as ingest does."""
    return buffer.append(user_id, session_id, "user", text, T0 + timedelta(minutes=minute), {},
                         **scope)


async def test_appended_turns_are_in_history_before_the_disk_has_them(store_path) -> None:
    """A turn is in its session's history as soon as append returns, numbered in order, and
    its receipt's durable() returns once the store holds it."""
    async with running_buffer(store_path) as (ground, buffer):
        receipts = [say(buffer, "ana", "s1", f"turn {i}", i) for i in range(3)]
        assert [r.seq for r in receipts] == [0, 1, 2]
        assert [r.lsn for r in receipts] == sorted({r.lsn for r in receipts})
        history = await buffer.history("ana", "s1", 10)
        assert [(t.seq, t.text, t.turn_id) for t in history] == [
            (r.seq, f"turn {r.seq}", r.turn_id) for r in receipts]
        assert buffer.recent_turn("ana", receipts[1].lsn).text == "turn 1"
        await receipts[-1].durable()
        assert await ground.texts("ana", "s1") == {r.lsn: f"turn {r.seq}" for r in receipts}


async def test_history_longer_than_the_window_reads_older_turns_from_the_store(
        store_path) -> None:
    """The window keeps the latest window_turns turns; asking for more reads the older ones
    from the store, oldest first, after what was queued for the session is committed."""
    async with running_buffer(store_path, Config(window_turns=2)) as (_, buffer):
        for i in range(5):
            say(buffer, "ana", "s1", f"turn {i}", i)
        assert [t.text for t in await buffer.history("ana", "s1", 2)] == ["turn 3", "turn 4"]
        history = await buffer.history("ana", "s1", 4)
        assert [(t.seq, t.text) for t in history] == [(i, f"turn {i}") for i in range(1, 5)]
        assert await buffer.history("ana", "nobody", 4) == []


async def test_the_least_recently_used_window_is_dropped_and_its_history_stays(
        store_path) -> None:
    """Beyond live_windows sessions, the least recently used window leaves RAM; the session's
    counters stay, and its history is read back from the store."""
    async with running_buffer(store_path, Config(live_windows=1)) as (_, buffer):
        for i in range(3):
            say(buffer, "ana", "old", f"old {i}", i)
        say(buffer, "ana", "new", "new 0", 10)
        assert buffer.counts() == (1, 2, 4, 1)  # users, sessions, turns, windows in RAM
        assert [t.text for t in buffer.turns_after("ana", 0)] == ["new 0"]  # windows in RAM
        assert [t.text for t in await buffer.history("ana", "old", 10)] == [
            "old 0", "old 1", "old 2"]
        assert buffer.next_seq("ana", "old") == 3


async def test_a_back_dated_turn_moves_neither_end_of_its_session_inward(store_path) -> None:
    """append and append_many keep a session's started_at its earliest turn time and last_at
    its latest, in RAM and in the record a reload reads: a back-dated turn set last_at to its
    own time, so idle_sessions took a session with a turn said later for idle."""
    minutes = [timedelta(minutes=m) for m in (20, 15, 1)]

    def spans(buffer: SessionBuffer) -> dict:
        return {s.session_id: (s.started_at, s.last_at) for s in buffer.sessions("ana")}

    expected = {"s1": (T0, T0 + timedelta(minutes=10)),
                "s2": (T0 + timedelta(minutes=15), T0 + timedelta(minutes=20))}
    async with running_buffer(store_path) as (_, buffer):
        for text, minute in (("first", 5), ("later", 10), ("back-dated", 0)):
            say(buffer, "ana", "s1", text, minute)
        *_, last = buffer.append_many(["ana"] * 3, ["s2", "s2", "s1"], ["user"] * 3,
                                      ["x", "y", "z"], [T0 + m for m in minutes], [{}] * 3,
                                      [None] * 3, [None] * 3)
        assert spans(buffer) == expected
        assert buffer.idle_sessions(T0 + timedelta(minutes=8)) == []
        await last.durable()
    async with running_buffer(store_path) as (_, buffer):
        assert spans(buffer) == expected
        assert buffer.idle_sessions(T0 + timedelta(minutes=8)) == []


async def test_a_reloaded_buffer_counts_on_where_the_store_left_off(store_path) -> None:
    """A new buffer over a reopened store knows every session (counts, times, scope) and
    numbers the next turn after the last one stored."""
    async with running_buffer(store_path) as (_, buffer):
        for i in range(3):
            last = say(buffer, "ana", "s1", f"turn {i}", i, agent_id="helper")
        say(buffer, "bo", "s9", "hello", 7)
        await last.durable()
    async with running_buffer(store_path) as (_, buffer):
        assert sorted(buffer.users()) == ["ana", "bo"]
        [info] = buffer.sessions("ana")
        assert (info.session_id, info.turn_count, info.agent_id) == ("s1", 3, "helper")
        assert (info.started_at, info.last_at) == (T0, T0 + timedelta(minutes=2))
        receipt = say(buffer, "ana", "s1", "turn 3", 3)
        assert receipt.seq == 3
        assert [t.text for t in await buffer.history("ana", "s1", 10)] == [
            f"turn {i}" for i in range(4)]
        assert buffer.scope("ana", "s1") == ("helper", "")


async def test_a_reopened_buffer_reads_a_window_when_its_session_is_first_used(
        store_path) -> None:
    """Opening holds no window in RAM (a store of 100k turns held 82k of them as objects, 35 MiB,
    read at open for sessions nobody might ask for again); a session's first history reads its
    window from the store, and a turn said after it joins the window. A session whose first
    use after open is a new turn gets the turns before it on its first history too: each
    later history is answered from RAM."""
    async with running_buffer(store_path) as (_, buffer):
        for i in range(30):
            last = say(buffer, "ana", f"s{i % 3}", f"turn {i}", i)
        await last.durable()
    async with running_buffer(store_path, Config(window_turns=4)) as (ground, buffer):
        assert buffer.counts() == (1, 3, 30, 0)  # users, sessions, turns, windows in RAM
        assert [t.text for t in await buffer.history("ana", "s1", 2)] == ["turn 25", "turn 28"]
        assert buffer.counts()[3] == 1
        say(buffer, "ana", "s1", "turn 30", 30)
        reads = ground.store.read
        ground.store.read = None  # no store read from here on: the window answers
        assert [t.text for t in await buffer.history("ana", "s1", 3)] == [
            "turn 25", "turn 28", "turn 30"]
        ground.store.read = reads
        say(buffer, "ana", "s2", "turn 31", 31)  # s2's first use after open: a new turn
        assert buffer.counts()[3] == 2
        assert [t.text for t in await buffer.history("ana", "s2", 3)] == [
            "turn 26", "turn 29", "turn 31"]
        for limit in (3, 4):
            assert [t.text for t in await buffer.history("ana", "s2", limit)] == [
                "turn 23", "turn 26", "turn 29", "turn 31"][-limit:]
            ground.store.read = None  # the same history again: from RAM
            assert len(await buffer.history("ana", "s2", limit)) == limit
            ground.store.read = reads


async def test_a_session_keeps_the_scope_of_its_first_turn(store_path) -> None:
    """agent_id and run_id scope a new session; a later turn that names none is stored under
    the session's scope, and sessions_in_scope finds the session by either part."""
    async with running_buffer(store_path) as (ground, buffer):
        say(buffer, "ana", "s1", "first", 0, agent_id="helper", run_id="r1")
        later = say(buffer, "ana", "s1", "second", 1)
        say(buffer, "ana", "s2", "elsewhere", 2)
        assert buffer.scope("ana", "s1") == ("helper", "r1")
        assert buffer.scope("ana", "nobody") is None
        assert buffer.sessions_in_scope("ana", "helper", None) == ["s1"]
        assert buffer.sessions_in_scope("ana", None, "r1") == ["s1"]
        assert sorted(buffer.sessions_in_scope("ana", None, None)) == ["s1", "s2"]
        await later.durable()
        stored = await ground.store.read(store_mod.read_session_turns, "ana", "s1", 0, 2**63)
        assert [(t.agent_id, t.run_id) for t in stored] == [("helper", "r1")] * 2


async def test_an_unencodable_turn_leaves_nothing_behind(store_path) -> None:
    """A turn that cannot be encoded raises before any state changes: no session, no count,
    nothing queued, and the next turn takes the log position it would have had."""
    async with running_buffer(store_path) as (ground, buffer):
        before = ground.store.next_lsn
        with pytest.raises(TypeError, match="unsupported"):
            buffer.append("ana", "s1", "user", "hi", T0, {"x": object()})
        assert buffer.next_seq("ana", "s1") is None and buffer.counts() == (0, 0, 0, 0)
        receipt = say(buffer, "ana", "s1", "hi", 0)
        assert (receipt.seq, receipt.lsn) == (0, before)


async def test_dropping_a_user_or_a_session_forgets_only_that(store_path) -> None:
    """drop_session and drop_user take the counters and windows of what they name, and leave
    every other session as it was."""
    async with running_buffer(store_path) as (_, buffer):
        say(buffer, "ana", "s1", "one", 0)
        say(buffer, "ana", "s2", "two", 1)
        say(buffer, "bo", "s1", "three", 2)
        buffer.drop_session("ana", "s1")
        assert [s.session_id for s in buffer.sessions("ana")] == ["s2"]
        buffer.drop_user("ana")
        assert buffer.users() == ["bo"] and buffer.sessions("ana") == []
        assert buffer.counts() == (1, 1, 1, 1)
        assert [t.text for t in await buffer.history("bo", "s1", 5)] == ["three"]


# Turns as (user, session, minute, zone offset in hours, scope), in the order appended: runs of
# one session, sessions interleaved, a session that exists before (ana/s1), scopes that only
# the first turn of a new session sets, and times in another zone than UTC.
BULK = [("ana", "s1", 0, 0, {}), ("ana", "s1", 1, 0, {}), ("ana", "s2", 2, 2, {"agent_id": "a"}),
        ("bo", "s1", 3, 0, {"run_id": "r"}), ("ana", "s2", 4, -5, {}), ("ana", "s1", 5, 0, {}),
        ("ana", "s1", 6, 0, {}), ("ana", "s1", 7, 0, {}), ("cy", "s3", 8, 0, {}),
        ("ana", "s2", 9, 0, {}), ("bo", "s1", 10, 0, {})]


def _columns(rows: list[tuple[Any, ...]]) -> list[list[Any]]:
    """BULK's rows as append_many's columns."""
    columns: list[list[Any]] = [[] for _ in range(8)]
    for user_id, session_id, minute, hours, scope in rows:
        at = (T0 + timedelta(minutes=minute)).astimezone(timezone(timedelta(hours=hours)))
        for column, value in zip(columns, (user_id, session_id, "user", f"{user_id} {minute}",
                                           at, {"m": minute}, scope.get("agent_id"),
                                           scope.get("run_id")), strict=True):
            column.append(value)
    return columns


async def _appended(path: Path, bulk: bool) -> tuple[Any, ...]:
    """BULK appended one turn at a time or with append_many (in two calls, so that a call
    continues sessions the one before began), after one turn of ana/s1; what the buffer and
    the store then hold, turn ids aside."""
    config = Config(window_turns=2, live_windows=2)
    async with running_buffer(path, config) as (ground, buffer):
        say(buffer, "ana", "s1", "before", -1)
        if bulk:
            receipts = [*buffer.append_many(*_columns(BULK[:4])),
                        *buffer.append_many(*_columns(BULK[4:]))]
        else:
            receipts = [buffer.append(*row[:6], None, *row[6:]) for row in zip(*_columns(BULK))]
        held = (
            [(r.seq, r.lsn) for r in receipts], buffer.counts(), sorted(buffer.users()),
            {user: buffer.sessions(user) for user in buffer.users()},
            [(t.lsn, t.text) for user in buffer.users() for t in buffer.turns_after(user, 0)],
            [(user, t.lsn, t.text) for user in buffer.users()
             for t in buffer.turns_after(user, receipts[6].lsn)],
            [(turn.user_id, turn.text) for r in receipts
             for turn in [buffer.recent_turn(row[0], r.lsn) for row in BULK] if turn],
            {(user, s.session_id): [(t.seq, t.text, t.at, t.agent_id, t.run_id) for t in
                                     await buffer.history(user, s.session_id, 10)]
             for user in buffer.users() for s in buffer.sessions(user)})
        await receipts[-1].durable()
        stored = []
        for user_id, session_id in (("ana", "s1"), ("ana", "s2"), ("bo", "s1"), ("cy", "s3")):
            stored += [msgspec.structs.replace(t, turn_id="") for t in await ground.store.read(
                store_mod.read_session_turns, user_id, session_id, 0, 2**63)]
        sessions = await ground.store.read(store_mod.read_sessions)
    return held, sorted(stored, key=lambda t: t.lsn), sessions


async def test_append_many_appends_what_append_would(tmp_path) -> None:
    """append_many gives the same seqs, lsns, windows, counters, session infos and stored
    records as one append per turn, across runs of one session, interleaved sessions, a
    session that existed before, scopes and zones."""
    one_by_one = await _appended(tmp_path / "one", bulk=False)
    bulk = await _appended(tmp_path / "bulk", bulk=True)
    assert bulk == one_by_one
    held, stored, _ = bulk
    assert [t.seq for t in stored if t.session_id == "s1" and t.user_id == "ana"] == list(range(6))
    assert all(t.at.tzinfo is timezone.utc for t in stored)


async def test_append_many_takes_a_queue_slot_per_turn(store_path) -> None:
    """A bulk run of turns counts as its turns in the store's queue (what reserve and the
    batches count), and each turn gets its own lsn and receipt."""
    async with running_buffer(store_path) as (ground, buffer):
        first = ground.store.next_lsn
        receipts = buffer.append_many(*_columns(BULK))
        assert ground.store.queued == len(BULK)
        assert [r.lsn for r in receipts] == list(range(first, first + len(BULK)))
        assert ground.store.next_lsn == first + len(BULK)
        await receipts[-1].durable()
        assert ground.store.queued == 0
