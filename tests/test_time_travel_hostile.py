"""Time travel under attack: every boundary instant of a fact's two time axes, in every
reading path (profile, recall, history), and the arguments a caller can get wrong."""

from __future__ import annotations

from datetime import date, datetime, timedelta, timezone

import pytest

from engine import InvalidInput

from .conftest import T0, open_engine

US = timedelta(microseconds=1)


class ManualClock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


def rule(f, when: datetime) -> bool:
    """Recorded by then and in force then, on what the store knew then: until it is retired
    a version is in force from valid_at on; once retired, until its invalid_at."""
    return (f.created_at <= when and f.valid_at <= when
            and (f.expired_at is None or f.expired_at > when or f.invalid_at > when))


async def agree(mem, user: str, when: datetime, legs_alone: bool = True) -> set[str]:
    """The fact values held as true at ``when``: the same from profile and from recall (and
    from its bm25 and vector legs alone, once the indexes have caught up), and what the rule
    gives over every version."""
    versions = await mem.fact_versions(user)
    expected = {f.value for f in versions if rule(f, when)}
    shown = {f.value for f in await mem.profile(user, as_of=when)}
    assert shown == expected, (when, shown, expected)
    for legs in (None, ["bm25"], ["vector"]) if legs_alone else (None,):
        hits = await mem.recall(user, "home", limit=50, kinds=["fact"], legs=legs,
                                as_of=when)
        found = [h.text.removeprefix("home: ") for h in hits]
        assert len(found) == len(set(found)), (when, legs, found)
        if legs == ["vector"]:
            # The fake embedder's hashes can cancel a word ("home18" against "home"): the
            # relevance floor then drops that version from the vector leg alone.
            assert set(found) <= expected, (when, legs, found, expected)
        else:
            assert set(found) == expected, (when, legs, found, expected)
    return expected


async def test_every_boundary_of_a_supersede_chain_agrees_in_profile_and_recall(store_path
                                                                                ) -> None:
    """remember, correct (valid from the past), forget, remember again (valid from the
    future), confirm, a refused weaker value: at each recorded instant and a microsecond
    either side, profile and recall give what the rule gives."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        clock.now = T0 + timedelta(days=1, microseconds=7)
        await mem.remember_fact("maya", "identity", "home", "Lisbon", valid_at=T0)
        clock.now = T0 + timedelta(days=5, microseconds=3)
        await mem.correct_fact("maya", "identity", "home", "Porto")
        clock.now = T0 + timedelta(days=9)
        await mem.forget_fact("maya", "identity", "home")
        clock.now = T0 + timedelta(days=12)
        await mem.remember_fact("maya", "identity", "home", "Faro",
                                valid_at=T0 + timedelta(days=15))
        clock.now = T0 + timedelta(days=13)
        await mem.confirm_fact("maya", "identity", "home")
        with pytest.raises(InvalidInput, match="confidence"):
            await mem.remember_fact("maya", "identity", "home", "Braga", confidence=0.5)
        await mem.flush()
        instants = set()
        for f in await mem.fact_versions("maya"):
            instants.update(t for t in (f.created_at, f.valid_at, f.invalid_at, f.expired_at)
                            if t is not None)
        seen = []
        for t in sorted(instants):
            for when in (t - US, t, t + US):
                seen.append(await agree(mem, "maya", when))
        assert {"Lisbon"} in seen and {"Porto"} in seen and {"Faro"} in seen and set() in seen
        assert await agree(mem, "maya", datetime(1700, 1, 1, tzinfo=timezone.utc)) == set()
        assert await agree(mem, "maya", datetime(2199, 12, 31, tzinfo=timezone.utc)) == {
            "Faro"}


async def test_two_versions_recorded_in_one_microsecond(store_path) -> None:
    """A value and its correction recorded at one instant: at that instant only the
    correction is held; history keeps both, in order."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await mem.remember_fact("maya", "identity", "home", "Lisbon")
        await mem.correct_fact("maya", "identity", "home", "Porto")
        await mem.flush()
        assert await agree(mem, "maya", T0) == {"Porto"}
        assert await agree(mem, "maya", T0 - US) == set()
        history = await mem.fact_history("maya", "identity", "home")
        assert [f.value for f in history] == ["Lisbon", "Porto"]


