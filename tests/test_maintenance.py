"""Maintenance: weekly reflections and stale pending reviews (decay and consolidation are
tested with facts and episodes)."""

from __future__ import annotations

from datetime import timedelta

from .actors.test_facts import ManualClock
from .conftest import T0, open_engine, raw_databases


async def test_a_weekly_reflection_is_written_once_per_week(store_path) -> None:
    """Three new facts in a week earn one reflection note, tagged, searchable, never twice in
    the same ISO week; a quiet week earns none."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await mem.add_turn("ana", "s", "user", "I'm allergic to peanuts.")
        await mem.add_turn("ana", "s", "user", "I moved to Porto last month.")
        await mem.add_turn("ana", "s", "user", "I work as a pharmacist, long shifts.")
        await mem.flush()
        report = await mem.maintain()
        assert report.reflections == 1
        year, week, _ = T0.isocalendar()
        note = await mem.get_note("ana", f"reflection-{year}-W{week:02d}")
        assert note is not None and set(note.tags) == {"reflection", "weekly"}
        assert "Learned: " in note.text and "Allergic to peanuts" in note.text
        assert (await mem.maintain()).reflections == 0
        await mem.flush()
        hits = await mem.recall("ana", "weekly reflection", tags=["reflection"])
        assert [h.id for h in hits] == [note.note_id]
        clock.now = T0 + timedelta(days=14)
        assert (await mem.maintain()).reflections == 0  # nothing new in the past week


async def test_pending_reviews_nobody_rated_are_dropped_after_a_day(store_path) -> None:
    """A retrieval whose conversation never answered leaves no pending review behind."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await mem.add_turn("ana", "s", "user", "The hotel in Porto had a view of the river.")
        await mem.flush()
        await mem.retrieve_memory("ana", "Porto hotel", conversation_id="quiet")
        await mem.flush()
        assert (await mem.maintain()).dropped_reviews == 0
        clock.now = T0 + timedelta(days=2)
        assert (await mem.maintain()).dropped_reviews == 1
    assert raw_databases(store_path)["pending"] == []


async def test_a_retrieval_racing_forget_user_leaves_no_pending_review(store_path) -> None:
    """What a retrieval showed is not recorded if its user was forgotten meanwhile."""
    async with open_engine(store_path) as mem:
        await mem.add_turn("ana", "s", "user", "My secret plan involves a yellow submarine.")
        await mem.flush()
        retrieve = mem._briefing.retrieve

        async def retrieve_then_forget(*args, **kwargs):
            result = await retrieve(*args, **kwargs)
            await mem.forget_user("ana")
            return result

        mem._briefing.retrieve = retrieve_then_forget
        shown = await mem.retrieve_memory_raw("ana", "yellow submarine", conversation_id="c")
        assert shown.episodic
        await mem.flush()
    assert raw_databases(store_path)["pending"] == []


async def test_a_reflection_racing_forget_user_never_brings_the_user_back(store_path) -> None:
    """A weekly reflection read from a user's facts before the user was forgotten is not
    left after the forget, whether the forget lands after the read or while the note is
    being written: no note quoting the forgotten facts, no user left."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        for user in ("ana", "bo"):
            await mem.add_turn(user, "s", "user", "I'm allergic to peanuts.")
            await mem.add_turn(user, "s", "user", "I moved to Porto last month.")
            await mem.add_turn(user, "s", "user", "I work as a pharmacist, long shifts.")
        await mem.flush()
        recent, put_note = mem._maintenance._recent, mem._memory.put_note

        async def recent_then_forget(user_id, now):
            found = await recent(user_id, now)
            if user_id == "ana":
                await mem.forget_user(user_id)
            return found

        async def forget_then_put_note(user_id, *args, **kwargs):
            if user_id == "bo":  # the forget queued before the note is
                await mem.forget_user(user_id)
            return await put_note(user_id, *args, **kwargs)

        mem._maintenance._recent = recent_then_forget
        mem._memory.put_note = forget_then_put_note
        assert (await mem.maintain()).reflections == 0
        await mem.flush()
        for user in ("ana", "bo"):
            assert await mem.list_notes(user) == []
        assert await mem.list_users() == []
    assert not any(b"peanuts" in value for rows in raw_databases(store_path).values()
                   for _, value in rows)
