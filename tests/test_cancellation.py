"""Cancellation anywhere leaves the engine usable and the store consistent."""

from __future__ import annotations

import io
from functools import partial

import trio

from engine import NewTurn

from .conftest import open_engine, raw_databases
from .test_concurrency_hostile import _gate_writer


async def test_recall_cancelled_midway_leaves_engine_usable(store_path) -> None:
    """A recall cancelled while its legs run costs nothing: the next one answers normally."""
    async with open_engine(store_path) as mem:
        await mem.add_turn("ana", "s", "user", "the lisbon flat has a balcony")
        await mem.flush()
        for _ in range(20):
            with trio.move_on_after(0) as scope:
                await mem.recall("ana", "lisbon balcony")
            assert scope.cancelled_caught
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(mem.recall, "ana", "lisbon balcony")
                await trio.testing.wait_all_tasks_blocked()
                scope.cancel()
        hits = await mem.recall("ana", "lisbon balcony")
    assert [h.text for h in hits] == ["the lisbon flat has a balcony"]


async def test_a_cancelled_snapshot_leaves_nothing_behind(store_path, tmp_path) -> None:
    """Cancelling a snapshot mid-copy removes its partial directory; a later one succeeds."""
    async with open_engine(store_path) as mem:
        await mem.add_turns([NewTurn(user_id="ana", session_id="s", role="user",
                                     text=f"note {i}") for i in range(500)])
        await mem.flush()
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(mem.snapshot, tmp_path / "snap")
                await trio.testing.wait_all_tasks_blocked()
                scope.cancel()
        assert not (tmp_path / "snap").exists() and not (tmp_path / "snap.partial").exists()
        manifest = await mem.snapshot(tmp_path / "snap")
        assert manifest.counts["turns"] == 500
        await mem.add_turn("ana", "s", "user", "still ingesting", durable=True)


async def test_add_turns_cancelled_midway_keeps_a_gapless_log(store_path) -> None:
    """A bulk ingest cancelled between chunks keeps what it queued, in order, with no holes."""
    items = [NewTurn(user_id="ana", session_id="s", role="user", text=f"t{i}") for i in range(5000)]
    async with open_engine(store_path, config={"long_term": False}) as mem:  # a log of turns only
        with trio.move_on_after(0.0005):
            await mem.add_turns(items)
        await mem.add_turn("ana", "s", "user", "after", durable=True)
        history = await mem.session_history("ana", "s", limit=10_000)
    assert [t.seq for t in history] == list(range(len(history)))
    assert [t.text for t in history[:-1]] == [f"t{i}" for i in range(len(history) - 1)]
    log_keys = [int.from_bytes(k, "big") for k, _ in raw_databases(store_path)["log"]]
    assert log_keys == list(range(1, len(history) + 1))


async def _cancelled_while_written(mem, call) -> None:
    """Run ``call`` and cancel it while its write waits in the store's writer (held there),
    then let the write land."""
    gate = _gate_writer(mem)
    gate.clear()
    queued = mem._store.next_lsn
    try:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(call)
                while mem._store.next_lsn == queued:  # until it has queued its write
                    await trio.sleep(0.001)
                await trio.testing.wait_all_tasks_blocked()
                scope.cancel()
                gate.set()
    finally:
        gate.set()
    await mem.flush()


async def test_a_fact_write_cancelled_after_it_was_queued_leaves_one_value(store_path) -> None:
    """remember_fact cancelled while its write waited to commit: the write landed, and the
    next value for the key supersedes it (before, the cache never learned of it, so two
    versions stayed active for good and forget_fact retracted only one); a cancelled
    forget_fact leaves the fact out of the profile at once, as the store holds it."""
    async with open_engine(store_path) as mem:
        await mem.remember_fact("ana", "identity", "location", "Faro")
        await _cancelled_while_written(
            mem, partial(mem.remember_fact, "ana", "identity", "location", "Porto"))
        await mem.remember_fact("ana", "identity", "location", "Lisbon")
        active = [f.value for f in await mem.fact_versions("ana") if f.status == "active"]
        assert active == ["Lisbon"]
        assert [f.value for f in await mem.profile("ana")] == ["Lisbon"]
        await _cancelled_while_written(
            mem, partial(mem.forget_fact, "ana", "identity", "location"))
        assert await mem.profile("ana") == []
    async with open_engine(store_path) as mem:
        assert await mem.profile("ana") == []
        history = await mem.fact_history("ana", "identity", "location")
        assert [(f.value, f.status) for f in history] == [
            ("Faro", "superseded"), ("Porto", "superseded"), ("Lisbon", "retracted")]


async def test_a_note_cancelled_after_it_was_queued_has_its_file_and_is_not_stored_twice(
        store_path, tmp_path) -> None:
    """store_note cancelled while its write waited to commit: the note landed, so its
    Markdown file is written and the same note stored again is that note, not a second."""
    root = tmp_path / "notes"
    async with open_engine(store_path, config={"notes_markdown_dir": str(root)}) as mem:
        await _cancelled_while_written(mem, partial(mem.store_note, "ana", "walks at seven"))
        again = await mem.store_note("ana", "walks at seven")
        notes = await mem.list_notes("ana")
    assert [n.note_id for n in notes] == [again.note_id]
    assert [p.name for p in (root / "ana").iterdir()] == [f"{again.note_id}.md"]