async def test_as_of_in_another_zone_is_the_same_instant(store_path) -> None:
    """An as_of in UTC+5 names the instant it names, in profile and in recall."""
    clock = ManualClock()
    plus5 = timezone(timedelta(hours=5))
    async with open_engine(store_path, clock=clock) as mem:
        await mem.remember_fact("maya", "identity", "home", "Lisbon")
        clock.now = T0 + timedelta(hours=2)
        await mem.correct_fact("maya", "identity", "home", "Porto")
        await mem.flush()
        assert await agree(mem, "maya", (T0 + timedelta(hours=1)).astimezone(plus5)) == {
            "Lisbon"}
        assert await agree(mem, "maya", (T0 + timedelta(hours=2)).astimezone(plus5)) == {
            "Porto"}


async def test_recall_as_of_a_datetime_subclass_is_read_as_its_instant(store_path) -> None:
    """A datetime subclass (pandas', pendulum's) as as_of answers as the plain datetime of
    the same instant does."""

    class Stamp(datetime):
        pass

    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await mem.remember_fact("maya", "identity", "home", "Lisbon")
        clock.now = T0 + timedelta(hours=2)
        await mem.correct_fact("maya", "identity", "home", "Porto")
        await mem.flush()
        when = T0 + timedelta(hours=1)
        stamp = Stamp(when.year, when.month, when.day, when.hour, tzinfo=timezone.utc)
        hits = await mem.recall("maya", "home", kinds=["fact"], as_of=stamp)
        assert [h.text for h in hits] == ["home: Lisbon"]
        assert [f.value for f in await mem.profile("maya", as_of=stamp)] == ["Lisbon"]


async def test_recall_as_of_with_since_until_and_session(store_path) -> None:
    """as_of narrows since/until, never widens them; an as_of before since is an empty
    answer, not an error; a session filter keeps out user-level facts then as now."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await mem.remember_fact("maya", "identity", "home", "Lisbon")
        clock.now = T0 + timedelta(days=2)
        await mem.correct_fact("maya", "identity", "home", "Porto")
        await mem.flush()

        async def found(**kwargs) -> list[str]:
            hits = await mem.recall("maya", "home", kinds=["fact"], **kwargs)
            return [h.text for h in hits]

        day = timedelta(days=1)
        assert await found(as_of=T0 + day, since=T0) == ["home: Lisbon"]
        assert await found(as_of=T0 + day, since=T0 + US) == []
        assert await found(as_of=T0 + day, since=T0 + 3 * day) == []
        assert await found(as_of=T0 + 3 * day, until=T0 + day) == []
        assert await found(as_of=T0 + 3 * day, until=T0 + 2 * day) == ["home: Porto"]
        assert await found(as_of=T0 + day, session_id="s1") == []
        # focus 0's hour reaches back from as_of, not from now.
        assert await found(as_of=T0 + timedelta(minutes=30), focus=0) == ["home: Lisbon"]
        assert await found(as_of=T0 + day, focus=0) == []


async def test_as_of_before_a_forget_brings_nothing_back(store_path) -> None:
    """forget_user and forget_session are forgotten at every as_of, the past included."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await mem.add_turn("maya", "s1", "user", "my home is in Lisbon now", at=T0)
        await mem.remember_fact("maya", "identity", "home", "Lisbon")
        clock.now = T0 + timedelta(days=1)
        await mem.correct_fact("maya", "identity", "home", "Porto")
        await mem.add_turn("ana", "s9", "user", "my home is in Faro", at=T0)
        await mem.remember_fact("ana", "identity", "home", "Faro")
        await mem.flush()
        clock.now = T0 + timedelta(days=2)
        await mem.forget_session("ana", "s9")
        await mem.forget_user("maya")
        await mem.flush()
        for when in (T0, T0 + timedelta(hours=1), T0 + timedelta(days=1)):
            assert await mem.profile("maya", as_of=when) == []
            assert list(await mem.recall("maya", "home Lisbon", as_of=when)) == []
            hits = await mem.recall("ana", "home Faro", as_of=when)
            assert all(h.kind == "fact" for h in hits), hits
        assert await mem.fact_history("maya", "identity", "home") == []
        assert await mem.fact_versions("maya") == []


