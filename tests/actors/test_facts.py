"""The Facts actor: one active value per key, history, duplicates, contradictions, protection,
decay, retraction, and the extraction follower.

Driven bare over a real Store (tests/actors/ground.py): its follower extracts facts from the
turns appended to the log with the rules (tests/actors/test_extraction.py), proposals come as
Candidates (as the facade and extractors make them), and what leaves the indexes is what its
``removed`` callback hears. The facade's calls, their argument checks and the facts in
retrieval are in tests/test_facts_in_engine.py.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from pathlib import Path

import actors.store as store_mod
from actors.base.messages import Candidate
from actors.facts import Facts

from ..conftest import T0, StepClock, raw_databases
from .ground import Ground, running_store


class ManualClock:
    """An engine clock that stays put until a test moves it."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self):
        return self.now


class Running:
    """A store, the Facts actor over it with its extraction follower running, and what the
    actor told the vector index to drop (user, lsns), in order."""

    def __init__(self, ground: Ground, facts: Facts, follower: store_mod.LogFollower,
                 removed: list[tuple[str, list[int]]]) -> None:
        self.ground = ground
        self.facts = facts
        self.follower = follower
        self.removed = removed

    async def flush(self) -> None:
        """Wait until everything queued is committed and the follower has taken it in."""
        await self.ground.store.wait_written()
        await self.follower.wait(self.ground.store.committed_lsn)

    async def remember(self, category: str, key: str, value: str, text: str | None = None,
                       confidence: float = 0.9, importance: float = 0.7, **kwargs):
        """Propose a fact as the facade's remember_fact does (origin ``api``, its defaults)."""
        candidate = Candidate(category, key, value, text or f"{key}: {value}", confidence,
                              importance)
        return await self.facts.propose("ana", candidate, origin="api", **kwargs)

    async def values(self, category: str | None = None) -> list[tuple[str, str]]:
        return [(f.key, f.value) for f in await self.facts.profile("ana", category)]


@asynccontextmanager
async def running_facts(path: Path, clock: Callable[[], datetime] | None = None
                        ) -> AsyncIterator[Running]:
    """A store at ``path``, the Facts actor and its extraction follower (the rules), running."""
    ids = itertools.count(1)
    removed: list[tuple[str, list[int]]] = []
    async with running_store(path) as ground:
        facts = Facts(ground.store, lambda user, lsns: removed.append((user, lsns)),
                      clock or StepClock(), lambda: f"{next(ids):016x}")
        running = Running(ground, facts, facts.follower(), removed)
        await ground.start(running.follower.run)
        yield running


async def test_a_new_value_supersedes_the_old_one_and_history_keeps_both(store_path) -> None:
    """Moving city, as the rules extract it from turns: the new location is active, the old
    one is kept with invalid_at set."""
    clock = StepClock(step=timedelta(days=1))
    async with running_facts(store_path, clock) as f:
        await f.ground.add_turn("ana", "s1", "I live in Lisbon, near the old market.")
        await f.flush()
        await f.ground.add_turn("ana", "s2", "Big change: I moved to Porto last week.")
        await f.flush()
        (location,) = [fact for fact in await f.facts.profile("ana") if fact.key == "location"]
        history = await f.facts.history("ana", "identity", "location")
    assert location.value == "Porto" and location.status == "active"
    old, new = history
    assert (old.value, old.status, new.value) == ("Lisbon", "superseded", "Porto")
    assert old.invalid_at == new.valid_at and old.expired_at is not None
    assert new.invalid_at is None and new.source_turn_ids and new.origin == "rules"


async def test_a_less_confident_value_does_not_supersede(store_path) -> None:
    """Seed 002's rule: a lower-confidence value is refused; a forced one (a correction)
    replaces the active value regardless."""
    async with running_facts(store_path) as f:
        await f.remember("identity", "location", "Lisbon", confidence=0.9)
        refused = await f.remember("identity", "location", "Porto", confidence=0.5)
        assert (refused.status, refused.fact, refused.previous.value) == ("refused", None, "Lisbon")
        assert refused.reason == "lower confidence than the active value"
        assert await f.values() == [("location", "Lisbon")]
        corrected = await f.remember("identity", "location", "Porto", confidence=0.5, force=True)
        assert corrected.status == "superseded" and corrected.previous.value == "Lisbon"
        assert await f.values() == [("location", "Porto")]
        history = await f.facts.history("ana", "identity", "location")
    assert [fact.status for fact in history] == ["superseded", "active"]


