"""Facts as the engine serves them: remember/correct/confirm/forget_fact and their argument
checks, profile and fact_history, extraction from add_turn, maintenance's pruning, the facts in
retrieve_memory and recall, and forgetting a session (the actor alone: tests/actors/test_facts.py)."""

from __future__ import annotations

import unicodedata
from datetime import timedelta

import pytest
import trio

from actors.ann_index import Filters
from actors.base.messages import Candidate
from actors.facts import Proposal
from engine import InvalidInput

from .conftest import T0, StepClock, open_engine, raw_databases, text_index_held


class ManualClock:
    """An engine clock that stays put until a test moves it."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self):
        return self.now


class FailingClock(ManualClock):
    """A ManualClock that raises while ``broken`` (a time service restarting, or gone)."""

    broken = False

    def __call__(self):
        if self.broken:
            raise RuntimeError("clock source unavailable")
        return super().__call__()


async def test_a_new_value_supersedes_the_old_one_and_history_keeps_both(store_path) -> None:
    """Moving city: the new location is active, the old one is kept with invalid_at set."""
    clock = StepClock(step=timedelta(days=1))
    async with open_engine(store_path, clock=clock) as mem:
        await mem.add_turn("ana", "s1", "user", "I live in Lisbon, near the old market.")
        await mem.flush()
        await mem.add_turn("ana", "s2", "user", "Big change: I moved to Porto last week.")
        await mem.flush()
        (location,) = [f for f in await mem.profile("ana") if f.key == "location"]
        history = await mem.fact_history("ana", "identity", "location")
    assert location.value == "Porto" and location.status == "active"
    old, new = history
    assert (old.value, old.status, new.value) == ("Lisbon", "superseded", "Porto")
    assert old.invalid_at == new.valid_at and old.expired_at is not None
    assert new.invalid_at is None and new.source_turn_ids and new.origin == "rules"


async def test_a_key_or_value_typed_decomposed_is_the_same_key_or_value(mem) -> None:
    """A key sent decomposed (NFD: 'cafe' then a combining accent, as macOS and some keyboards
    send it) is the key sent composed: the new value supersedes the old one instead of
    standing beside it as a second active fact; the same value so sent reinforces."""
    nfd = unicodedata.normalize("NFD", "café")
    await mem.remember_fact("ana", "preference", "café", "flat white")
    second = await mem.remember_fact("ana", "preference", nfd, "espresso")
    assert [f.value for f in await mem.profile("ana")] == ["espresso"]
    again = await mem.remember_fact("ana", "preference", "café",
                                    unicodedata.normalize("NFD", "espresso"))
    assert again.fact_id == second.fact_id
    assert [f.value for f in await mem.profile("ana")] == ["espresso"]


async def test_values_that_differ_beyond_case_are_different_values(mem) -> None:
    """'Straße 5' corrects 'Strasse 5': full case folding would take them for one value (ß
    folds to ss) and reinforce the old one; values are told apart by case and spacing only."""
    await mem.remember_fact("ana", "home", "street", "Strasse 5")
    fixed = await mem.correct_fact("ana", "home", "street", "Straße 5")
    assert fixed.value == "Straße 5"
    assert [f.value for f in await mem.profile("ana")] == ["Straße 5"]


async def test_a_less_confident_value_does_not_supersede(mem) -> None:
    """Seed 002's rule: a lower-confidence value loses; correct_fact replaces regardless."""
    await mem.remember_fact("ana", "identity", "location", "Lisbon", confidence=0.9)
    with pytest.raises(InvalidInput, match=r"confidence: expected at least the active value's "
                                           r"confidence \(0.90 for 'Lisbon'\), found 0.50; call "
                                           r"correct_fact"):
        await mem.remember_fact("ana", "identity", "location", "Porto", confidence=0.5)
    assert [f.value for f in await mem.profile("ana")] == ["Lisbon"]
    corrected = await mem.correct_fact("ana", "identity", "location", "Porto")
    assert corrected.confidence == 1.0
    assert [f.value for f in await mem.profile("ana")] == ["Porto"]
    assert [f.status for f in await mem.fact_history("ana", "identity", "location")] == [
        "superseded", "active"]


async def test_duplicates_reinforce_instead_of_adding(mem) -> None:
    """The same value again, or a sentence with Jaccard >= 0.75 to an active fact, is one fact."""
    first = await mem.remember_fact("ana", "preference", "coffee", "flat white",
                                    text="Drinks her coffee as a flat white every morning",
                                    confidence=0.6)
    again = await mem.remember_fact("ana", "preference", "coffee", "Flat  White", confidence=0.8)
    near = await mem.remember_fact("ana", "preference", "morning coffee", "flat white",
                                   text="Drinks her coffee as a flat white every single morning")
    assert again.fact_id == first.fact_id == near.fact_id
    assert again.confidence == 0.8 and near.access_count == 2
    assert len(await mem.profile("ana")) == 1