async def test_a_pruned_fact_is_held_before_its_pruning_and_not_after(store_path) -> None:
    """Maintenance retires a faded fact as pruned: as_of before that still holds it, in
    profile and recall alike; as_of after does not."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        # Maintenance goes over the users with turns in the RAM windows.
        await mem.add_turn("maya", "s1", "user", "hello there", at=T0)
        await mem.remember_fact("maya", "schedule", "home", "gym on Mondays",
                                confidence=0.5)
        clock.now = T0 + timedelta(days=400)
        await mem.maintain()
        await mem.flush()
        [version] = await mem.fact_versions("maya")
        assert version.status == "pruned"
        assert await mem.profile("maya") == []
        pruned = version.expired_at
        assert await agree(mem, "maya", pruned - US) == {"gym on Mondays"}
        assert await agree(mem, "maya", pruned) == set()


@pytest.mark.parametrize("as_of", [
    datetime(2026, 3, 1),  # naive
    date(2026, 3, 1),
    "2026-03-01T00:00:00+00:00",
    1772323200,
    datetime(1600, 1, 1, tzinfo=timezone.utc),
    datetime(2300, 1, 1, tzinfo=timezone.utc),
])
async def test_bad_as_of_is_refused_naming_it(store_path, as_of) -> None:
    """A naive datetime, a date, a string, a number, or a time outside the store's range is
    InvalidInput naming as_of, in profile and in recall."""
    async with open_engine(store_path, clock=ManualClock()) as mem:
        with pytest.raises(InvalidInput, match="as_of") as caught:
            await mem.profile("maya", as_of=as_of)
        assert caught.value.field == "as_of"
        with pytest.raises(InvalidInput, match="as_of") as caught:
            await mem.recall("maya", "home", as_of=as_of)
        assert caught.value.field == "as_of"


async def test_as_of_before_the_indexes_catch_up(store_path) -> None:
    """Without a flush (the indexes may still hold a retired version, or not yet the new
    one), a recall as_of gives each version once, as profile does."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        for i, city in enumerate(["Lisbon", "Porto", "Faro", "Braga"]):
            clock.now = T0 + timedelta(hours=i)
            await mem.correct_fact("maya", "identity", "home", city)
            for j in range(i + 1):
                hits = await mem.recall("maya", "home", limit=50, kinds=["fact"],
                                        as_of=T0 + timedelta(hours=j, minutes=1))
                assert [h.text for h in hits] == [f"home: {['Lisbon', 'Porto', 'Faro'][j]}"
                                                  if j < 3 else "home: Braga"], (i, j)


@pytest.mark.parametrize("legs", [["bm25"], ["vector"], ["window"], None])
async def test_a_retired_version_is_found_by_each_leg(store_path, legs) -> None:
    """A version retired since as_of left the indexes; each search leg still finds it as
    of then, once, with the version held now kept out."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await mem.remember_fact("maya", "identity", "home", "Lisbon")
        clock.now = T0 + timedelta(days=1)
        await mem.correct_fact("maya", "identity", "home", "Porto")
        await mem.flush()
        hits = await mem.recall("maya", "home Lisbon", kinds=["fact"], legs=legs,
                                as_of=T0 + timedelta(hours=1))
        assert [h.text for h in hits] == ["home: Lisbon"]


async def test_links_as_of_never_reach_a_later_version(store_path) -> None:
    """Link expansion as_of: a turn's derived fact, and the supersedes link of a later
    version, bring nothing the store did not hold then."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await mem.add_turn("maya", "s1", "user", "I live in Lisbon", at=T0)
        await mem.flush()
        clock.now = T0 + timedelta(days=1)
        await mem.correct_fact("maya", "identity", "location", "Porto")
        await mem.flush()
        for when in (T0 + timedelta(hours=1), T0 + timedelta(days=2)):
            hits = await mem.recall("maya", "Lisbon Porto", limit=20, link_depth=3,
                                    as_of=when)
            held = {f.fact_id for f in await mem.profile("maya", as_of=when)}
            facts = {h.id for h in hits if h.kind == "fact"}
            assert facts <= held, (when, [(h.kind, h.text, h.via) for h in hits], held)


