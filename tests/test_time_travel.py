"""Time travel over facts: profile(as_of=) answers as the store knew it then."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from engine import InvalidInput, NewTurn

from .conftest import T0, open_engine


class ManualClock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self):
        return self.now


async def test_profile_as_of_answers_as_the_store_knew_it_then(store_path) -> None:
    """Lisbon from March, corrected to Porto in May (valid from April, learned late), then
    retracted in June: each moment gets what the store held as true then."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await mem.remember_fact("maya", "identity", "location", "Lisbon",
                                valid_at=T0)                                     # 1 March
        clock.now = T0 + timedelta(days=61)                                      # 1 May
        await mem.remember_fact("maya", "identity", "location", "Porto", confidence=0.95,
                                valid_at=T0 + timedelta(days=31))                # since April
        await mem.remember_fact("maya", "preference", "coffee", "espresso")
        clock.now = T0 + timedelta(days=92)                                      # 1 June
        await mem.forget_fact("maya", "preference", "coffee")

        async def at(days: float) -> set[tuple[str, str]]:
            facts = await mem.profile("maya", as_of=T0 + timedelta(days=days))
            return {(f.key, f.value) for f in facts}

        assert await at(-1) == set()
        assert await at(10) == {("location", "Lisbon")}
        # Mid-April: Porto was true then, but the store only learned it in May.
        assert await at(45) == {("location", "Lisbon")}
        assert await at(70) == {("location", "Porto"), ("coffee", "espresso")}
        assert await at(100) == {("location", "Porto")}
        assert {(f.key, f.value) for f in await mem.profile("maya")} == {("location", "Porto")}
        history = await mem.fact_history("maya", "identity", "location")
        assert [(f.value, f.valid_at, f.invalid_at, f.created_at, f.expired_at)
                for f in history] == [
            ("Lisbon", T0, T0 + timedelta(days=31), T0, T0 + timedelta(days=61)),
            ("Porto", T0 + timedelta(days=31), None, T0 + timedelta(days=61), None)]
        with pytest.raises(InvalidInput, match="as_of"):
            await mem.profile("maya", as_of=datetime(2026, 3, 1))


async def test_a_correction_says_since_when_it_is_true(store_path) -> None:
    """correct_fact takes valid_at as remember_fact does: "I moved to Porto on the 1st of
    April", told in May, retires Lisbon from April, not from the day it was told."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await mem.remember_fact("maya", "identity", "location", "Lisbon", valid_at=T0)
        clock.now = T0 + timedelta(days=61)
        fact = await mem.correct_fact("maya", "identity", "location", "Porto",
                                      valid_at=T0 + timedelta(days=31))
        assert (fact.value, fact.valid_at, fact.confidence) == (
            "Porto", T0 + timedelta(days=31), 1.0)
        history = await mem.fact_history("maya", "identity", "location")
        assert [(f.value, f.invalid_at) for f in history] == [
            ("Lisbon", T0 + timedelta(days=31)), ("Porto", None)]
        with pytest.raises(InvalidInput, match="valid_at"):
            await mem.correct_fact("maya", "identity", "location", "Faro",
                                   valid_at=datetime(2026, 5, 1))
        # The value was right and its date wrong: "Porto since March, not April".
        moved = await mem.correct_fact("maya", "identity", "location", "Porto",
                                       valid_at=T0 + timedelta(days=10))
        assert (moved.value, moved.valid_at) == ("Porto", T0 + timedelta(days=10))
        assert [(f.value, f.valid_at) for f in await mem.profile("maya")] == [
            ("Porto", T0 + timedelta(days=10))]
        # The same value and no date: nothing to correct, the fact is reinforced.
        same = await mem.correct_fact("maya", "identity", "location", "Porto")
        assert same.fact_id == moved.fact_id


def _day(n: float) -> datetime:
    return T0 + timedelta(days=n)


async def _plan_changed_on(mem, clock: ManualClock, changed: int) -> None:
    """Lisbon from day 0; on day 10, "I move to Porto on day 40"; on day ``changed``, "no:
    Faro, from day 20"."""
    await mem.remember_fact("maya", "identity", "location", "Lisbon", valid_at=_day(0))
    clock.now = _day(10)
    await mem.remember_fact("maya", "identity", "location", "Porto", valid_at=_day(40))
    clock.now = _day(changed)
    await mem.correct_fact("maya", "identity", "location", "Faro", valid_at=_day(20))