async def test_an_import_cancelled_while_its_records_commit_still_reaches_the_caches(
        store_path, tmp_path) -> None:
    """import_user cancelled while its records waited to commit: they landed, and the user's
    cached facts, read before the import, learn of them (before, the imported active fact
    stayed active beside the next value of its key, for good)."""
    export = io.BytesIO()
    async with open_engine(tmp_path / "a") as mem:
        await mem.remember_fact("maya", "identity", "location", "Lisbon")
        await mem.export_user("maya", export)
    async with open_engine(store_path) as mem:
        await mem.remember_fact("maya", "preference", "drink", "tea")
        assert [f.value for f in await mem.profile("maya")] == ["tea"]  # cached
        await _cancelled_while_written(mem, partial(mem.import_user, export.getvalue()))
        assert {f.value for f in await mem.profile("maya")} == {"tea", "Lisbon"}
        await mem.remember_fact("maya", "identity", "location", "Porto")
        active = {f.value for f in await mem.fact_versions("maya") if f.status == "active"}
    assert active == {"tea", "Porto"}


async def test_an_import_cancelled_while_its_links_and_entities_commit_reaches_them_too(
        store_path, tmp_path) -> None:
    """import_user cancelled while its records without a log position (entities, links,
    reviews) waited to commit, its notes already stored: they land, the user's entity names
    read before the import learn of them, and the notes' Markdown files are written (before,
    the entity cache kept the user without them until a restart, and no file was made)."""
    export = io.BytesIO()
    async with open_engine(tmp_path / "a") as mem:
        await mem.add_turn("maya", "s1", "user", "I met Carlos Mendes in Lisbon yesterday")
        await mem.store_note("maya", "Carlos is a friend from Porto")
        await mem.flush()
        await mem.export_user("maya", export)
    root = tmp_path / "notes"
    async with open_engine(store_path, config={"notes_markdown_dir": str(root)}) as mem:
        gate = _gate_writer(mem)
        store = mem._store
        write_unlogged = store.write_unlogged
        entered = trio.Event()
        importing = []

        async def held(*ops):
            if trio.lowlevel.current_task() in importing and not entered.is_set():
                gate.clear()  # the import's write waits in the writer (not a follower's)
                entered.set()
            return await write_unlogged(*ops)

        cancelled = trio.CancelScope()

        async def run_import() -> None:
            importing.append(trio.lowlevel.current_task())
            with cancelled:
                await mem.import_user(export.getvalue())

        store.write_unlogged = held
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run_import)
                await entered.wait()
                await trio.testing.wait_all_tasks_blocked()
                cancelled.cancel()
                await trio.testing.wait_all_tasks_blocked()
                # A recall while the import's write waits caches the user's entity names as
                # the store holds them: none yet.
                assert await mem.recall("maya", "Carlos Mendes", legs=["entity"]) == []
                gate.set()
        finally:
            gate.set()
            store.write_unlogged = write_unlogged
        await mem.flush()
        found = await mem.recall("maya", "Carlos Mendes", legs=["entity"])
        notes = await mem.list_notes("maya")
    assert "I met Carlos Mendes in Lisbon yesterday" in {h.text for h in found}
    assert [p.name for p in (root / "maya").iterdir()] == [f"{notes[0].note_id}.md"]


async def test_an_engine_cancelled_from_outside_stores_every_turn_it_acknowledged(
        store_path) -> None:
    """A service shutting down cancels the scope around `async with Engine.open(...)` (a
    move_on_after, its nursery's cancel): the cancellation reached the store's writer before
    the engine's close shielded its drain, and the turns queued behind the commit under way,
    each acknowledged by its add_turn, were never written (12,288 of 20,580 in one run). The
    close drains them whatever ended the block."""
    import threading

    acknowledged = 0
    with trio.CancelScope() as scope:
        async with open_engine(store_path) as mem:
            gate = _gate_writer(mem)
            await mem.add_turn("ana", "s1", "user", "t0")
            acknowledged += 1
            gate.clear()  # the next batch waits in the writer's thread
            while mem._store.queued == 0 or acknowledged < 3000:
                await mem.add_turn("ana", "s1", "user", f"t{acknowledged}")
                acknowledged += 1
            threading.Timer(0.2, gate.set).start()
            scope.cancel()
            await trio.sleep(0)
    async with open_engine(store_path) as mem:
        history = await mem.session_history("ana", "s1", limit=10**6)
    assert len(history) == acknowledged


async def test_a_call_the_closing_engine_refuses_in_a_cancelled_block_is_the_cancellation(
        store_path) -> None:
    """Cancelled from outside, the engine closes its store at once while the block still
    runs; a call in the block that reached the store before a checkpoint raised EngineClosed,
    and the engine's exit made it EngineBroken("the engine failed: Cancelled ...;
    EngineClosed ..."): a service's clean shutdown looked like a crash, escaping the scope
    that cancelled it. It is that scope's cancellation now, which the scope takes."""
    with trio.CancelScope() as scope:
        async with open_engine(store_path) as mem:
            await mem.add_turn("ana", "s1", "user", "before the shutdown", durable=True)
            scope.cancel()
            with trio.CancelScope(shield=True):
                # The engine's tasks see the cancellation meanwhile: the store closes.
                await trio.testing.wait_all_tasks_blocked()
            await mem.recall("ana", "shutdown")
    assert scope.cancelled_caught
    async with open_engine(store_path) as mem:
        assert [t.text for t in await mem.session_history("ana", "s1")] == [
            "before the shutdown"]