async def test_duplicates_reinforce_instead_of_adding(store_path) -> None:
    """The same value again, or a sentence with Jaccard >= 0.75 to an active fact, is one fact."""
    async with running_facts(store_path) as f:
        first = await f.remember("preference", "coffee", "flat white",
                                 text="Drinks her coffee as a flat white every morning",
                                 confidence=0.6)
        again = await f.remember("preference", "coffee", "Flat  White", confidence=0.8)
        near = await f.remember("preference", "morning coffee", "flat white",
                                text="Drinks her coffee as a flat white every single morning")
        assert (first.status, again.status, near.status) == ("created", "reinforced", "reinforced")
        assert again.fact.fact_id == first.fact.fact_id == near.fact.fact_id
        assert again.fact.confidence == 0.8 and near.fact.access_count == 2
        assert len(await f.facts.profile("ana")) == 1


async def test_a_contradiction_without_a_shared_key_is_resolved_by_the_same_rule(store_path) -> None:
    """'Likes jazz' and 'No longer likes jazz' under different keys: the newer supersedes."""
    async with running_facts(store_path) as f:
        await f.remember("preference", "music", "jazz", text="Likes jazz music", confidence=0.7)
        await f.remember("preference", "music taste", "not jazz",
                         text="No longer likes jazz music", confidence=0.8)
        assert [fact.text for fact in await f.facts.profile("ana")] == ["No longer likes jazz music"]
        assert (await f.facts.history("ana", "preference", "music"))[0].status == "superseded"


async def test_confirmed_facts_never_decay_and_inferred_values_cannot_replace_them(store_path) -> None:
    """A jumped clock prunes an unused fact but not a confirmed one, and the pruned fact
    leaves the vector index; a rule-extracted value does not supersede a confirmed fact."""
    clock = ManualClock()
    async with running_facts(store_path, clock) as f:
        snack = (await f.remember("preference", "snack", "crisps", confidence=0.6)).fact
        await f.remember("identity", "location", "Lisbon", confidence=0.5)
        confirmed = await f.facts.confirm("ana", "identity", "location")
        assert confirmed.protected and confirmed.confidence == 1.0
        await f.ground.add_turn("ana", "s", "I live in Braga now.")
        await f.flush()
        assert await f.values("identity") == [("location", "Lisbon")]
        clock.now = T0 + timedelta(days=200)  # 0.6 x exp(-0.02 x 200) = 0.011 < 0.05
        assert await f.facts.decay_and_prune(["ana"]) == 1
        assert await f.values() == [("location", "Lisbon")]
        assert (await f.facts.history("ana", "preference", "snack"))[0].status == "pruned"
        assert f.removed == [("ana", [snack.lsn])]


async def test_showing_a_fact_restarts_its_decay(store_path) -> None:
    """A use (touch: a retrieval showed it) counts: decay is measured from then."""
    clock = ManualClock()
    async with running_facts(store_path, clock) as f:
        tea = (await f.remember("preference", "tea", "green tea", text="Likes green tea",
                                confidence=0.6)).fact
        clock.now = T0 + timedelta(days=100)
        f.facts.touch("ana", [tea.fact_id])
        await f.ground.store.wait_written()
        clock.now = T0 + timedelta(days=160)  # 60 days after the use: 0.6 x e^-1.2 = 0.18
        assert await f.facts.decay_and_prune(["ana"]) == 0
        f.facts.forget("ana")  # read back from the store, not the cache
        (tea,) = await f.facts.profile("ana")
    assert tea.access_count == 1 and tea.last_access_at == T0 + timedelta(days=100)