async def _places(mem, *days: float) -> list[list[str]]:
    return [sorted(f.value for f in await mem.profile("maya", as_of=_day(n))) for n in days]


async def test_a_plan_changed_before_its_day_leaves_one_value_in_force(store_path) -> None:
    """Changed on day 12: Lisbon was left true until day 40 (Porto's date) and Faro
    superseded only Porto, so between day 20 and 40 the store held two places for one key.
    Now Lisbon is true until Faro's date, and what the store knew before day 12 is kept."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await _plan_changed_on(mem, clock, 12)
        # Day 11 as known then: Porto was still to come.
        assert await _places(mem, 11, 15, 25, 45) == [
            ["Lisbon"], ["Lisbon"], ["Faro"], ["Faro"]]
        history = await mem.fact_history("maya", "identity", "location")
        assert [(f.value, f.invalid_at) for f in history] == [
            ("Lisbon", _day(20)), ("Porto", _day(20)), ("Faro", None)]


async def test_a_plan_changed_after_the_new_date_keeps_what_was_known_before(
        store_path) -> None:
    """Changed on day 30, back to day 20: until day 30 the store held Lisbon, and an as_of
    before it still says so; from day 30 on, Faro alone."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await _plan_changed_on(mem, clock, 30)
        assert await _places(mem, 25, 29, 31, 45) == [
            ["Lisbon"], ["Lisbon"], ["Faro"], ["Faro"]]
        hits = await mem.recall("maya", "location Lisbon", kinds=["fact"], as_of=_day(25))
        assert [h.text for h in hits] == ["location: Lisbon"]


async def test_a_plan_changed_after_its_day_or_past_other_versions_keeps_every_past_view(
        store_path) -> None:
    """What the store knew before a re-plan stays what an as_of before it answers: changed
    after both dates (Porto was in force from day 40 to the change on day 50), past a
    version retracted before it, past one superseded by another before it; and the key's
    versions spelt another way ("Location") are capped like the rest."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await _plan_changed_on(mem, clock, 50)
        assert await _places(mem, 25, 41, 49, 51) == [
            ["Lisbon"], ["Porto"], ["Porto"], ["Faro"]]
    for case, (before, views) in {
            "retracted": ("forget", {4: ["Lisbon"], 6: [], 11: [], 13: ["Faro"]}),
            "superseded": ("Madrid", {4: ["Lisbon"], 6: ["Madrid"], 11: ["Madrid"],
                                      13: ["Faro"]}),
            "spelt": ("Location", {11: ["Lisbon"], 15: ["Lisbon"], 25: ["Faro"]})}.items():
        clock = ManualClock()
        async with open_engine(store_path.parent / case, clock=clock) as mem:
            key = "Location" if before == "Location" else "location"
            await mem.remember_fact("maya", "identity", key, "Lisbon", valid_at=_day(0))
            clock.now = _day(5)
            if before == "forget":
                await mem.forget_fact("maya", "identity", "location")
            elif before == "Madrid":
                await mem.remember_fact("maya", "identity", "location", "Madrid")
            clock.now = _day(10)
            await mem.remember_fact("maya", "identity", "location", "Porto", valid_at=_day(40))
            clock.now = _day(12)
            await mem.correct_fact("maya", "identity", "location", "Faro",
                                   valid_at=_day(3 if before != "Location" else 20))
            assert await _places(mem, *views) == list(views.values()), case


async def test_a_contradiction_moved_earlier_ends_what_it_contradicted_then(
        store_path) -> None:
    """"No longer likes jazz" from day 40 (a key of its own) holds "likes jazz" until then;
    corrected on day 12 to day 20, it ends "likes jazz" on day 20 too, or both were true from
    day 20 to 40. What the store knew before day 12 stays."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await mem.remember_fact("maya", "preference", "jazz", "yes", text="likes jazz",
                                valid_at=_day(0))
        clock.now = _day(10)
        await mem.remember_fact("maya", "preference", "jazz_later", "no",
                                text="no longer likes jazz", valid_at=_day(40))
        clock.now = _day(12)
        await mem.correct_fact("maya", "preference", "jazz_later", "no",
                               text="no longer likes jazz", valid_at=_day(20))
        clock.now = _day(15)
        context = await mem.context_for_prompt("maya", "s9")
        clock.now = _day(30)
        views = [sorted(f.text for f in await mem.profile("maya", as_of=_day(n)))
                 for n in (11, 15, 25, 45)]
    assert views == [["likes jazz"], ["likes jazz"], ["no longer likes jazz"],
                     ["no longer likes jazz"]]
    assert ("- likes jazz (until 2026-03-21 09:00 UTC)\n"
            "- no longer likes jazz (from 2026-03-21 09:00 UTC)\n") in context