async def test_a_value_superseded_from_a_later_date_holds_until_then(store_path) -> None:
    """On 11 March the store learns Maya moves to Faro on 20 March: from then on it holds
    Lisbon as true until the 20th, so as_of the 15th (as the store knew it then, and as it
    knows it now) is Lisbon, in profile and recall alike, not nothing."""
    clock = ManualClock()
    day = timedelta(days=1)
    async with open_engine(store_path, clock=clock) as mem:
        await mem.remember_fact("maya", "identity", "home", "Lisbon")
        clock.now = T0 + 10 * day
        await mem.remember_fact("maya", "identity", "home", "Faro", valid_at=T0 + 19 * day)
        clock.now = T0 + 25 * day
        await mem.flush()
        assert await agree(mem, "maya", T0 + 9 * day) == {"Lisbon"}
        assert await agree(mem, "maya", T0 + 10 * day) == {"Lisbon"}
        assert await agree(mem, "maya", T0 + 14 * day) == {"Lisbon"}
        assert await agree(mem, "maya", T0 + 19 * day - US) == {"Lisbon"}
        assert await agree(mem, "maya", T0 + 19 * day) == {"Faro"}


@pytest.mark.parametrize("flush", [True, False])
@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_random_chains_agree_at_every_boundary(store_path, seed, flush) -> None:
    """Seeded random remembers (valid from the past or the future, some weaker and
    refused), corrections, confirms and forgets over three keys, some in one microsecond:
    at every recorded instant and a microsecond either side, profile and recall agree with
    the rule, whether or not the indexes have caught up."""
    import random

    print("seed", seed)
    rng = random.Random(seed)
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        for i in range(24):
            clock.now += rng.choice([timedelta(0), US, timedelta(hours=rng.randint(1, 48))])
            key = rng.choice(["home", "job", "pet"])
            value = f"{key}{i}"
            op = rng.random()
            try:
                if op < 0.45:
                    shift = timedelta(hours=rng.randint(-72, 72)) * (rng.random() < 0.6)
                    await mem.remember_fact("maya", "identity", key, value,
                                            text=f"home: {value}",
                                            confidence=rng.choice([0.3, 0.6, 0.9]),
                                            valid_at=clock.now + shift)
                elif op < 0.7:
                    await mem.correct_fact("maya", "identity", key, value,
                                           text=f"home: {value}")
                elif op < 0.8:
                    await mem.confirm_fact("maya", "identity", key)
                else:
                    await mem.forget_fact("maya", "identity", key)
            except InvalidInput:
                pass  # refused (weaker) or nothing to confirm: nothing written
        if flush:
            await mem.flush()
        instants = set()
        for f in await mem.fact_versions("maya"):
            instants.update(t for t in (f.created_at, f.valid_at, f.invalid_at, f.expired_at)
                            if t is not None)
        for t in sorted(instants):
            for when in (t - US, t, t + US):
                await agree(mem, "maya", when, legs_alone=flush)


