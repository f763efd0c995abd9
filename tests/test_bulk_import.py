"""add_turns, the bulk path of a history import: the same turns, sessions, log and chain as
add_turn one turn at a time, the same checks, and the followers see them."""

from __future__ import annotations

import math
import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

import actors.store as store_mod
import engine._ingest as ingest_mod
import actors.store.writer as writer_mod
from actors.store.writer import IMPORT_YIELD_SECONDS
from engine import Engine, InvalidInput, NewTurn

from .conftest import StepClock, T0, open_engine

# A history: runs of one session, sessions interleaved, one that exists before the import
# (ana/s1), mappings and NewTurns, times given (some in another zone) and left to the clock,
# meta on some turns, a scope set by the first turn of a new session and repeated by a later.
ITEMS: list[Any] = [
    NewTurn(user_id="ana", session_id="s1", role="user", text="back again"),
    {"user_id": "ana", "session_id": "s1", "role": "assistant", "text": "welcome back"},
    NewTurn(user_id="ana", session_id="s2", role="user", text="new topic", agent_id="helper"),
    NewTurn(user_id="bo", session_id="s1", role="user", text="hello",
            at=datetime(2026, 2, 1, 12, tzinfo=timezone(timedelta(hours=-3)))),
    NewTurn(user_id="ana", session_id="s2", role="assistant", text="go on", meta={"k": [1]},
            agent_id="helper"),
    NewTurn(user_id="ana", session_id="s1", role="user", text="one more"),
    NewTurn(user_id="cy", session_id="s9", role="tool", text='{"ok": true}', run_id="r1",
            at=T0 + timedelta(days=1)),
    NewTurn(user_id="bo", session_id="s1", role="assistant", text="hi bo"),
] * 3


async def _imported(path: Path, bulk: bool) -> tuple[Any, ...]:
    """ITEMS after one turn of ana/s1, with add_turns (in chunks of 5, so that chunks cut runs
    and go on with sessions an earlier chunk began) or one add_turn per item; what the engine
    then holds, turn ids aside. The clock stands still: ``add_turns`` reads it once a call, and
    ``add_turn`` once a turn (see test_add_turns_reads_the_clock_once_a_call)."""
    async with open_engine(path, clock=StepClock(step=timedelta(0))) as mem:
        await mem.add_turn("ana", "s1", "user", "first")
        if bulk:
            receipts = await mem.add_turns(ITEMS)
        else:
            receipts = []
            for item in ITEMS:
                fields = item if isinstance(item, dict) else msgspec.structs.asdict(item)
                receipts.append(await mem.add_turn(**fields))
        await mem.flush()
        sessions = {user: await mem.list_sessions(user) for user in ("ana", "bo", "cy")}
        turns = {(user, s.session_id): [msgspec.structs.replace(t, turn_id="") for t in
                                         await mem.session_history(user, s.session_id, 100)]
                 for user, infos in sessions.items() for s in infos}
        stats = await mem.stats()
        return ([(r.seq, r.lsn) for r in receipts], sessions, turns,
                (stats.turns, stats.last_lsn, stats.committed_lsn, stats.long_term_lsn))


async def test_add_turns_stores_what_add_turn_stores(tmp_path: Path, monkeypatch) -> None:
    """The same seqs, lsns, times, scopes, meta, session infos and follower positions as one
    add_turn per item; the bulk-imported store verifies (records and hash chain)."""
    monkeypatch.setattr(ingest_mod, "BULK_CHUNK", 5)
    one_by_one = await _imported(tmp_path / "one", bulk=False)
    bulk = await _imported(tmp_path / "bulk", bulk=True)
    assert bulk == one_by_one
    turns = bulk[2]
    assert [t.seq for t in turns[("ana", "s1")]] == list(range(10))
    assert {t.agent_id for t in turns[("ana", "s2")]} == {"helper"}
    assert turns[("bo", "s1")][0].at == datetime(2026, 2, 1, 15, tzinfo=timezone.utc)
    report = await Engine.verify(tmp_path / "bulk")
    assert report["ok"], report["problems"]


async def test_add_turns_reads_the_clock_once_a_call(tmp_path: Path) -> None:
    """A call's turns given no time arrived together: they share one reading of the clock
    (one a turn cost an import an eighth of its time), taken after the calls before it; a
    turn given a time keeps its own."""
    given = T0 - timedelta(days=3)
    async with open_engine(tmp_path / "store", clock=StepClock()) as mem:
        await mem.add_turn("ana", "s1", "user", "first")
        await mem.add_turns([NewTurn(user_id="ana", session_id="s1", role="user", text="a"),
                             NewTurn(user_id="bo", session_id="s1", role="user", text="b"),
                             NewTurn(user_id="ana", session_id="s1", role="user", text="c",
                                     at=given),
                             NewTurn(user_id="ana", session_id="s1", role="user", text="d")])
        await mem.add_turns([NewTurn(user_id="ana", session_id="s1", role="user", text="e")])
        ana = [t.at for t in await mem.session_history("ana", "s1", 10)]
        bo = [t.at for t in await mem.session_history("bo", "s1", 10)]
    first, call = ana[0], ana[1]
    assert first < call and ana[1:4] == [call, given, call] and bo == [call]
    assert ana[4] > call