async def test_a_retracted_fact_leaves_the_profile_and_the_index_and_stays_in_history(
        store_path) -> None:
    """Retiring a fact as retracted: gone from the profile and the vector index, once, and
    kept as history."""
    async with running_facts(store_path) as f:
        fact = (await f.remember("constraint", "allergy:peanuts", "allergic",
                                 text="Allergic to peanuts", importance=1.0)).fact
        retired = await f.facts.retire("ana", [("constraint", "allergy:peanuts")], "retracted")
        assert [r.fact_id for r in retired] == [fact.fact_id]
        assert await f.facts.retire("ana", [("constraint", "allergy:peanuts")], "retracted") == []
        assert await f.facts.profile("ana") == []
        assert f.removed == [("ana", [fact.lsn])]
        (old,) = await f.facts.history("ana", "constraint", "allergy:peanuts")
    assert old.status == "retracted"


async def test_profile_filters_by_category_and_importance_and_orders_by_importance(
        store_path) -> None:
    """Standing facts first (importance), then the rest; category and min_importance filter."""
    async with running_facts(store_path) as f:
        await f.remember("identity", "location", "Porto", text="Lives in Porto", importance=0.5)
        await f.remember("constraint", "allergy:peanuts", "allergic", text="Allergic to peanuts",
                         importance=1.0)
        await f.remember("preference", "likes:jazz", "likes", text="Likes jazz", importance=0.3)
        assert [x.text for x in await f.facts.profile("ana")] == [
            "Allergic to peanuts", "Lives in Porto", "Likes jazz"]
        assert [x.text for x in await f.facts.profile("ana", "preference")] == ["Likes jazz"]
        assert "Likes jazz" not in [x.text for x in await f.facts.profile("ana", None, 0.5)]


async def test_forgetting_a_session_takes_the_facts_extracted_from_it(store_path) -> None:
    """Facts the rules took from a forgotten session go with it; others stay."""
    async with running_facts(store_path) as f:
        await f.ground.add_turn("ana", "s1", "I'm allergic to shellfish.")
        await f.ground.add_turn("ana", "s2", "I'm vegetarian.")
        await f.remember("identity", "name", "Ana")
        await f.flush()
        assert len(await f.facts.profile("ana")) == 3
        await f.ground.store.forget("ana", "s1")
        f.facts.forget("ana")
        assert sorted(fact.key for fact in await f.facts.profile("ana")) == ["diet", "name"]
        history = await f.ground.store.read(store_mod.read_facts, "ana", False)
        assert sorted(fact.key for fact in history) == ["diet", "name"]
    everything = b"".join(k + v for rows in raw_databases(store_path).values() for k, v in rows)
    assert b"shellfish" not in everything
<<<<<<< HEAD


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
    gate = threading.Event()  # set: the text index may commit again
    original = fulltext_mod.FullText._commit

    def held_commit(self):
        gate.wait(10)
        return original(self)

    async with open_engine(store_path, config={"background_embedding": False}) as mem:
        await mem.remember_fact("ana", "identity", "location", "Qwzxzero", confidence=0.9)
        await mem.flush()
        monkeypatch.setattr(fulltext_mod.FullText, "_commit", held_commit)
        try:
            for name in ("Qwzxone", "Qwzxtwo", "Qwzxthree"):
                await mem.remember_fact("ana", "identity", "location", name, confidence=0.9)
        finally:
            gate.set()
        await mem.flush()
        for old in ("qwzxzero", "qwzxone", "qwzxtwo"):
            assert await mem._fulltext.search("ana", old, 10) == [], old
        assert len(await mem._fulltext.search("ana", "qwzxthree", 10)) == 1
    assert max(_fact_entries(store_path)) >= 2  # carried while the index lagged


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
=======
>>>>>>> 592c6d0 (tests/actors/test_facts.py drives the Facts actor bare over a running Store (proposals as Candidates, the rules' follower on the log, removals heard through its callback), and the extraction rules' table moves to tests/actors/test_extraction.py beside the module it tests; the facade's fact calls, their checks and facts in retrieval moved unchanged to tests/test_facts_in_engine.py. Candidate moves to actors.base.messages (re-exported by actors.extraction and engine as before): it is what extractors and the facade hand the Facts actor, a type two actors share, so it belongs to the bottom layer; Facts.follower defaults to the rules and no imported ranges, as the engine's defaults. The layer rule's exception list is empty, so the rule now simply says no actor test stands on the engine)