async def test_a_fact_the_caller_names_with_another_key_and_value_is_its_own(mem) -> None:
    """remember_fact of (work, role) = "engineer" after (work, employer) = "Acme", in sentences
    alike (Jaccard >= 0.75), returned the employer fact: the caller's role was never stored
    and a lookup of it found nothing. A near sentence under another key is the same fact only
    when it holds the same value."""
    employer = await mem.remember_fact("ana", "work", "employer", "Acme",
                                       text="Works at Acme as an engineer in the Lisbon office")
    role = await mem.remember_fact("ana", "work", "role", "engineer",
                                   text="Works at Acme as engineer in the Lisbon office")
    assert role.fact_id != employer.fact_id and (role.key, role.value) == ("role", "engineer")
    assert {(f.key, f.value) for f in await mem.profile("ana")} == {
        ("employer", "Acme"), ("role", "engineer")}


async def test_a_contradiction_without_a_shared_key_is_resolved_by_the_same_rule(mem) -> None:
    """'Likes jazz' and 'No longer likes jazz' under different keys: the newer supersedes."""
    await mem.remember_fact("ana", "preference", "music", "jazz", text="Likes jazz music",
                            confidence=0.7)
    await mem.remember_fact("ana", "preference", "music taste", "not jazz",
                            text="No longer likes jazz music", confidence=0.8)
    assert [f.text for f in await mem.profile("ana")] == ["No longer likes jazz music"]
    assert (await mem.fact_history("ana", "preference", "music"))[0].status == "superseded"


async def test_confirmed_facts_never_decay_and_inferred_values_cannot_replace_them(store_path) -> None:
    """A jumped clock prunes an unused fact but not a confirmed one; a rule-extracted value
    does not supersede a confirmed fact."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await mem.remember_fact("ana", "preference", "snack", "crisps", confidence=0.6)
        await mem.remember_fact("ana", "identity", "location", "Lisbon", confidence=0.5)
        confirmed = await mem.confirm_fact("ana", "identity", "location")
        assert confirmed.protected and confirmed.confidence == 1.0
        await mem.add_turn("ana", "s", "user", "I live in Braga now.")
        await mem.flush()
        assert [f.value for f in await mem.profile("ana", category="identity")] == ["Lisbon"]
        clock.now = T0 + timedelta(days=200)  # 0.6 x exp(-0.02 x 200) = 0.011 < 0.05
        report = await mem.maintain()
        assert report.pruned_facts == 1
        assert [(f.key, f.value) for f in await mem.profile("ana")] == [("location", "Lisbon")]
        assert (await mem.fact_history("ana", "preference", "snack"))[0].status == "pruned"
        # The pruned fact is gone from both indexes: nothing matches "crisps snack" well enough
        # to be returned (the relevance floor), and the vector index's only fact is the active one.
        assert await mem.recall("ana", "crisps snack", kinds=["fact"]) == []
        nearest = await mem._ann.search("ana", (await mem.embed(["crisps snack"]))[0], 10,
                                        Filters(kinds=("fact",)))
        assert [lsn for lsn, _ in nearest] == [f.lsn for f in await mem.profile("ana")]


async def test_a_user_with_facts_and_no_turns_decays_too(store_path) -> None:
    """Maintenance pruned only the users the session buffer holds: a user whose facts all
    came through remember_fact (no turn said) kept a faded fact for ever."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await mem.remember_fact("bob", "preference", "snack", "crisps", confidence=0.6)
        await mem.remember_fact("ana", "preference", "snack", "olives", confidence=0.6)
        await mem.add_turn("ana", "s", "user", "hello")
        clock.now = T0 + timedelta(days=200)  # 0.6 x exp(-0.02 x 200) = 0.011 < 0.05
        assert (await mem.maintain()).pruned_facts == 2
        assert await mem.profile("bob") == [] and await mem.profile("ana") == []


