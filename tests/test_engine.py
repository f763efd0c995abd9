"""The public ingest and session API, as a bot uses it."""

from __future__ import annotations

import io
from datetime import datetime, timedelta, timezone

import pytest
import trio

from engine import Engine, EngineClosed, NewTurn, Turn

from .conftest import StepClock, T0, open_engine, raw_databases


async def test_add_turn_is_in_history_at_once_with_ids_and_seq(mem: Engine) -> None:
    """A turn is in the session window the moment add_turn returns, with id, seq and meta."""
    r1 = await mem.add_turn("ana", "s1", "user", "I moved to Lisbon", meta={"lang": "en"})
    r2 = await mem.add_turn("ana", "s1", "assistant", "Welcome to Lisbon!")
    assert (r1.seq, r2.seq) == (0, 1)
    assert r1.turn_id != r2.turn_id
    history = await mem.session_history("ana", "s1")
    assert [t.text for t in history] == ["I moved to Lisbon", "Welcome to Lisbon!"]
    assert [t.turn_id for t in history] == [r1.turn_id, r2.turn_id]
    first = history[0]
    assert (first.user_id, first.session_id, first.role, first.meta) == ("ana", "s1", "user", {"lang": "en"})
    assert first.at == T0 + timedelta(seconds=1)  # the clock's first reading checked it at open


async def test_durable_receipt_resolves_after_commit(mem: Engine) -> None:
    """durable() returns once the store's committed sequence covers the turn."""
    r = await mem.add_turn("ana", "s1", "user", "hello")
    await r.durable()
    assert (await mem.stats()).committed_lsn >= r.lsn
    r2 = await mem.add_turn("ana", "s1", "user", "again", durable=True)
    assert (await mem.stats()).committed_lsn >= r2.lsn


async def test_at_is_kept_as_the_same_instant_in_utc(mem: Engine) -> None:
    """A turn given a local time comes back as the same instant in UTC, from RAM and disk alike."""
    local = datetime(2026, 5, 2, 14, 30, tzinfo=timezone(timedelta(hours=2)))
    r = await mem.add_turn("ana", "s1", "user", "lunch", at=local)
    (in_window,) = await mem.session_history("ana", "s1")
    from_disk = await mem.get_turn("ana", r.turn_id)
    assert in_window.at == from_disk.at == local
    assert from_disk.at.utcoffset() == timedelta(0)


async def test_history_limit_returns_the_latest_turns_oldest_first(mem: Engine) -> None:
    """limit picks the newest turns and keeps them in conversation order."""
    for i in range(5):
        await mem.add_turn("ana", "s1", "user", f"turn {i}")
    assert [t.text for t in await mem.session_history("ana", "s1", limit=2)] == ["turn 3", "turn 4"]


async def test_history_beyond_the_window_reads_older_turns_from_disk(store_path, clock) -> None:
    """A history longer than the RAM window is completed from the store, without gaps."""
    async with open_engine(store_path, clock=clock, config={"window_turns": 4}) as mem:
        for i in range(30):
            await mem.add_turn("ana", "s1", "user", f"turn {i}")
        history = await mem.session_history("ana", "s1", limit=25)
    assert [t.seq for t in history] == list(range(5, 30))


async def test_evicted_windows_are_reread_from_disk(store_path, clock) -> None:
    """With more sessions than live windows, an evicted session's history is still whole."""
    config = {"window_turns": 5, "live_windows": 2}
    async with open_engine(store_path, clock=clock, config=config) as mem:
        for s in range(4):
            for i in range(3):
                await mem.add_turn("ana", f"s{s}", "user", f"s{s} turn {i}")
        assert (await mem.stats()).live_windows == 2
        history = await mem.session_history("ana", "s0")
    assert [t.text for t in history] == ["s0 turn 0", "s0 turn 1", "s0 turn 2"]