@pytest.mark.parametrize(("index", "change", "field", "message"), [
    (2100, {"text": "   "}, "text", "expected a non-empty string"),
    (1, {"role": "bot"}, "role", "expected one of"),
    (2999, {"at": datetime(2026, 1, 1)}, "at", "naive datetime"),
    (1500, {"user_id": "a\x00b"}, "user_id", "no NUL"),
    (2048, {"meta": {"x": float("nan")}}, "meta['x']", "not valid JSON"),
    (2500, {"agent_id": "other"}, "agent_id", "expected 'helper'"),
    (3, {"text": "\ud800"}, "text", "lone surrogate"),
])
async def test_a_bad_item_in_a_long_batch_is_named_and_nothing_is_written(
        mem: Engine, index: int, change: dict[str, Any], field: str, message: str) -> None:
    """One bad item among 3,000 (past the first chunk, too): InvalidInput names its index and
    field with the check's own message, and not one turn of the batch is written."""
    items = [{"user_id": "ana", "session_id": "s", "role": "user", "text": f"turn {i}",
              "agent_id": "helper"} for i in range(3000)]
    items[index] = {**items[index], **change}
    with pytest.raises(InvalidInput, match=message) as info:
        await mem.add_turns(items)
    assert info.value.field == f"items[{index}].{field}"
    await mem.flush()
    stats = await mem.stats()
    assert (stats.turns, stats.last_lsn) == (0, 0)
    assert await mem.session_history("ana", "s") == []


async def test_the_followers_see_a_bulk_import(mem: Engine) -> None:
    """After flush, every follower has taken the imported turns: the text index and the
    vectors find them, and each long-term follower's position is the log's end."""
    receipts = await mem.add_turns(
        [NewTurn(user_id="ana", session_id=f"s{i // 20}", role=("user", "assistant")[i % 2],
                 text=f"I adopted a dog named Rex {i}" if i == 77 else f"plain turn {i}")
         for i in range(300)])
    await mem.flush()
    stats = await mem.stats()
    assert stats.embedded_lsn == stats.last_lsn >= receipts[-1].lsn  # and the episodes made
    assert stats.episodes_made > 0
    assert set(stats.long_term_lsn.values()) == {stats.last_lsn}
    hits = await mem.recall("ana", "dog named Rex", kinds=["turn"], limit=3)
    assert hits[0].text == "I adopted a dog named Rex 77"


async def test_a_follower_waits_before_its_step_for_an_import_for_at_most_a_second(
        store_path: Path, monkeypatch, mock_clock) -> None:
    """While an import's turns are queued and not yet committed, a follower about to take a
    step waits (on two cores an index stepping beside the import halves its rate) until they
    are committed; for at most IMPORT_YIELD_SECONDS, so an import that does not end never stops
    an index for good. The writer's thread is held here: released after half a second, the
    wait ends with the import committed; held, it ends at the second with nothing committed.
    The text index then catches up."""
    mock_clock.autojump_threshold = 0.05  # jump only when idle: waits on threads stay real
    gate = threading.Event()  # set by the test: write transactions may begin
    original = store_mod.Store._plan_and_write

    def gated(self, *args):
        gate.wait(10)
        return original(self, *args)

    async with open_engine(store_path, clock=StepClock()) as mem:
        store = mem._parts.store
        await mem.add_turn("ana", "s0", "user", "a turn before the import")
        await mem.flush()
        monkeypatch.setattr(store_mod.Store, "_plan_and_write", gated)
        steps: list[tuple[float, int]] = []  # (seconds waited, committed lsn then)

        async def step() -> None:
            began = trio.current_time()
            await store.yield_to_receipts(before_step=True)
            steps.append((trio.current_time() - began, store.committed_lsn))

        lasts: list[int] = []  # each import's last lsn
        for release in (True, False):
            # Released, only the commit may end the wait, however slow the writer's thread:
            # no deadline at all (the mock clock jumps to the next deadline whenever a commit
            # takes longer than its threshold in real time, and a 3,600 s one ended the wait).
            monkeypatch.setattr(writer_mod, "IMPORT_YIELD_SECONDS",
                                math.inf if release else IMPORT_YIELD_SECONDS)
            gate.clear()
            receipts = await mem.add_turns(
                [NewTurn(user_id="ana", session_id=f"s{i // 50}", role="user", text=f"turn {i}")
                 for i in range(500)])
            async with trio.open_nursery() as nursery:
                nursery.start_soon(step)
                await trio.sleep(0.5)
                assert len(steps) == (0 if release else 1)
                if release:
                    gate.set()
            gate.set()
            await receipts[-1].durable()
            lasts.append(receipts[-1].lsn)
        (_, committed), (bounded, behind) = steps
        assert committed >= lasts[0]
        assert abs(bounded - IMPORT_YIELD_SECONDS) < 1e-6 and behind < lasts[1] - 499
        await mem.flush()
        assert mem._fulltext.indexed_lsn >= receipts[-1].lsn
        hits = await mem.recall("ana", "turn 499", kinds=["turn"], limit=1)
        assert hits[0].text == "turn 499"