async def test_showing_a_fact_restarts_its_decay(store_path) -> None:
    """A fact retrieve_memory showed counts a use: maintenance measures decay from then."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await mem.remember_fact("ana", "preference", "tea", "green tea", text="Likes green tea",
                                confidence=0.6)
        clock.now = T0 + timedelta(days=100)
        await mem.retrieve_memory("ana", "green tea")
        await mem.flush()
        clock.now = T0 + timedelta(days=160)  # 60 days after the use: 0.6 x e^-1.2 = 0.18
        assert (await mem.maintain()).pruned_facts == 0
        (tea,) = await mem.profile("ana")
        assert tea.access_count == 1 and tea.last_access_at == T0 + timedelta(days=100)


async def test_forget_fact_retracts_it_from_recall_and_profile(mem) -> None:
    """A retracted fact is gone from search and the profile, and kept as history."""
    await mem.remember_fact("ana", "constraint", "allergy:peanuts", "allergic",
                            text="Allergic to peanuts", importance=1.0)
    await mem.flush()
    assert [h.kind for h in await mem.recall("ana", "peanuts allergy")] == ["fact"]
    assert await mem.forget_fact("ana", "constraint", "allergy:peanuts") is True
    assert await mem.forget_fact("ana", "constraint", "allergy:peanuts") is False
    await mem.flush()
    assert await mem.recall("ana", "peanuts allergy") == []
    assert await mem.profile("ana") == []
    (old,) = await mem.fact_history("ana", "constraint", "allergy:peanuts")
    assert old.status == "retracted"


async def test_retrieve_memory_shows_the_new_value_and_standing_facts(mem) -> None:
    """The semantic section holds the updated value, never the old one, plus standing facts;
    category and min_importance filter it."""
    await mem.remember_fact("ana", "identity", "location", "Lisbon", text="Lives in Lisbon")
    await mem.remember_fact("ana", "identity", "location", "Porto", text="Lives in Porto")
    await mem.remember_fact("ana", "constraint", "allergy:peanuts", "allergic",
                            text="Allergic to peanuts", importance=1.0)
    await mem.remember_fact("ana", "preference", "likes:jazz", "likes", text="Likes jazz",
                            importance=0.3)
    await mem.flush()
    markdown = await mem.retrieve_memory("ana", "which city do I live in?")
    assert "- [identity] Lives in Porto" in markdown and "Lisbon" not in markdown
    assert "- [constraint] Allergic to peanuts" in markdown
    assert markdown.index("Porto") < markdown.index("peanuts")
    raw = await mem.retrieve_memory_raw("ana", "jazz", category="preference")
    assert [s.fact for s in raw.semantic] == ["Likes jazz"]
    raw = await mem.retrieve_memory_raw("ana", "jazz", min_importance=0.5)
    assert "Likes jazz" not in [s.fact for s in raw.semantic]
    prompt = await mem.context_pre_retrieve("ana", "where do I live")
    assert prompt.startswith("## Semantic Memory\n- [identity] Lives in Porto")


async def test_forgetting_a_session_takes_the_facts_extracted_from_it(store_path) -> None:
    """Facts the rules took from a forgotten session go with it; others stay."""
    async with open_engine(store_path) as mem:
        await mem.add_turn("ana", "s1", "user", "I'm allergic to shellfish.")
        await mem.add_turn("ana", "s2", "user", "I'm vegetarian.")
        await mem.remember_fact("ana", "identity", "name", "Ana")
        await mem.flush()
        assert len(await mem.profile("ana")) == 3
        await mem.forget_session("ana", "s1")
        await mem.flush()
        assert sorted(f.key for f in await mem.profile("ana")) == ["diet", "name"]
        assert not [h for h in await mem.recall("ana", "shellfish allergy")
                    if "shellfish" in h.text.lower()]
    everything = b"".join(k + v for rows in raw_databases(store_path).values() for k, v in rows)
    assert b"shellfish" not in everything


@pytest.mark.parametrize(("call", "message"), [
    (lambda m: m.remember_fact("ana", "identity", "name", "Ana", confidence=1.5),
     r"confidence: expected a number from 0 to 1, found 1.5"),
    (lambda m: m.remember_fact("ana", "", "name", "Ana"), r"category: expected a non-empty"),
    (lambda m: m.remember_fact("ana", "identity", "name", ""), r"value: expected a non-empty"),
    (lambda m: m.confirm_fact("ana", "identity", "nothing"),
     r"key: expected an active fact \('identity', 'nothing'\) of user 'ana', found none"),
    (lambda m: m.profile("ana", min_importance=-1), r"min_importance: expected a number"),
])
async def test_fact_arguments_are_checked(mem, call, message) -> None:
    """Bad fact arguments name the field, what was expected and what was found."""
    with pytest.raises(InvalidInput, match=message):
        await call(mem)


async def test_facts_decided_together_match_facts_decided_one_by_one(tmp_path) -> None:
    """The extraction follower decides a step's facts with one wait for the store at its end
    (propose_all): each decision still sees the ones before it, so duplicates, new values and
    contradictions come out as propose one at a time makes them."""
    said = [("identity", "location", "Lisbon", "Lives in Lisbon", 0.8),
            ("preference", "likes:jazz", "likes", "Likes jazz music", 0.7),
            ("identity", "location", "Lisbon", "Lives in Lisbon", 0.85),
            ("preference", "music", "not jazz", "No longer likes jazz music", 0.8),
            ("identity", "location", "Porto", "Lives in Porto", 0.85),
            ("identity", "location", "Braga", "Lives in Braga", 0.5)]

    async def decide(path, together: bool) -> list[tuple]:
        async with open_engine(path, config={"long_term": False}, clock=StepClock()) as mem:
            receipts = [await mem.add_turn("ana", "s", "user", f"turn {i}", durable=True)
                        for i in range(len(said))]
            facts = mem._facts
            proposals = [Proposal("ana", Candidate(c, k, v, t, conf, 0.6), "rules",
                                  (r.turn_id,), "s", T0, r.lsn)
                         for (c, k, v, t, conf), r in zip(said, receipts, strict=True)]
            if together:
                await facts.propose_all(proposals)
            else:
                for p in proposals:
                    await facts.propose(p.user_id, p.candidate, origin=p.origin,
                                        source_turn_ids=p.sources, session_id=p.session_id,
                                        valid_at=p.valid_at, requires=p.requires)
            every = [f for key in (("identity", "location"), ("preference", "likes:jazz"),
                                   ("preference", "music"))
                     for f in await mem.fact_history("ana", *key)]
            cached = sorted((f.key, f.value, f.access_count) for f in await mem.profile("ana"))
        async with open_engine(path, config={"long_term": False}) as mem:
            stored = sorted((f.key, f.value, f.access_count) for f in await mem.profile("ana"))
        assert cached == stored  # the cache holds what the store holds
        return [(f.key, f.value, f.status, f.confidence, f.access_count) for f in every] + stored

    assert (await decide(tmp_path / "a", True)) == (await decide(tmp_path / "b", False))


async def test_a_queued_fact_whose_source_is_forgotten_leaves_nothing(store_path) -> None:
    """Decided together, a fact whose source turn was forgotten before its write is refused by
    the store, and a later decision that superseded it does not write it back as a retired
    version (its text would outlive the forgotten turn); the cache is read again."""
    async with open_engine(store_path, config={"long_term": False}) as mem:
        gone = await mem.add_turn("ana", "s1", "user", "turn one", durable=True)
        kept = await mem.add_turn("ana", "s2", "user", "turn two", durable=True)
        await mem.profile("ana")  # the facts' cache is loaded, and knows of no forget
        await mem.forget_session("ana", "s1")
        await mem._facts.propose_all([
            Proposal("ana", Candidate("identity", "location", "Qwzxville", "Lives in Qwzxville",
                                      0.8, 0.8), "rules", (gone.turn_id,), "s1", T0, gone.lsn),
            Proposal("ana", Candidate("identity", "location", "Porto", "Lives in Porto",
                                      0.85, 0.8), "rules", (kept.turn_id,), "s2", T0, kept.lsn)])
        assert [f.value for f in await mem.profile("ana")] == ["Porto"]
        assert [(f.value, f.status) for f in await mem.fact_history(
            "ana", "identity", "location")] == [("Porto", "active")]
        await mem.flush()
    everything = b"".join(k + v for rows in raw_databases(store_path).values() for k, v in rows)
    assert b"Qwzxville" not in everything


def _fact_entries(path) -> list[int]:
    """How many retired lsns each fact entry in the log carries."""
    return [int.from_bytes(value[1:3], "big") for _, value in raw_databases(path)["log"]
            if value[:1] == b"F"]


async def test_a_fact_entry_carries_only_what_the_text_index_may_still_hold(store_path) -> None:
    """A key superseded again and again: once the text index has applied a retired entry, the
    next entry need not carry what that one retired. Carried always, the entry grew by one
    lsn per new value (16,000 in a 100k-turn import; past 65,535 it could not be written)."""
    async with open_engine(store_path) as mem:
        for i in range(30):
            await mem.remember_fact("ana", "identity", "location", f"City{i}", confidence=0.9)
            await mem.flush()  # the text index commits what it has read
        assert [f.value for f in await mem.profile("ana")] == ["City29"]
        assert len(await mem.fact_history("ana", "identity", "location")) == 30
    assert max(_fact_entries(store_path)) <= 1


async def test_a_lagging_text_index_still_drops_every_retired_version(store_path,
                                                                     monkeypatch) -> None:
    """With the text index's commits held back, new values keep carrying the versions it may
    hold; once it catches up, no old value is left in it."""
    async with open_engine(store_path, config={"background_embedding": False}) as mem:
        await mem.remember_fact("ana", "identity", "location", "Qwzxzero", confidence=0.9)
        await mem.flush()
        with text_index_held(monkeypatch):
            for name in ("Qwzxone", "Qwzxtwo", "Qwzxthree"):
                await mem.remember_fact("ana", "identity", "location", name, confidence=0.9)
        await mem.flush()
        for old in ("qwzxzero", "qwzxone", "qwzxtwo"):
            assert await mem._fulltext.search("ana", old, 10) == [], old
        assert len(await mem._fulltext.search("ana", "qwzxthree", 10)) == 1
    assert max(_fact_entries(store_path)) >= 2  # carried while the index lagged


async def test_a_clock_that_fails_for_a_moment_costs_no_turn_its_facts(store_path) -> None:
    """Right after a bystander's turn was acknowledged, the engine's clock raised for a moment
    (a time service restarting): the long-term followers, reading it as they reached the turn,
    took its error for the turn's and kept a permanent failure; the turn's facts were never
    extracted. A clock's failure is not the record's: the step waits and runs again, and the
    caller of an API call the clock failed hears ClockFailed, the engine's own type."""
    from engine import ClockFailed

    clock = FailingClock()
    async with open_engine(store_path, clock=clock) as mem:
        clock.broken = True
        await mem.add_turn("bo", "s1", "user", "My name is Bo and I live in Oslo.",
                           at=T0, durable=True)
        with pytest.raises(ClockFailed, match=r"^clock: .*clock source unavailable"):
            await mem.remember_fact("bo", "identity", "pet", "cat")
        await trio.sleep(0.3)
        clock.broken = False
        await mem.flush()
        assert {(f.key, f.value) for f in await mem.profile("bo")} >= {
            ("name", "Bo"), ("location", "Oslo")}
        assert await mem.failures() == []