async def test_list_sessions_most_recent_first(mem: Engine) -> None:
    """Sessions are listed by their latest turn, newest first, with counts and times."""
    await mem.add_turn("ana", "old", "user", "a", at=T0)
    await mem.add_turn("ana", "new", "user", "b", at=T0 + timedelta(days=2))
    await mem.add_turn("ana", "mid", "user", "c", at=T0 + timedelta(days=1))
    await mem.add_turn("ana", "old", "user", "d", at=T0 + timedelta(hours=1))
    sessions = await mem.list_sessions("ana")
    assert [s.session_id for s in sessions] == ["new", "mid", "old"]
    old = sessions[-1]
    assert (old.turn_count, old.started_at, old.last_at) == (2, T0, T0 + timedelta(hours=1))
    assert await mem.list_sessions("nobody") == []


async def test_a_back_dated_turn_leaves_its_session_spanning_its_earliest_and_latest_turn(
        store_path, clock) -> None:
    """A turn given an earlier ``at`` than its session's others (late notes, an import, a
    clock behind) set last_at back to its own time and left started_at at the first turn's:
    the session listed as ended before a turn it holds, even before it started. started_at is
    the earliest turn time a session holds and last_at the latest, by add_turn, add_turns or
    an import, before and after a reopen."""
    h = timedelta(hours=1)

    def turn(session_id: str, text: str, at: datetime) -> dict:
        return {"user_id": "ana", "session_id": session_id, "role": "user", "text": text,
                "at": at}

    def spans(sessions) -> dict:
        return {s.session_id: (s.started_at, s.last_at, s.turn_count) for s in sessions}

    expected = {"one": (T0, T0 + 3 * h, 5), "bulk": (T0 + h, T0 + 5 * h, 3),
                "other": (T0 + 9 * h, T0 + 9 * h, 1)}
    export = io.BytesIO()
    async with open_engine(store_path, clock=clock) as mem:
        for hours in (2, 1, 3, 0):  # the last said is the earliest
            await mem.add_turn("ana", "one", "user", f"at {hours}", at=T0 + hours * h)
        await mem.add_turns([turn("bulk", "a", T0 + 5 * h), turn("bulk", "b", T0 + 4 * h),
                             turn("other", "c", T0 + 9 * h), turn("bulk", "d", T0 + h),
                             turn("one", "e", T0 + 2 * h)])
        sessions = await mem.list_sessions("ana")
        assert spans(sessions) == expected
        assert [s.session_id for s in sessions] == ["other", "bulk", "one"]
        await mem.export_user("ana", export)
        await mem.import_user(export.getvalue(), as_user="ana2")
        assert spans(await mem.list_sessions("ana2")) == expected
    async with open_engine(store_path, clock=clock) as mem:
        assert spans(await mem.list_sessions("ana")) == expected
        assert spans(await mem.list_sessions("ana2")) == expected


async def test_add_turns_ingests_many_in_order(mem: Engine) -> None:
    """add_turns takes NewTurn values or mappings and keeps their order within a session."""
    receipts = await mem.add_turns(
        [
            NewTurn(user_id="ana", session_id="s1", role="user", text="one"),
            {"user_id": "ana", "session_id": "s1", "role": "assistant", "text": "two"},
            NewTurn(user_id="bo", session_id="x", role="user", text="other user", meta={"k": [1]}),
        ],
        durable=True,
    )
    assert [r.seq for r in receipts] == [0, 1, 0]
    assert [t.text for t in await mem.session_history("ana", "s1")] == ["one", "two"]
    assert (await mem.get_turn("bo", receipts[2].turn_id)).meta == {"k": [1]}


async def test_get_turn_is_scoped_to_its_user(mem: Engine) -> None:
    """A turn id looked up under another user finds nothing."""
    r = await mem.add_turn("ana", "s1", "user", "secret")
    assert (await mem.get_turn("ana", r.turn_id)).text == "secret"
    assert await mem.get_turn("bo", r.turn_id) is None


async def test_forget_session_removes_it_and_a_new_one_starts_fresh(mem: Engine) -> None:
    """A forgotten session is gone at once; the same id later starts again at seq 0."""
    await mem.add_turn("ana", "s1", "user", "forget me")
    await mem.add_turn("ana", "s2", "user", "keep me")
    await mem.forget_session("ana", "s1")
    assert await mem.session_history("ana", "s1") == []
    assert [s.session_id for s in await mem.list_sessions("ana")] == ["s2"]
    r = await mem.add_turn("ana", "s1", "user", "fresh start")
    assert r.seq == 0


