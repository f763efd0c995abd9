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
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from pathlib import Path

import trio

import actors.store as store_mod
import actors.store.replay as replay_mod
from actors.base.ids import derived_id
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


async def test_the_rules_yield_the_loop_in_small_steps_when_roles_alternate(store_path,
                                                                           monkeypatch) -> None:
    """A conversation alternates user and assistant turns: the follower still gives the loop
    back every few user turns it runs the rules on, not once per 512-record step (a durable
    caller arriving meanwhile would wait behind the whole step's regex)."""
    yields = 0
    original = store_mod.Store.yield_to_receipts

    async def counted(self, before_step: bool = False) -> None:
        nonlocal yields
        if sys._getframe(1).f_code.co_name == "handle":  # the rules' loop, not the step's
            yields += 1
        await original(self, before_step)

    async with running_store(store_path) as ground:
        for i in range(64):
            role = ("user", "assistant")[i % 2]
            await ground.add_turn("ana", "s1", f"I live in Town{i}.", role=role)
        await ground.store.wait_written()
        facts = Facts(ground.store, lambda user, lsns: None, StepClock(), lambda: "f")
        follower = facts.follower()
        monkeypatch.setattr(store_mod.Store, "yield_to_receipts", counted)
        await ground.start(follower.run)
        await follower.wait(64)
    assert yields >= 32 // 8  # one at least every 8 of the 32 user turns


async def test_an_extracted_fact_is_named_by_what_it_states_and_never_reuses_an_id(
        tmp_path: Path) -> None:
    """A fact extracted from a turn takes its id from the user, the turn, its key and value
    and the versions it retires, alike in two stores (two cluster nodes); the same value
    said again in that turn after another superseded it is a new version under a new id; a
    caller's fact keeps the id maker's."""
    location = [Candidate("identity", "location", city, f"Lives in {city}", confidence, 0.8)
                for city, confidence in (("Lisbon", 0.8), ("Porto", 0.85), ("Lisbon", 0.9))]
    made = []
    for name in ("a", "b"):
        async with running_store(tmp_path / name) as ground:
            facts = Facts(ground.store, lambda user, lsns: None, StepClock(), lambda: "call")
            for candidate in location:
                await facts.propose("ana", candidate, origin="rules", source_turn_ids=("t1",))
            history = await facts.history("ana", "identity", "location")
            name_fact = await facts.propose("ana", Candidate("identity", "name", "Ana",
                                                             "Name: Ana", 0.9, 0.9),
                                            origin="api")
            made.append([f.fact_id for f in history])
    first, second = made
    assert first == second and len(set(first)) == 3
    what = ("ana", ("t1",), "identity", "location", "Lisbon", ())
    assert first[0] == "f_" + derived_id(what)
    assert [f.status for f in history] == ["superseded", "superseded", "active"]
    assert name_fact.fact is not None and name_fact.fact.fact_id == "f_call"



async def test_the_follower_reads_a_trickle_in_paced_steps(store_path) -> None:
    """Turns arriving one at a time (real time, against the store's threads) are taken by the
    extraction follower in steps at least STEP_SECONDS apart, not a step per commit: each
    step reads the log on a thread and commits its watermark."""
    async with running_facts(store_path) as f:
        steps = 0
        real_step = f.follower._step

        async def counted(records, last):
            nonlocal steps
            steps += 1
            await real_step(records, last)

        f.follower._step = counted
        began = due = trio.current_time()
        for i in range(500):
            await trio.sleep_until(due)
            await f.ground.add_turn("ana", "s1", f"turn {i}: I like sardines.")
            due += 0.002
        elapsed = trio.current_time() - began
        assert steps <= elapsed / replay_mod.STEP_SECONDS + 3, (steps, elapsed)
        await f.flush()
        assert f.follower.watermark == f.ground.store.committed_lsn


async def test_a_flush_is_not_held_by_the_followers_pacing(store_path, monkeypatch) -> None:
    """A caller waiting on the follower (the engine's flush) gets its step at once, however
    long the pacing would hold it."""
    monkeypatch.setattr(replay_mod, "STEP_SECONDS", 5.0)
    async with running_facts(store_path) as f:
        await f.ground.add_turn("ana", "s1", "I live in Lisbon.")
        await f.flush()  # a step has just begun: the pacing holds the next for 5 s
        await f.ground.add_turn("ana", "s2", "I moved to Porto last week.")
        began = trio.current_time()
        await f.flush()
        assert trio.current_time() - began < 2.5
        assert ("location", "Porto") in await f.values()