async def test_a_clock_that_stays_broken_holds_the_long_term_layer_only_so_long(
        store_path, autojump_clock, caplog) -> None:
    """A clock that never reads again holds each step CLOCK_WAIT_SECONDS at most: then its
    records are kept as failures, as any record's error, and a flush returns."""
    from actors.store.replay import CLOCK_WAIT_SECONDS

    clock = FailingClock()
    async with open_engine(store_path, clock=clock) as mem:
        clock.broken = True
        await mem.add_turn("bo", "s1", "user", "My name is Bo.", at=T0, durable=True)
        start = trio.current_time()
        await mem.flush()
        assert trio.current_time() - start >= CLOCK_WAIT_SECONDS
        assert {f.actor for f in await mem.failures()} >= {"facts"}
        # The clock still broken: the next steps wait no more (the wait is 30 s in all,
        # where each step waited its own 30 s, a backlog of N chunks N times that).
        caplog.clear()
        for i in range(3):
            await mem.add_turn("bo", f"s{i + 2}", "user", "My name is Bo.", at=T0,
                               durable=True)
            await mem.flush()
        assert not [r for r in caplog.records if "waiting for the clock" in r.getMessage()]
        assert [f.actor for f in await mem.failures()].count("facts") == 4


async def test_a_flush_covers_what_the_long_term_layer_derived_during_it(tmp_path,
                                                                        monkeypatch) -> None:
    """A fact the rules take from a turn is logged during the flush, after the turns it
    waited for: every follower of the long-term layer takes it in before the flush returns,
    not some time after (then a caller's stats or entities changed under it a moment later,
    and an import refused right after a flush seemed to have written something). The
    followers' pacing is long here, so that none takes it in unasked."""
    import actors.store.replay as replay_mod

    monkeypatch.setattr(replay_mod, "STEP_SECONDS", 2.0)
    async with open_engine(tmp_path / "a", clock=StepClock()) as mem:
        for i in range(4):
            await mem.add_turn("maya", "s1", "user", f"My dog Pixel likes the beach, day {i}")
        await mem.store_note("maya", "Maya plans a trip to Madeira", tags=["travel"])
        turns_and_note = mem._parts.store.next_lsn - 1
        await mem.flush()
        store = mem._parts.store
        assert store.next_lsn - 1 > turns_and_note  # the layer logged something of its own
        assert [f.watermark for f in mem._parts.followers] == \
            [store.next_lsn - 1] * len(mem._parts.followers)
        assert (await mem.stats()).queued == 0
