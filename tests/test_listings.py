"""What the inspector browses through the public API: users, a user's notes, entities and
every fact version, and recall restricted to some of its legs."""

from __future__ import annotations

import pytest

from engine import InvalidInput

from .conftest import open_engine


async def test_listings_show_each_users_own_records_and_nothing_else(mem) -> None:
    """list_users names every user with a session; list_notes, list_entities and
    fact_versions list one user's records only, retired fact versions included."""
    await mem.add_turn("ana", "s1", "user", "I met Bruno in Lisbon yesterday")
    await mem.add_turn("ana", "s1", "user", "Bruno loves Lisbon and Porto")
    await mem.add_turn("bo", "s9", "user", "Carla lives in Madrid")
    older = await mem.store_note("ana", "likes jazz", tags=["music"])
    newer = await mem.store_note("ana", "plays the piano")
    await mem.store_note("bo", "bo's note")
    await mem.remember_fact("ana", "identity", "location", "Lisbon")
    await mem.correct_fact("ana", "identity", "location", "Porto")
    await mem.remember_fact("ana", "preference", "drink", "tea")
    await mem.forget_fact("ana", "preference", "drink")
    await mem.flush()

    assert await mem.list_users() == ["ana", "bo"]
    assert (mem.path / "data.mdb").exists()
    assert [n.note_id for n in await mem.list_notes("ana")] == [newer.note_id, older.note_id]
    assert (await mem.list_notes("ana"))[1].tags == ("music",)
    names = [e.name.lower() for e in await mem.list_entities("ana")]
    assert names[0] in {"bruno", "lisbon"} and {"bruno", "lisbon", "porto"} <= set(names)
    assert "carla" not in names and "madrid" not in names
    versions = await mem.fact_versions("ana")
    assert [(f.key, f.value, f.status) for f in versions if f.key == "location"] == [
        ("location", "Lisbon", "superseded"), ("location", "Porto", "active")]
    assert [(f.value, f.status) for f in versions if f.key == "drink"] == [
        ("tea", "retracted")]
    assert [f.user_id for f in await mem.fact_versions("bo")] == []
    assert await mem.list_notes("nobody") == [] and await mem.list_entities("nobody") == []
    with pytest.raises(InvalidInput, match="user_id"):
        await mem.list_notes("")


async def test_list_users_names_users_with_only_notes_or_facts(store_path) -> None:
    """A user whose memory holds notes or facts but no conversation is still a user: the
    inspector lists them, also after a reopen (the session buffer knows sessions only)."""
    async with open_engine(store_path) as mem:
        await mem.add_turn("ana", "s1", "user", "hello")
        await mem.store_note("cy", "a note without a conversation")
        await mem.remember_fact("dee", "identity", "name", "Dee")
        assert await mem.list_users() == ["ana", "cy", "dee"]
    async with open_engine(store_path) as mem:
        assert await mem.list_users() == ["ana", "cy", "dee"]
        await mem.forget_user("cy")
        assert await mem.list_users() == ["ana", "dee"]


async def test_recall_runs_only_the_legs_asked_for(mem) -> None:
    """legs= runs those legs alone: each hit's explain ranks only them; an unknown leg is
    refused naming the field."""
    await mem.add_turn("ana", "s1", "user", "my dog Pixel chases the postman")
    await mem.add_turn("ana", "s1", "user", "the weather was grey all week")
    await mem.flush()
    both = await mem.recall("ana", "dog Pixel", kinds=["turn"])
    assert {"bm25", "vector"} <= set(both[0].explain.ranks)
    only_bm25 = await mem.recall("ana", "dog Pixel", kinds=["turn"], legs=["bm25"])
    assert only_bm25 and all(set(h.explain.ranks) <= {"bm25"} for h in only_bm25
                             if h.explain is not None)
    assert only_bm25[0].via == ("bm25",)
    with pytest.raises(InvalidInput, match=r"legs: expected values among .*found 'bm26'"):
        await mem.recall("ana", "dog", legs=["bm26"])


async def test_retrieve_memory_runs_only_the_legs_asked_for(mem) -> None:
    """retrieve_memory(legs=) searches with those legs, as recall does, so the inspector can
    compare what each brings: a turn only its meaning finds is in the Markdown with every leg
    and with the vector leg alone, not with BM25 alone; an unknown leg is refused."""
    await mem.add_turn("ana", "s1", "user", "my dog Pixel chases the postman")
    await mem.add_turn("ana", "s1", "user", "the weather was grey all week")
    await mem.flush()
    query = "my pet"  # no word BM25 counts in common with the turn: only its meaning finds it
    turns_only = {"semantic_limit": 0}  # the fact the turn states would name Pixel too
    assert "Pixel" in await mem.retrieve_memory("ana", query, **turns_only)
    assert "Pixel" in await mem.retrieve_memory("ana", query, legs=["vector"], **turns_only)
    assert "Pixel" not in await mem.retrieve_memory("ana", query, legs=["bm25"], **turns_only)
    assert (await mem.retrieve_memory_raw("ana", query, legs=["bm25", "entity"])).episodic == []
    assert (await mem.retrieve_memory_raw("ana", "postman", legs=["bm25"])).episodic
    await mem.remember_fact("ana", "preference", "drink", "green tea", importance=0.3)
    await mem.flush()

    def drinks(result) -> list[str]:
        return [s.fact for s in result.semantic if "tea" in s.fact]

    assert drinks(await mem.retrieve_memory_raw("ana", "green tea", legs=["bm25"]))
    assert drinks(await mem.retrieve_memory_raw("ana", "green tea", legs=["entity"])) == []
    with pytest.raises(InvalidInput, match=r"legs: expected values among .*found 'bm26'"):
        await mem.retrieve_memory("ana", query, legs=["bm26"])
