"""recall and the retrieve API under hostile and edge input: filters that must hold everywhere,
sections that must not repeat themselves, arguments that must be refused by name."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

import actors.fulltext as fulltext_mod
from engine import InvalidInput

from .conftest import T0, StepClock, open_engine


async def test_linked_memories_pass_the_same_filters_as_the_hits(store_path) -> None:
    """Linked memories pass kinds, session_id, roles and since as they pass ``where``, and one
    left out still leads on to those linked to it."""
    async with open_engine(store_path) as mem:
        hit = await mem.add_turn("ana", "s1", "user", "zebra sighting at the zoo")
        old = await mem.add_turn("ana", "s2", "assistant", "unrelated words here",
                                 at=T0 - timedelta(days=30))
        note = await mem.store_note("ana", "a note about nothing")
        await mem.link("ana", hit.turn_id, old.turn_id, "relates_to")
        await mem.link("ana", old.turn_id, note.note_id, "relates_to")
        await mem.link("ana", old.turn_id, hit.turn_id, "back")  # a cycle
        await mem.flush()

        async def linked(**narrowed) -> list[str]:
            hits = await mem.recall("ana", "zebra", limit=1, link_depth=3, **narrowed)
            return [h.id for h in hits]

        assert await linked() == [hit.turn_id, old.turn_id, note.note_id]
        for narrowed in ({"session_id": "s1"}, {"roles": ["user"]},
                         {"where": {"session_id": "s1"}}):
            assert await linked(**narrowed) == [hit.turn_id], narrowed
        assert await linked(kinds=["turn"]) == [hit.turn_id, old.turn_id]
        assert await linked(since=T0 - timedelta(days=1)) == [hit.turn_id, note.note_id]


async def test_a_fact_the_text_index_lacks_shows_once_in_the_semantic_section(
        store_path, monkeypatch) -> None:
    """A fact the vector leg and the not-yet-indexed pass both find is shown once by
    retrieve_memory and context_pre_retrieve."""
    gate = threading.Event()  # set: the text index may commit again
    original = fulltext_mod.FullText._commit

    def held_commit(self):
        gate.wait(10)
        return original(self)

    async with open_engine(store_path) as mem:
        monkeypatch.setattr(fulltext_mod.FullText, "_commit", held_commit)
        try:
            fact = await mem.remember_fact("ana", "identity", "employer", "Acme Robotics",
                                           text="works at Acme Robotics")
            await mem._embedder.wait_embedded(fact.lsn)
            assert mem._fulltext.indexed_lsn < fact.lsn
            query = "which company, Acme Robotics?"
            raw = await mem.retrieve_memory_raw("ana", query, record=False)
            assert [s.id for s in raw.semantic] == [fact.fact_id]
            prompt = await mem.context_pre_retrieve("ana", query)
            assert prompt.count("works at Acme Robotics") == 1
        finally:
            gate.set()


async def test_an_episode_standing_for_turns_below_it_does_not_cost_the_limit(
        store_path) -> None:
    """Turns an episode above them stands for give their places to others: ``limit`` hits
    come back while more match."""
    async with open_engine(store_path) as mem:
        for i in range(12):
            await mem.add_turn("ana", "s1", "user", f"green tea brewing tip number {i}")
        for i in range(12):
            await mem.add_turn("ana", "s2", "user", f"tea shop visit {i} downtown")
        await mem.close_session("ana", "s1")
        await mem.flush()
        (episode,) = await mem.episodes("ana")
        query = f"{episode.title} {episode.summary}"[:200]
        hits = await mem.recall("ana", query, limit=5, kinds=["turn", "episode"])
        assert len(hits) == 5
        kinds = [h.kind for h in hits]
        assert "episode" in kinds
        below = hits[kinds.index("episode") + 1:]
        assert not set(episode.turn_ids) & {h.id for h in below}


async def test_since_with_a_fraction_of_a_second_keeps_the_text_leg_s_hits(store_path) -> None:
    """The BM25 leg, whose index holds times to the second, keeps a memory said within
    ``since``'s second after it."""
    async with open_engine(store_path) as mem:
        after = await mem.add_turn("ana", "s1", "user", "zebra crossing at noon",
                                   at=T0 + timedelta(milliseconds=700))
        await mem.add_turn("ana", "s1", "user", "zebra crossing at dawn",
                           at=T0 + timedelta(milliseconds=300))
        await mem.flush()
        for since in (T0 + timedelta(milliseconds=500), T0 + timedelta(milliseconds=700)):
            for legs in (["bm25"], None):
                hits = await mem.recall("ana", "zebra crossing", since=since, legs=legs,
                                        kinds=["turn"])
                assert [h.id for h in hits] == [after.turn_id], (since, legs)


async def test_a_time_range_that_ends_before_it_starts_is_refused(mem) -> None:
    """since after until (the two swapped) is refused by name, not answered with nothing."""
    await mem.add_turn("ana", "s1", "user", "zebra crossing", at=T0)
    await mem.flush()
    with pytest.raises(InvalidInput, match=r"until: expected a time at or after since "
                                           r"\(2026-03-02T09:00:00\+00:00\), found "
                                           r"2026-03-01T09:00:00\+00:00"):
        await mem.recall("ana", "zebra", since=T0 + timedelta(days=1), until=T0)
    hits = await mem.recall("ana", "zebra", since=T0, until=T0)
    assert [h.text for h in hits] == ["zebra crossing"]


async def test_hits_are_hashable_like_the_frozen_structs_they_are(mem) -> None:
    """Hits, explain and all, go in a set or key a dict, equal hits hashing alike."""
    await mem.add_turn("ana", "s1", "user", "zebra crossing near the zoo")
    await mem.flush()
    first = await mem.recall("ana", "zebra crossing")
    again = await mem.recall("ana", "zebra crossing")
    assert first and first[0].explain is not None
    assert set(first) == set(again) and len(set(first + again)) == len(first)
    assert {hit: hit.score for hit in first}[again[0]] == first[0].score


async def test_a_focus_level_s_window_reaches_back_from_as_of(store_path) -> None:
    """With ``as_of``, the focus level's time window ends then, not now."""
    clock = StepClock(start=T0 + timedelta(days=10))
    async with open_engine(store_path, clock=clock) as mem:
        await mem.add_turn("ana", "s1", "user", "coffee then",
                           at=T0 + timedelta(days=3, minutes=-10))
        await mem.add_turn("ana", "s1", "user", "coffee now",
                           at=T0 + timedelta(days=10, minutes=-10))
        await mem.flush()
        now = await mem.recall("ana", "coffee", focus=0)
        assert [h.text for h in now] == ["coffee now"]
        then = await mem.recall("ana", "coffee", focus=0, as_of=T0 + timedelta(days=3))
        assert [h.text for h in then] == ["coffee then"]
        later = await mem.recall("ana", "coffee", focus=0, as_of=T0 + timedelta(days=30))
        assert [h.text for h in later] == ["coffee now"]
