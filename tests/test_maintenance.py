"""Maintenance: weekly reflections and stale pending reviews (decay and consolidation are
tested with facts and episodes)."""

from __future__ import annotations

from datetime import timedelta

import trio

from engine import _forget

from .actors.test_facts import ManualClock
from .conftest import T0, open_engine, raw_databases


async def _tell(mem, session: str) -> None:
    """Three turns the rules make three facts of: an allergy, a home, a job."""
    for text in ("I'm allergic to peanuts.", "I moved to Porto last month.",
                 "I work as a pharmacist, long shifts."):
        await mem.add_turn("ana", session, "user", text)


def _pause_after_reading(maintenance, monkeypatch, read: trio.Event,
                         go_on: trio.Event) -> None:
    """Make a pass set ``read`` once it has read the user's facts, and wait for ``go_on``
    before it writes its reflection."""
    real = maintenance._recent

    async def recent(user_id, now):
        out = await real(user_id, now)
        read.set()
        await go_on.wait()
        return out

    monkeypatch.setattr(maintenance, "_recent", recent)


async def test_a_weekly_reflection_is_written_once_per_week(store_path) -> None:
    """Three new facts in a week earn one reflection note, tagged, searchable, never twice in
    the same ISO week; a quiet week earns none."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await _tell(mem, "s")
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


async def test_a_forgotten_fact_leaves_the_reflections_that_quote_it(store_path) -> None:
    """forget_fact took the fact out of the profile and recall, but the weekly and the session
    reflection went on saying "Learned: Allergic to peanuts" to every prompt. They go with it
    (as a forgotten session's do), and the next pass quotes only what the user still has."""
    clock = ManualClock()
    config = {"consolidate_on_new_session": True}
    async with open_engine(store_path, clock=clock, config=config) as mem:
        await _tell(mem, "s1")
        await mem.flush()
        assert (await mem.maintain()).reflections == 1
        await mem.add_turn("ana", "s2", "user", "hello again")  # the session reflection
        await mem.flush()
        year, week, _ = T0.isocalendar()
        weekly = f"reflection-{year}-W{week:02d}"
        for note_id in (weekly, "reflection-latest"):
            assert "Allergic to peanuts" in (await mem.get_note("ana", note_id)).text
        assert await mem.forget_fact("ana", "constraint", "allergy:peanuts")
        await mem.flush()
        # The turn that said it stays (forget_session forgets what was said); no
        # reflection, fact or note presents it as known any more.
        context = await mem.context_for_prompt("ana", "s3", budget_tokens=2000)
        assert "Allergic to peanuts" not in context and "reflection" not in context.lower()
        hits = await mem.recall("ana", "peanuts allergic", limit=20, kinds=["note", "fact"])
        assert not [h for h in hits if "peanut" in h.text.lower()]
        assert await mem.get_note("ana", weekly) is None
        assert (await mem.maintain()).reflections == 1  # written again, without it
        again = (await mem.get_note("ana", weekly)).text
        assert "Learned: " in again and "Allergic to peanuts" not in again and "Porto" in again
        assert not await mem.forget_fact("ana", "constraint", "allergy:peanuts")


async def test_a_reflection_after_the_clock_stepped_back_quotes_nothing_made_after_it(
        store_path) -> None:
    """The clock stepped back an hour (NTP): a pass took the facts made "later" than its own
    time into its reflection, which the forget of their session then left behind (it deletes
    the reflections written within a week after what it removes was made), quoting them."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await _tell(mem, "private")
        await mem.flush()
        clock.now = T0 - timedelta(hours=1)
        assert (await mem.maintain()).reflections == 0
        await mem.forget_session("ana", "private")
        await mem.flush()
        hits = await mem.recall("ana", "peanuts allergic pharmacist", limit=20)
        assert not [h for h in hits if "peanut" in h.text.lower()]


async def test_a_reflection_never_says_a_value_in_force_changed(store_path) -> None:
    """A plan forgotten puts Lisbon back in force as a new version beside the old one, which
    it capped: the week's reflection said "Learned: location: Lisbon" and then "Changed:
    location: Lisbon (no longer)". A value that is in force again is not listed as changed."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await mem.remember_fact("maya", "identity", "location", "Lisbon")
        await mem.remember_fact("maya", "work", "job", "baker")
        await mem.remember_fact("maya", "pet", "cat", "Miso")
        clock.now = T0 + timedelta(days=1)
        await mem.remember_fact("maya", "identity", "location", "Porto",
                                valid_at=T0 + timedelta(days=40))
        clock.now = T0 + timedelta(days=2)
        await mem.forget_fact("maya", "identity", "location")
        await mem.correct_fact("maya", "work", "job", "teacher")
        await mem.flush()
        assert (await mem.maintain()).reflections == 1
        (note,) = [n for n in await mem.list_notes("maya") if "reflection" in n.tags]
        assert "location: Lisbon" in note.text and "Lisbon (no longer)" not in note.text
        assert "job: baker (no longer)" in note.text


async def test_a_pass_that_read_before_a_fact_was_forgotten_writes_no_reflection_of_it(
        store_path, monkeypatch) -> None:
    """A weekly pass reads the user's facts while forget_fact is under way (here: while it
    reads the notes to delete), and queues its note once the forget returned: the note
    quoted the fact the caller had just forgotten. It is refused, as after a forgotten
    session, and the next pass writes it without the fact."""
    from engine._browse import read_notes

    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await _tell(mem, "s")
        await mem.flush()
        store, maintenance = mem._store, mem._maintenance
        reading, pass_read, forgotten = trio.Event(), trio.Event(), trio.Event()
        real_read = store.read

        async def read(fn, *args):
            out = await real_read(fn, *args)
            if fn is read_notes and not reading.is_set():
                reading.set()
                await pass_read.wait()
            return out

        monkeypatch.setattr(store, "read", read)
        _pause_after_reading(maintenance, monkeypatch, pass_read, forgotten)
        written: list[bool] = []

        async def forget() -> None:
            assert await mem.forget_fact("ana", "constraint", "allergy:peanuts")
            forgotten.set()

        async def reflect() -> None:
            await reading.wait()
            written.append(await maintenance._reflect("ana", T0))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(forget)
            nursery.start_soon(reflect)
        assert written == [False]
        monkeypatch.undo()
        assert (await mem.maintain()).reflections == 1
        (note,) = await mem.list_notes("ana")
        assert "peanut" not in note.text.lower().split("recurring topics")[0]


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
    left after the forget, whether the forget lands after the read or right after the note
    is queued: no note quoting the forgotten facts, no user left."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        for user in ("ana", "bo"):
            await mem.add_turn(user, "s", "user", "I'm allergic to peanuts.")
            await mem.add_turn(user, "s", "user", "I moved to Porto last month.")
            await mem.add_turn(user, "s", "user", "I work as a pharmacist, long shifts.")
        await mem.flush()
        recent, write_note = mem._maintenance._recent, mem._memory._write_note

        async def recent_then_forget(user_id, now):
            found = await recent(user_id, now)
            if user_id == "ana":
                await mem.forget_user(user_id)
            return found

        async def write_note_then_forget(user_id, *args, **kwargs):
            written = await write_note(user_id, *args, **kwargs)
            if user_id == "bo":  # the forget queued once the note is
                await mem.forget_user(user_id)
            return written

        mem._maintenance._recent = recent_then_forget
        mem._memory._write_note = write_note_then_forget
        assert (await mem.maintain()).reflections == 1  # bo's, which bo's forget took
        await mem.flush()
        for user in ("ana", "bo"):
            assert await mem.list_notes(user) == []
        assert await mem.list_users() == []
    assert not any(b"peanuts" in value for rows in raw_databases(store_path).values()
                   for _, value in rows)


async def _facts_of_two_sessions(mem) -> None:
    """Ana's three facts: two from session "private" (one a peanut allergy), one from "other"."""
    await mem.add_turn("ana", "private", "user", "I'm allergic to peanuts.")
    await mem.add_turn("ana", "private", "user", "I moved to Porto last month.")
    await mem.add_turn("ana", "other", "user", "I work as a pharmacist, long shifts.")
    await mem.flush()


async def _reflected_on(mem, clock) -> None:
    """Ana's facts of two sessions, a weekly reflection and a session reflection quoting them."""
    await _facts_of_two_sessions(mem)
    assert (await mem.maintain()).reflections == 1
    assert await mem._maintenance.reflect_on_switch("ana", mem._parts.store.next_lsn)
    notes = await mem.list_notes("ana")
    assert len(notes) == 2 and all("peanuts" in n.text for n in notes)


async def test_forget_session_takes_every_reflection_quoting_it(store_path) -> None:
    """The weekly and the session reflection quote the forgotten session's facts: the forget
    deletes both, so nothing of the session is left in a note, a recall or the store."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await _reflected_on(mem, clock)
        await mem.forget_session("ana", "private")
        await mem.flush()
        assert await mem.list_notes("ana") == []
        assert await mem.recall("ana", "peanuts allergic", tags=["reflection"]) == []
    assert not any(b"peanuts" in value for rows in raw_databases(store_path).values()
                   for _, value in rows)


async def test_forget_session_leaves_a_callers_own_note_tagged_reflection(store_path) -> None:
    """Only the reflections the engine wrote go with a forgotten session: a caller's own
    note, tagged "reflection" and written in the same week, stays."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await _reflected_on(mem, clock)
        mine = await mem.store_note("ana", "My reflection: slow down on weekends.",
                                    tags=["reflection"])
        await mem.forget_session("ana", "private")
        await mem.flush()
        assert [n.note_id for n in await mem.list_notes("ana")] == [mine.note_id]


async def test_a_reflection_pass_begun_during_forget_session_writes_nothing_quoting_it(
        store_path, monkeypatch) -> None:
    """A pass that starts after forget_session began and queues its note after the forget
    read the user's notes (the second reader's interleaving: a pass run right before the
    forget's queue) left a weekly note quoting the forgotten session: its note was neither
    among those the forget deletes nor refused. A pass writes no note while a forget of a
    session is under way."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await _facts_of_two_sessions(mem)
        queue = _forget.Forgetting._queue
        passes = []

        async def a_pass_first(self, user_id, session_id, notes=()):
            passes.append((await mem.maintain()).reflections)
            return await queue(self, user_id, session_id, notes)

        monkeypatch.setattr(_forget.Forgetting, "_queue", a_pass_first)
        await mem.forget_session("ana", "private")
        await mem.flush()
        assert passes == [0]
        assert await mem.list_notes("ana") == []
    assert not any(b"peanuts" in value for rows in raw_databases(store_path).values()
                   for _, value in rows)


async def test_a_reflection_read_before_forget_session_is_not_left_after_it(
        store_path) -> None:
    """A reflection pass that read the session's facts before the forget and writes after it
    (weekly and session reflections alike) leaves no note quoting the session."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await _facts_of_two_sessions(mem)
        recent = mem._maintenance._recent

        async def recent_then_forget(user_id, now):
            found = await recent(user_id, now)
            await mem.forget_session(user_id, "private")
            return found

        mem._maintenance._recent = recent_then_forget
        assert (await mem.maintain()).reflections == 0
        assert not await mem._maintenance.reflect_on_switch("ana", mem._parts.store.next_lsn)
        await mem.flush()
        assert await mem.list_notes("ana") == []
    assert not any(b"peanuts" in value for rows in raw_databases(store_path).values()
                   for _, value in rows)


async def test_a_forget_of_nothing_leaves_a_pass_under_way_alone(store_path, monkeypatch) -> None:
    """forget_fact of a key the user has no value for changed nothing a pass read, yet
    counted as a forget: a session reflection being written meanwhile was refused, and lost
    until the next session switch."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await _tell(mem, "s")
        await mem.flush()
        maintenance = mem._maintenance
        read, forgotten = trio.Event(), trio.Event()
        _pause_after_reading(maintenance, monkeypatch, read, forgotten)
        written: list[bool] = []

        async def reflect() -> None:
            written.append(await maintenance._reflect("ana", T0))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reflect)
            await read.wait()
            assert not await mem.forget_fact("ana", "constraint", "no-such-key")
            forgotten.set()
        assert written == [True]
