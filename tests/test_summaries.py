"""Rolling session summaries (seed 003): optimistic concurrency by epoch."""

from __future__ import annotations

import pytest
import trio

from engine import InvalidInput

from .conftest import open_engine, raw_databases


async def test_a_stale_writer_never_overwrites_a_newer_summary(store_path) -> None:
    """Two summarisers read epoch 1; the first to write wins, the slower one is refused."""
    async with open_engine(store_path) as mem:
        for i in range(6):
            await mem.add_turn("ana", "s", "user", f"turn {i}")
        assert await mem.session_summary("ana", "s") is None
        assert await mem.write_session_summary("ana", "s", "first summary", 2, 0) is True
        read = await mem.session_summary("ana", "s")
        assert (read.epoch, read.summary, read.upper_seq) == (1, "first summary", 2)

        results: dict[str, bool] = {}

        async def summarise(name: str, upper: int) -> None:
            results[name] = await mem.write_session_summary("ana", "s", f"by {name}", upper,
                                                            read.epoch)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(summarise, "fast", 6)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(summarise, "slow", 4)
        assert results == {"fast": True, "slow": False}
        final = await mem.session_summary("ana", "s")
        assert (final.epoch, final.summary, final.upper_seq) == (2, "by fast", 6)
    async with open_engine(store_path) as mem:
        assert (await mem.session_summary("ana", "s")).summary == "by fast"


async def test_summary_arguments_are_checked(mem) -> None:
    """An unknown session or a boundary beyond the session is refused, with what was found."""
    await mem.add_turn("ana", "s", "user", "hello")
    with pytest.raises(InvalidInput, match=r"session_id: expected a session of user 'ana', found none called 'x'"):
        await mem.write_session_summary("ana", "x", "summary", 0, 0)
    with pytest.raises(InvalidInput, match=r"upper_seq: expected an integer from 0 to 1, found 5"):
        await mem.write_session_summary("ana", "s", "summary", 5, 0)
    with pytest.raises(InvalidInput, match=r"summary: expected a non-empty string"):
        await mem.write_session_summary("ana", "s", " ", 1, 0)


async def test_forgetting_removes_summaries(store_path) -> None:
    """forget_session and forget_user delete the summaries with the sessions."""
    async with open_engine(store_path) as mem:
        for session in ("a", "b"):
            await mem.add_turn("zed-user", session, "user", "hi")
            await mem.write_session_summary("zed-user", session, f"xyzzy summary {session}", 1, 0)
        await mem.forget_session("zed-user", "a")
        assert await mem.session_summary("zed-user", "a") is None
        assert await mem.session_summary("zed-user", "b") is not None
        await mem.forget_user("zed-user")
    assert raw_databases(store_path)["summaries"] == []