async def test_a_plan_forgotten_before_its_day_leaves_the_value_in_force_now(
        store_path) -> None:
    """Lisbon from day 0; on day 10, "I move to Porto on day 40"; on day 12 the plan is
    forgotten. Lisbon had been ended on day 40 only because of the plan, yet every current
    view (profile, recall, prompts) dropped it while profile(as_of=now) still held it. It is
    in force again, as a new version; what the store knew before day 12 stays."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await mem.remember_fact("maya", "identity", "location", "Lisbon", valid_at=_day(0))
        await mem.remember_fact("maya", "preference", "jazz", "yes", text="likes jazz",
                                valid_at=_day(0))
        clock.now = _day(10)
        await mem.remember_fact("maya", "identity", "location", "Porto", valid_at=_day(40))
        await mem.remember_fact("maya", "preference", "jazz_later", "no",
                                text="no longer likes jazz", valid_at=_day(40))
        clock.now = _day(12)
        assert await mem.forget_fact("maya", "identity", "location")
        assert await mem.forget_fact("maya", "preference", "jazz_later")
        await mem.flush()
        clock.now = _day(14)
        assert sorted(f.text for f in await mem.profile("maya")) == [
            "likes jazz", "location: Lisbon"]
        assert [[f.value for f in await mem.profile("maya", category="identity", as_of=_day(n))]
                for n in (5, 11, 13, 45)] == [["Lisbon"]] * 4
        assert [h.text for h in await mem.recall("maya", "location", kinds=["fact"])] == [
            "location: Lisbon"]
        context = await mem.context_for_prompt("maya", "s9")
        assert "- location: Lisbon\n" in context and "Porto" not in context
        assert "- likes jazz\n" in context and "no longer" not in context
        history = await mem.fact_history("maya", "identity", "location")
        assert [(f.value, f.status, f.invalid_at) for f in history] == [
            ("Lisbon", "superseded", _day(12)), ("Porto", "retracted", _day(12)),
            ("Lisbon", "active", None)]
        assert await mem.forget_fact("maya", "identity", "location")  # now Lisbon goes
        assert [[f.value for f in await mem.profile("maya", category="identity", as_of=_day(n))]
                for n in (13, 20)] == [["Lisbon"], []]


async def test_a_value_forgotten_by_a_clock_behind_its_own_puts_back_no_past_version(
        store_path, tmp_path) -> None:
    """Porto recorded at noon; a clock an hour behind (a step back, or a cluster node behind
    the one that recorded it) back-fills Lisbon from 2020 and Faro from 2024, then forgets the
    key. Porto, in force when recorded, was taken for a plan not yet due, and both past
    versions it ended came back active: two values of one key, which a correction did not
    clear and the user's own export then failed to import. The forget ends the key."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await mem.remember_fact("u", "identity", "city", "Porto")
        clock.now = T0 - timedelta(hours=1)
        await mem.remember_fact("u", "identity", "city", "Lisbon", valid_at=_day(-2250))
        await mem.remember_fact("u", "identity", "city", "Faro", valid_at=_day(-800))
        assert await mem.forget_fact("u", "identity", "city")
        assert [f.value for f in await mem.fact_history("u", "identity", "city")
                if f.status == "active"] == []
        await mem.correct_fact("u", "identity", "city", "Braga")
        assert [f.value for f in await mem.profile("u")] == ["Braga"]
        await mem.export_user("u", tmp_path / "u.jsonl")
    async with open_engine(tmp_path / "copy") as copy:
        await copy.import_user(tmp_path / "u.jsonl")
        assert [f.value for f in await copy.profile("u")] == ["Braga"]