async def test_forget_user_leaves_no_record_in_any_database(store_path, clock) -> None:
    """After forget_user, no key or value in any LMDB database holds the user's id or text."""
    async with open_engine(store_path, clock=clock) as mem:
        for s in range(3):
            for i in range(10):
                await mem.add_turn("zed-the-user", f"zsess-{s}", "user", f"zed secret {i}")
                await mem.add_turn("ana", f"s{s}", "user", f"ana note {i}")
        pending = await mem.add_turn("zed-the-user", "zsess-9", "user", "zed secret in flight")
        await mem.forget_user("zed-the-user")
        assert await mem.list_sessions("zed-the-user") == []
        assert await mem.get_turn("zed-the-user", pending.turn_id) is None
        assert (await mem.stats()).users == 1
    databases = raw_databases(store_path)
    assert {"turns", "ids", "sessions", "log", "meta"} <= set(databases)
    for name, items in databases.items():
        for key, value in items:
            for needle in (b"zed-the-user", b"zsess", b"zed secret"):
                assert needle not in key and needle not in value, (name, key)
    assert len(databases["turns"]) == 30


async def test_stats_counts_what_is_held(mem: Engine) -> None:
    """stats reports users, sessions, turns and the log position."""
    await mem.add_turn("ana", "s1", "user", "a")
    await mem.add_turn("ana", "s2", "user", "b")
    await mem.add_turn("bo", "s1", "user", "c")
    await mem.flush()
    stats = await mem.stats()
    assert (stats.users, stats.sessions, stats.turns) == (2, 3, 3)
    assert stats.last_lsn == stats.committed_lsn == 3
    assert stats.queued == 0 and stats.store_bytes > 0


async def test_stats_say_where_durable_receipts_spent_their_time(mem: Engine) -> None:
    """stats times each durable receipt's way in stages, from queued to woken; buffered turns
    add nothing."""
    await mem.add_turn("ana", "s1", "user", "buffered")
    await mem.flush()
    assert (await mem.stats()).durable_stages == {}
    for i in range(3):
        await mem.add_turn("ana", "s1", "user", f"durable {i}", durable=True)
    stages = (await mem.stats()).durable_stages
    assert list(stages) == ["queued", "to_writer", "plan", "write", "commit", "flush_wait",
                            "flush", "to_trio", "wake", "total"]
    total = stages["total"]
    assert 0 < total["p50_ms"] <= total["p99_ms"] <= total["max_ms"]
    assert all(s["max_ms"] <= total["max_ms"] for s in stages.values())


async def test_stats_say_how_far_the_long_term_layer_and_both_indexes_have_got(
        store_path, monkeypatch) -> None:
    """stats names each long-term follower's position and the episodes made, the users whose
    vector graph is still being built (searches meanwhile take the exact scan), and why a
    text index found missing at open is being rebuilt."""
    import shutil
    import threading

    import actors.ann_index.ann_index as ann_mod

    monkeypatch.setattr(ann_mod, "HNSW_THRESHOLD", 50)
    gate = threading.Event()  # set by the test: until then graph builds wait in their thread
    build = ann_mod.AnnIndex._write_graph

    def held(self, *args):
        gate.wait(10)
        return build(self, *args)

    monkeypatch.setattr(ann_mod.AnnIndex, "_write_graph", held)
    async with open_engine(store_path, clock=StepClock()) as mem:
        stats = await mem.stats()
        assert (stats.episodes_made, stats.text_index_rebuilt, stats.vector_graphs_behind) == (
            0, None, 0)
        receipts = [await mem.add_turn("ana", "s", "user", f"note {i} about the trip")
                    for i in range(60)]
        await mem.flush()
        await mem.recall("ana", "the trip")  # loads the user's 65 vectors: a graph is due
        stats = await mem.stats()
        assert set(stats.long_term_lsn) == {"entities", "facts", "episodic"}
        assert min(stats.long_term_lsn.values()) >= receipts[-1].lsn
        assert stats.episodes_made == 5  # at 20, 30, ... 60 turns, the oldest 10 not in one
        assert stats.vector_graphs_behind == 1
        gate.set()
    shutil.rmtree(store_path / "fulltext")
    async with open_engine(store_path, config={"long_term": False}) as mem:
        await mem.recall("ana", "the trip")  # the graph saved at close: nothing to build
        stats = await mem.stats()
    assert (stats.long_term_lsn, stats.episodes_made) == ({}, 0)
    assert (stats.text_index_rebuilt, stats.vector_graphs_behind) == ("missing", 0)