async def test_as_of_across_spellings_of_one_key(store_path) -> None:
    """"Location" and " location" are one key at every as_of: the later spelling supersedes
    the earlier, history lists both, a category filter folds case and spacing then too."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await mem.remember_fact("maya", "Identity", "Location", "Lisbon")
        clock.now = T0 + timedelta(days=1)
        await mem.remember_fact("maya", "identity", " location", "Porto", confidence=0.95)
        await mem.flush()
        for when, value in ((T0, "Lisbon"), (T0 + timedelta(days=1), "Porto")):
            facts = await mem.profile("maya", category=" IDENTITY", as_of=when)
            assert [f.value for f in facts] == [value]
        history = await mem.fact_history("maya", "IDENTITY", "LOCATION ")
        assert [(f.category, f.key, f.status) for f in history] == [
            ("Identity", "Location", "superseded"), ("identity", " location", "active")]


async def test_a_window_across_a_dst_fall_back_hour_is_compared_in_real_time(
        store_path) -> None:
    """In Europe/Lisbon on 2026-10-25, 01:45 (the first, summer one) comes 30 minutes before
    01:15 (fold=1, the winter one). Python compares two times of one zone by their wall
    clocks, fold ignored, so recall refused the window as ending before it began."""
    from zoneinfo import ZoneInfo

    lisbon = ZoneInfo("Europe/Lisbon")
    since = datetime(2026, 10, 25, 1, 45, tzinfo=lisbon)
    until = datetime(2026, 10, 25, 1, 15, tzinfo=lisbon, fold=1)
    at = datetime(2026, 10, 25, 1, 0, tzinfo=timezone.utc)  # between the two
    async with open_engine(store_path) as mem:
        await mem.add_turn("ana", "s", "user", "The night bus to Porto was late.", at=at)
        await mem.flush()
        hits = await mem.recall("ana", "night bus", since=since, until=until)
        assert [h.text for h in hits] == ["The night bus to Porto was late."]
        with pytest.raises(InvalidInput, match="until: expected a time at or after since"):
            await mem.recall("ana", "night bus", since=until, until=since)


@pytest.mark.parametrize("year", [1969, 1971])
async def test_the_keyword_leg_finds_a_turn_before_1970_at_its_own_time(store_path,
                                                                         year) -> None:
    """A turn of 1969-03-01 12:00:00.25 (dates from 1700 are taken) was indexed a second
    late: tantivy cuts a time to its second toward zero, which before 1970 is later. The
    keyword leg then missed it for until= or as_of= at its own time (the vector leg found
    it, as did both after 1970). The index is given the whole second, cut down, itself."""
    at = datetime(year, 3, 1, 12, 0, 0, 250000, tzinfo=timezone.utc)
    async with open_engine(store_path, config={"long_term": False}) as mem:
        await mem.add_turn("u", "s", "user", "zebra crossing", at=at)
        await mem.flush()
        for bound in ("until", "as_of"):
            for later in (0, 500_000):
                hits = await mem.recall("u", "zebra", legs=("bm25",),
                                        **{bound: at + timedelta(microseconds=later)})
                assert [h.text for h in hits] == ["zebra crossing"], (bound, later)
        assert await mem.recall("u", "zebra", legs=("bm25",),
                                until=at - timedelta(microseconds=1)) == []


async def test_a_statement_after_the_clock_stepped_back_is_the_value_in_force(
        store_path) -> None:
    """An NTP step of 1 ms back between two statements filed the newer one as a past version
    (its time was before the value in force began): the profile kept the older value. A
    statement given no date while the clock reads less than a minute before the value in
    force is the later one, as the log has it; a date the caller gave is kept."""
    now = [datetime(2026, 1, 1, 12, tzinfo=timezone.utc)]
    async with open_engine(store_path, clock=lambda: now[0]) as mem:
        await mem.remember_fact("u", "identity", "city", "Berlin")
        now[0] -= timedelta(milliseconds=1)  # the clock steps back
        porto = await mem.remember_fact("u", "identity", "city", "Porto")
        assert porto.status == "active"
        assert {f.key: f.value for f in await mem.profile("u")}["city"] == "Porto"
        history = await mem.fact_history("u", "identity", "city")
        assert [(f.value, f.status) for f in history] == [("Berlin", "superseded"),
                                                            ("Porto", "active")]
        assert history[0].invalid_at == history[1].valid_at > history[0].valid_at
        dated = await mem.remember_fact("u", "identity", "job", "baker", valid_at=now[0])
        await mem.remember_fact("u", "identity", "job", "nurse",
                                valid_at=now[0] - timedelta(seconds=30))
        jobs = await mem.fact_history("u", "identity", "job")
        assert [f.valid_at for f in jobs if f.value == "nurse"] == [
            now[0] - timedelta(seconds=30)]  # a date given is kept as given
        assert dated.status == "active"


async def test_a_clock_that_raises_is_clock_failed_for_writes_and_at_open_too(
        store_path) -> None:
    """recall, remember_fact and the rest raised ClockFailed (field ``clock``) as promised;
    add_turn, add_turns, add_turn_nowait and Engine.open let the clock's own exception out."""
    from engine import ClockFailed, Engine, HashEmbedder

    broken = [False]

    def clock() -> datetime:
        if broken[0]:
            raise RuntimeError("the time daemon restarts")
        return datetime(2026, 1, 1, tzinfo=timezone.utc)

    async with open_engine(store_path, clock=clock) as mem:
        broken[0] = True
        for call in (lambda: mem.add_turn("u", "s", "user", "hello"),
                     lambda: mem.add_turns([{"user_id": "u", "session_id": "s",
                                             "role": "user", "text": "hi"}])):
            with pytest.raises(ClockFailed) as failed:
                await call()
            assert failed.value.field == "clock"
        with pytest.raises(ClockFailed):
            mem.add_turn_nowait("u", "s", "user", "hi")
        broken[0] = False
        assert await mem.session_history("u", "s") == []
    with pytest.raises(ClockFailed):
        async with Engine.open(store_path, embedder=HashEmbedder(), clock=lambda: 1 / 0):
            pass
