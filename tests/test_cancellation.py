"""Cancellation anywhere leaves the engine usable and the store consistent."""

from __future__ import annotations

import trio

from engine import NewTurn

from .conftest import open_engine, raw_databases


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