async def test_a_forgotten_plan_puts_back_one_value_of_its_key(store_path) -> None:
    """Lisbon from day 0; on day 10, Porto planned from day 40; a clock run ahead to day 50
    back-fills Faro from day 5 (a past version ended where Porto begins, as Lisbon is), then
    comes back to day 12 and the plan is forgotten: both came back active. Only the last in
    force before the plan does."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await mem.remember_fact("u", "identity", "city", "Lisbon", valid_at=_day(0))
        clock.now = _day(10)
        await mem.remember_fact("u", "identity", "city", "Porto", valid_at=_day(40))
        clock.now = _day(50)
        await mem.remember_fact("u", "identity", "city", "Faro", valid_at=_day(5))
        clock.now = _day(12)
        assert await mem.forget_fact("u", "identity", "city")
        assert [f.value for f in await mem.fact_history("u", "identity", "city")
                if f.status == "active"] == ["Faro"]


async def test_a_forgotten_plan_puts_back_nothing_a_newer_value_replaced(store_path) -> None:
    """"No longer likes jazz" from day 40 ended "likes jazz" (another key); on day 11 the
    user said "adores jazz" under that key. Forgetting the plan put "likes jazz" back beside
    it: two active versions of one key. A key with a value of its own keeps it."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await mem.remember_fact("maya", "preference", "jazz", "yes", text="likes jazz")
        clock.now = _day(10)
        await mem.remember_fact("maya", "preference", "jazz_later", "no",
                                text="no longer likes jazz", valid_at=_day(40))
        clock.now = _day(11)
        await mem.remember_fact("maya", "preference", "jazz", "very much",
                                text="adores jazz")
        clock.now = _day(12)
        assert await mem.forget_fact("maya", "preference", "jazz_later")
        history = await mem.fact_history("maya", "preference", "jazz")
        assert [(f.text, f.status) for f in history] == [
            ("likes jazz", "superseded"), ("adores jazz", "active")]
        assert [f.text for f in await mem.profile("maya")] == ["adores jazz"]


async def test_a_value_stated_as_true_from_before_the_active_one_goes_into_history(
        store_path) -> None:
    """"I live in Lisbon" today, then a back-filled turn from a year ago: "I live in Berlin".
    The older statement replaced today's value, which history then showed as never in force
    (ending a year before it began). It is a past version now, true until Lisbon's date, and
    Lisbon stays active; a correction still replaces it, whatever its date."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await mem.add_turn("ana", "today", "user", "I live in Lisbon.")
        await mem.flush()
        await mem.add_turn("ana", "old", "user", "I live in Berlin.", at=_day(-365))
        await mem.flush()
        await mem.remember_fact("ana", "work", "job", "baker")
        remembered = await mem.remember_fact("ana", "work", "job", "nurse", valid_at=_day(-30))
        assert remembered.status == "superseded" and remembered.invalid_at == _day(0)
        assert sorted(f.value for f in await mem.profile("ana")) == ["Lisbon", "baker"]
        history = await mem.fact_history("ana", "identity", "location")
        assert [(f.value, f.status, f.valid_at, f.invalid_at) for f in history] == [
            ("Lisbon", "active", _day(0), None),
            ("Berlin", "superseded", _day(-365), _day(0))]
        clock.now = _day(1)
        assert [f.value for f in await mem.profile("ana", category="identity",
                                                    as_of=_day(1))] == ["Lisbon"]
        assert [h.text for h in await mem.recall("ana", "where does she live",
                                                 kinds=["fact"], category="identity")] == [
            "Lives in Lisbon"]
        await mem.correct_fact("ana", "work", "job", "nurse", valid_at=_day(-30))
        assert sorted(f.value for f in await mem.profile("ana")) == ["Lisbon", "nurse"]


async def test_a_cluster_node_keeps_a_back_filled_value_in_history_too(store_path) -> None:
    """A cluster node decides a turn's facts at the turn's own time (every node the same):
    for a back-filled turn that time is a year back, before the value in force began, and
    the node took that value for a plan and let the older statement replace it, where one
    engine alone kept it. Both keep it now."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        mem._parts.time_by_log()
        await mem.add_turn("ana", "today", "user", "I live in Lisbon.")
        await mem.flush()
        await mem.add_turn("ana", "old", "user", "I live in Berlin.", at=_day(-365))
        await mem.flush()
        assert [f.value for f in await mem.profile("ana")] == ["Lisbon"]