async def test_reopen_keeps_turns_and_continues_sequences(store_path) -> None:
    """After a clean close and reopen, every turn is there and seq and lsn carry on."""
    clock = StepClock()
    async with open_engine(store_path, clock=clock) as mem:
        for i in range(3):
            await mem.add_turn("ana", "s1", "user", f"before {i}")
    async with open_engine(store_path, clock=clock) as mem:
        r = await mem.add_turn("ana", "s1", "user", "after")
        assert (r.seq, r.lsn) == (3, 4)
        history = await mem.session_history("ana", "s1")
    assert [t.text for t in history] == ["before 0", "before 1", "before 2", "after"]
    log_keys = [int.from_bytes(k, "big") for k, _ in raw_databases(store_path)["log"]]
    assert log_keys == [1, 2, 3, 4]


async def test_calls_after_close_raise_engine_closed(store_path) -> None:
    """Every method of a closed engine raises EngineClosed, and says how to go on."""
    async with open_engine(store_path) as mem:
        pass
    with pytest.raises(EngineClosed, match=r"Engine.open"):
        await mem.add_turn("ana", "s1", "user", "late")
    with pytest.raises(EngineClosed):
        await mem.session_history("ana", "s1")
    with pytest.raises(EngineClosed):
        await mem.stats()


async def test_close_while_ingestion_is_in_flight_keeps_every_acknowledged_turn(store_path) -> None:
    """Producers racing a close either get EngineClosed or a receipt whose turn is on disk."""
    acked: list[tuple[str, int]] = []
    refused = 0

    async def producer(mem: Engine, name: str) -> None:
        nonlocal refused
        try:
            for i in range(10_000):
                r = await mem.add_turn("ana", name, "user", f"{name} {i}", durable=i % 7 == 0)
                acked.append((name, r.seq))
                if i % 50 == 0:
                    await trio.sleep(0)
        except EngineClosed:
            refused += 1

    async with trio.open_nursery() as nursery:
        async with open_engine(store_path) as mem:
            for p in range(4):
                nursery.start_soon(producer, mem, f"p{p}")
            while len(acked) < 2_000:
                await trio.sleep(0)
    assert refused == 4
    async with open_engine(store_path) as mem:
        for p in range(4):
            name = f"p{p}"
            seqs = sorted(seq for who, seq in acked if who == name)
            history = await mem.session_history("ana", name, limit=100_000)
            assert [t.seq for t in history] == seqs == list(range(len(seqs)))


async def test_an_error_in_the_body_comes_out_unchanged_and_turns_are_kept(store_path) -> None:
    """The caller's own exception is not wrapped, and acknowledged turns still reach the disk."""
    with pytest.raises(KeyError, match="mine"):
        async with open_engine(store_path) as mem:
            await mem.add_turn("ana", "s1", "user", "kept")
            raise KeyError("mine")
    async with open_engine(store_path) as mem:
        assert [t.text for t in await mem.session_history("ana", "s1")] == ["kept"]


async def test_store_grows_its_map_instead_of_failing(store_path) -> None:
    """A store opened with a 1 MiB map takes 4 MiB of turns, growing while reads go on."""
    text = "x" * 2000
    async with open_engine(store_path, config={"initial_map_bytes": 1 << 20}) as mem:
        for _ in range(4):
            await mem.add_turns(
                [NewTurn(user_id="ana", session_id="s1", role="user", text=text)] * 500
            )
            await mem.session_history("ana", "s1", limit=600)
        await mem.flush()
        stats = await mem.stats()
    assert stats.turns == 2000 and stats.map_bytes > 4 << 20
    assert len(raw_databases(store_path)["turns"]) == 2000


async def test_history_types_are_turn_structs(mem: Engine) -> None:
    """history returns Turn values a caller can pattern-match on."""
    await mem.add_turn("ana", "s1", "tool", '{"ok": true}')
    (turn,) = await mem.session_history("ana", "s1")
    assert isinstance(turn, Turn) and turn.role == "tool"
