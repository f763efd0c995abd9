"""What a prompt is given about a user: the semantic section's source counts, and the context
for a new session (seed 004's injection, in seed 002's shape)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from engine import InvalidInput

from .conftest import T0, open_engine
from .test_time_travel import ManualClock


async def test_sources_count_conversations_not_turns(store_path, clock) -> None:
    """A fact said three times in one session and once in another comes from 2
    conversations, not 4 (seed 001's "(sources: N conversations)")."""
    async with open_engine(store_path, clock=clock) as mem:
        for text in ("I love jazz.", "Honestly, I love jazz.", "I really love jazz."):
            await mem.add_turn("maya", "s1", "user", text)
        await mem.add_turn("maya", "s2", "user", "I love jazz, still.")
        await mem.add_turn("maya", "s2", "user", "I'm allergic to peanuts.")
        await mem.flush()
        raw = await mem.retrieve_memory_raw("maya", "jazz music")
        text = await mem.retrieve_memory("maya", "jazz music")
    (jazz,) = [f for f in raw.semantic if f.fact == "Likes jazz"]
    assert len(jazz.source_episodic_ids) == 4 and jazz.conversations == 2
    assert "- [preference] Likes jazz (sources: 2 conversations)" in text
    assert "- [constraint] Allergic to peanuts (sources: 1 conversation)" in text


async def _history(mem) -> None:
    for text in ("I'm moving to Lisbon in January.", "The flat in Alfama has a view.",
                 "Movers come on the 3rd."):
        await mem.add_turn("maya", "s1", "user", text)
    for text in ("My dog Pixel hates the vet.", "Pixel needs his vaccine in March.",
                 "The vet is near the park."):
        await mem.add_turn("maya", "s2", "user", text)
    await mem.add_turn("maya", "s3", "user", "Pixel was sick today, the vet again.")
    await mem.add_turn("maya", "s3", "user", "He is better now, the vet gave him pills.")
    await mem.flush()
    for session in ("s1", "s2", "s3"):
        assert await mem.close_session("maya", session)
    await mem.store_note("maya", "This week: moving plans and Pixel's health.",
                         note_id="reflection-2026-W09", tags=["reflection", "weekly"])
    await mem.flush()


async def test_a_new_session_gets_facts_the_reflection_and_other_sessions(store_path,
                                                                         clock) -> None:
    """Seed 004's injection: standing facts, the latest reflection, and episodes of other
    sessions, the relevant one first; never an episode of the session itself."""
    async with open_engine(store_path, clock=clock) as mem:
        await _history(mem)
        episodes = {e.session_id: e for e in await mem.episodes("maya")}
        text = await mem.context_for_prompt("maya", "s3", budget_tokens=400)
        assert text.startswith("## What I know about you\n- ")
        assert "- Has a dog called Pixel" in text and "- Lives in Lisbon" in text
        assert "## Latest reflection\nThis week: moving plans and Pixel's health." in text
        section = text.split("## From earlier conversations\n")[1]
        assert episodes["s2"].title in section.splitlines()[0]  # about the vet: most relevant
        assert episodes["s1"].title in section
        assert episodes["s3"].title not in section  # this session's own: the prompt has it
        # A session with no turns yet: the most recent episodes of the others.
        fresh = await mem.context_for_prompt("maya", "s4")
        assert episodes["s3"].title in fresh.split("## From earlier conversations\n")[1]
        # An explicit query decides relevance instead.
        moving = await mem.context_for_prompt("maya", "s3", query="moving flat Alfama")
        assert episodes["s1"].title in moving.split("## From earlier conversations\n")[1
                                                                                 ].splitlines()[0]


async def test_the_context_fits_its_budget_in_order_of_priority(store_path, clock) -> None:
    """A small budget keeps the facts and drops what does not fit, line by line; nothing
    known is an empty string; arguments are checked."""
    async with open_engine(store_path, clock=clock) as mem:
        assert await mem.context_for_prompt("maya", "s1") == ""
        await _history(mem)
        full = await mem.context_for_prompt("maya", "s3", budget_tokens=10_000)
        for budget in (12, 30, 60, 120):
            text = await mem.context_for_prompt("maya", "s3", budget_tokens=budget)
            assert (len(text) + 3) // 4 <= budget + 1  # the final newline is not counted
            assert all(line in full.splitlines() for line in text.splitlines())
        small = await mem.context_for_prompt("maya", "s3", budget_tokens=30)
        assert small.startswith("## What I know about you") and "earlier" not in small
        for kwargs, message in (({"budget_tokens": 0}, "budget_tokens: expected an integer"),
                                ({"query": " "}, "query: expected a non-empty string")):
            with pytest.raises(InvalidInput, match=message):
                await mem.context_for_prompt("maya", "s3", **kwargs)


async def test_a_prompt_says_what_is_true_now_and_what_is_due_later(store_path) -> None:
    """On day 10: "I move to Porto on day 40" and "I fly to Japan on day 50". On day 15 a
    prompt still says Lisbon, until Porto's day, and gives Porto and the trip their dates;
    profile() keeps answering the decided values. Once Porto's day has passed, Porto alone."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await mem.remember_fact("maya", "identity", "location", "Lisbon", valid_at=T0)
        await mem.remember_fact("maya", "preference", "drink", "tea")
        clock.now = T0 + timedelta(days=10)
        await mem.remember_fact("maya", "identity", "location", "Porto",
                                valid_at=T0 + timedelta(days=40))
        await mem.remember_fact("maya", "plan", "trip", "Japan",
                                valid_at=T0 + timedelta(days=50))
        clock.now = T0 + timedelta(days=15)
        assert {f.value for f in await mem.profile("maya")} == {"Porto", "Japan", "tea"}
        context = await mem.context_for_prompt("maya", "s9")
        briefing = await mem.retrieve_memory("maya", "my location")
        raw = await mem.retrieve_memory_raw("maya", "my location")
        clock.now = T0 + timedelta(days=41)
        later = await mem.context_for_prompt("maya", "s9")
    assert ("- location: Lisbon (until 2026-04-10 09:00 UTC)\n"
            "- location: Porto (from 2026-04-10 09:00 UTC)\n") in context
    assert "- trip: Japan (from 2026-04-20 09:00 UTC)" in context
    assert "- drink: tea\n" in context
    assert ("] location: Lisbon (until 2026-04-10 09:00 UTC) (sources: 0 conversations)\n"
            "- [identity] location: Porto (from 2026-04-10 09:00 UTC) (sources:") in briefing
    lisbon, porto = sorted((f for f in raw.semantic if f.fact.startswith("location")),
                           key=lambda f: f.valid_at)
    assert (lisbon.fact, lisbon.invalid_at) == ("location: Lisbon", T0 + timedelta(days=40))
    assert (porto.fact, porto.valid_at) == ("location: Porto", T0 + timedelta(days=40))
    assert "Lisbon" not in later and "- location: Porto\n" in later


async def test_each_version_to_come_is_shown_in_turn_and_filtered_alone(store_path) -> None:
    """Lisbon; on day 10 "Porto from day 20", on day 12 "Faro from day 40": on day 15 a prompt
    gives all three in order with their dates. A pair takes one place of semantic_limit, and
    min_importance keeps or drops each version on its own importance."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await mem.remember_fact("maya", "identity", "name", "Maya", importance=0.95)
        await mem.remember_fact("maya", "identity", "location", "Lisbon", valid_at=T0,
                                importance=0.9)
        clock.now = T0 + timedelta(days=10)
        await mem.remember_fact("maya", "identity", "location", "Porto", importance=0.3,
                                valid_at=T0 + timedelta(days=20))
        clock.now = T0 + timedelta(days=12)
        await mem.remember_fact("maya", "identity", "location", "Faro", importance=0.3,
                                valid_at=T0 + timedelta(days=40))
        clock.now = T0 + timedelta(days=15)
        context = await mem.context_for_prompt("maya", "s9")
        one = await mem.retrieve_memory_raw("maya", "location", semantic_limit=1)
        important = await mem.retrieve_memory_raw("maya", "location", min_importance=0.6)
    assert ("- location: Lisbon (until 2026-03-21 09:00 UTC)\n"
            "- location: Porto (from 2026-03-21 09:00 UTC until 2026-04-10 09:00 UTC)\n"
            "- location: Faro (from 2026-04-10 09:00 UTC)\n") in context
    assert [f.fact for f in one.semantic] == [
        "location: Lisbon", "location: Porto", "location: Faro"]
    assert [f.fact for f in important.semantic] == ["location: Lisbon", "name: Maya"]


async def test_a_held_value_goes_with_what_ended_it_not_with_what_shares_its_date(
        store_path) -> None:
    """"No longer likes jazz" from day 40 (another key) holds "likes jazz" until then; a job
    due the same day has nothing to do with Lisbon, whose move was forgotten (Lisbon is in
    force again, with no end); and a new plan after the forgotten one ends Lisbon where it
    starts, not on the forgotten date."""
    clock = ManualClock()
    day = lambda n: T0 + timedelta(days=n)  # noqa: E731
    async with open_engine(store_path, clock=clock) as mem:
        await mem.remember_fact("maya", "identity", "location", "Lisbon", valid_at=T0)
        await mem.remember_fact("maya", "preference", "jazz", "yes", text="likes jazz music")
        clock.now = day(10)
        await mem.remember_fact("maya", "identity", "location", "Porto", valid_at=day(40))
        await mem.remember_fact("maya", "preference", "jazz_from_may", "no",
                                text="no longer likes jazz music", valid_at=day(40))
        await mem.remember_fact("maya", "work", "job", "doctor", valid_at=day(40))
        clock.now = day(12)
        await mem.forget_fact("maya", "identity", "location")
        clock.now = day(15)
        forgotten = await mem.context_for_prompt("maya", "s9")
        await mem.remember_fact("maya", "identity", "location", "Faro", valid_at=day(60))
        planned = await mem.context_for_prompt("maya", "s9")
    assert ("- likes jazz music (until 2026-04-10 09:00 UTC)\n"
            "- no longer likes jazz music (from 2026-04-10 09:00 UTC)\n") in forgotten
    assert "- location: Lisbon\n" in forgotten and "- job: doctor (from" in forgotten
    assert "Lisbon (until" not in forgotten and "Porto" not in forgotten
    assert ("- location: Lisbon (until 2026-04-30 09:00 UTC)\n"
            "- location: Faro (from 2026-04-30 09:00 UTC)\n") in planned


def test_a_time_in_a_prompt_is_a_date_at_midnight_utc_else_names_its_hour_and_zone() -> None:
    from zoneinfo import ZoneInfo

    from engine._briefing import moment

    assert moment(datetime(2026, 4, 10, tzinfo=timezone.utc)) == "2026-04-10"
    assert moment(datetime(2026, 4, 10, 15, 30, tzinfo=timezone.utc)) == "2026-04-10 15:30 UTC"
    lisbon = datetime(2026, 4, 10, tzinfo=ZoneInfo("Europe/Lisbon"))
    assert moment(lisbon) == "2026-04-10 00:00 +01:00"