async def test_recall_as_of_answers_as_the_store_knew_it_then(store_path) -> None:
    """recall(as_of=) sees, on both of a fact's time axes, the version held as true then (a
    retired one included), no fact not yet in force, and no turn, note, episode or link made
    later."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await mem.add_turn("maya", "s1", "user", "Training for the Lisbon marathon in spring",
                           at=T0)
        await mem.add_turn("maya", "s1", "assistant", "Good luck with the training!", at=T0)
        await mem.remember_fact("maya", "identity", "location", "Lisbon", valid_at=T0)
        # Recorded on 1 March, in force from 1 April only.
        await mem.remember_fact("maya", "work", "employer", "Acme Lisbon",
                                valid_at=T0 + timedelta(days=31))
        clock.now = T0 + timedelta(days=61)                                      # 1 May
        await mem.correct_fact("maya", "identity", "location", "Porto Lisbon")
        await mem.add_turn("maya", "s2", "user", "The Lisbon marathon went well",
                           at=clock.now)
        await mem.store_note("maya", "Maya's Lisbon cafe is Fabrica")
        clock.now = T0 + timedelta(days=70)
        assert await mem.close_session("maya", "s1")  # an episode of March's turn, made now
        await mem.flush()

        async def found(days: float, **kwargs) -> set[str]:
            hits = await mem.recall("maya", "Lisbon", limit=20, as_of=T0 + timedelta(days=days),
                                    **kwargs)
            return {h.text for h in hits}

        march = await found(10)
        assert "Training for the Lisbon marathon in spring" in march
        assert any("Lisbon" in t and "Porto" not in t for t in await found(10, kinds=["fact"]))
        assert not any("Porto" in t or "Acme" in t for t in march)
        assert not any("went well" in t or "Fabrica" in t for t in march)
        assert not await found(10, kinds=["episode"])
        april = await found(40, kinds=["fact"])
        assert any("Acme" in t for t in april) and not any("Porto" in t for t in april)
        may = await found(65)
        assert "The Lisbon marathon went well" in may and "Maya's Lisbon cafe is Fabrica" in may
        assert any("Porto" in t for t in may)
        assert not await found(65, kinds=["episode"])
        assert await found(75, kinds=["episode"])
        now = {h.text for h in await mem.recall("maya", "Lisbon", limit=20, kinds=["fact"])}
        assert any("Porto" in t for t in now)
        with pytest.raises(InvalidInput, match="as_of"):
            await mem.recall("maya", "Lisbon", as_of=datetime(2026, 3, 1))


async def test_recall_as_of_filters_inside_the_legs_not_after_their_limit(store_path) -> None:
    """One early turn among 150 later ones that match the query better: with as_of before the
    later ones, the early turn comes back (a filter after each leg's 100 candidates would
    leave nothing)."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await mem.add_turn("maya", "s1", "user", "a note about the marathon", at=T0)
        await mem.add_turns([NewTurn(user_id="maya", session_id="s2", role="user",
                                     text=f"marathon marathon training plan {i}",
                                     at=T0 + timedelta(days=5, minutes=i))
                             for i in range(150)])
        await mem.flush()
        for legs in (["bm25"], ["vector"], None):
            hits = await mem.recall("maya", "marathon training", limit=1, kinds=["turn"],
                                    legs=legs, as_of=T0 + timedelta(days=1))
            assert [h.text for h in hits] == ["a note about the marathon"], legs


async def test_recall_as_of_over_http_and_the_search_memory_tool(store_path) -> None:
    """The HTTP recall body and the search_memory tool take as_of as an ISO time; a time
    without a zone is refused naming the argument."""
    import httpx

    from engine._server import create_app

    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await mem.add_turn("maya", "s1", "user", "I adopted a cat called Pixel", at=T0)
        await mem.add_turn("maya", "s1", "user", "Pixel the cat learned to fetch",
                           at=T0 + timedelta(days=3))
        await mem.flush()
        early = (T0 + timedelta(days=1)).isoformat()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(mem)),
                                     base_url="http://127.0.0.1") as http:
            body = {"query": "Pixel cat", "as_of": early}
            hits = (await http.post("/v1/users/maya/recall", json=body)).json()["hits"]
            assert [h["text"] for h in hits] == ["I adopted a cat called Pixel"]
            naive = await http.post("/v1/users/maya/recall",
                                    json={"query": "Pixel", "as_of": "2026-03-02T09:00:00"})
            assert naive.status_code == 422 and "as_of" in naive.text
        found = await mem.call_tool("search_memory", {"user_id": "maya", "query": "Pixel cat",
                                                      "as_of": early})
        assert [h["text"] for h in found["results"]] == ["I adopted a cat called Pixel"]
        with pytest.raises(InvalidInput, match="as_of"):
            await mem.call_tool("search_memory", {"user_id": "maya", "query": "Pixel",
                                                  "as_of": "last tuesday"})
