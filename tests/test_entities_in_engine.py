"""Entities as the engine serves them: entity_info over the registry, the links and the
entity leg of recall, and what forgetting leaves (the actor alone: tests/actors/test_entities.py)."""

from __future__ import annotations

import unicodedata

from .conftest import open_engine, raw_databases


async def test_a_first_name_is_an_alias_of_the_full_name(mem) -> None:
    """'Maya' after 'Maya Lindqvist' counts for the same entity; any case finds it."""
    first = await mem.add_turn("ana", "s", "user", "Maya Lindqvist, an old friend, moved to Lisbon.")
    second = await mem.add_turn("ana", "s", "user", "maya sent a postcard. Maya loves trams.")
    third = await mem.add_turn("ana", "s2", "user", "Dinner with Maya on Friday.")
    await mem.flush()
    info = await mem.entity_info("ana", "MAYA")
    assert info is not None and info.entity.name == "Maya Lindqvist"
    assert info.entity.type == "person" and info.entity.mentions == 3
    assert "Maya" in info.entity.aliases
    assert [h.id for h in info.memories] == [third.turn_id, second.turn_id, first.turn_id]
    assert await mem.entity_info("ana", "nobody") is None
    assert await mem.entity_info("bob", "maya") is None  # another user's registry is empty


async def test_memories_sharing_an_entity_are_linked_and_found_by_the_entity_leg(mem) -> None:
    """A later mention links to the previous one; a lower-case query naming the entity finds
    its memories through the entity leg."""
    a = await mem.add_turn("ana", "s1", "user", "Tomás is my climbing partner.")
    await mem.add_turn("ana", "s1", "user", "The weather was grey all week.")
    b = await mem.add_turn("ana", "s2", "user", "Booked a gym session with Tomás for Monday.")
    await mem.flush()
    links = await mem.links("ana", b.turn_id)
    assert [(link.to_id, link.type) for link in links] == [(a.turn_id, "shares_entity")]
    hits = await mem.recall("ana", "what about tomás", kinds=["turn"])
    assert {h.id for h in hits[:2]} == {a.turn_id, b.turn_id}
    assert all("entity" in h.via for h in hits[:2])


async def test_a_name_typed_decomposed_finds_what_the_composed_name_said(mem) -> None:
    """A name sent decomposed (NFD, a letter then its accent: macOS and some keyboards) is the
    name sent composed, in entity_info, the entity leg and the text index alike."""
    a = await mem.add_turn("ana", "s1", "user", "Tomás is my climbing partner.")
    b = await mem.add_turn("ana", "s2", "user", unicodedata.normalize(
        "NFD", "Booked a gym session with Tomás for Monday."))
    await mem.flush()
    nfd = unicodedata.normalize("NFD", "Tomás")
    info = await mem.entity_info("ana", nfd)
    assert info is not None and info.entity.name == "Tomás" and info.entity.mentions == 2
    for legs in (["entity"], ["bm25"]):
        hits = await mem.recall("ana", f"what about {nfd}", kinds=["turn"], legs=legs)
        assert {h.id for h in hits[:2]} == {a.turn_id, b.turn_id}, legs


async def test_forgetting_removes_entities(store_path) -> None:
    """A forgotten session's mentions leave the registry; an entity only it mentioned goes."""
    async with open_engine(store_path) as mem:
        await mem.add_turn("ana", "s1", "user", "Zebulon visited Reykjavik.")
        await mem.add_turn("ana", "s2", "user", "Reykjavik was cold.")
        await mem.flush()
        await mem.forget_session("ana", "s1")
        await mem.flush()
        assert await mem.entity_info("ana", "zebulon") is None
        info = await mem.entity_info("ana", "reykjavik")
        assert info is not None and len(info.memories) == 1
        assert (await mem.memory_stats("ana"))["entities"] == 1
    everything = b"".join(k + v for rows in raw_databases(store_path).values() for k, v in rows)
    assert b"Zebulon" not in everything


async def test_a_name_only_a_forgotten_sessions_superseded_fact_held_goes(store_path) -> None:
    """A name said in a session whose fact was superseded by another session's: the fact
    version had left the log when it was superseded, so forget_session did not count its
    position among those gone, and the name stayed in the registry (and in the file), an
    entity pointing at nothing."""
    async with open_engine(store_path) as mem:
        await mem.add_turn("u", "s1", "user", "my name is Zqfoobar")
        await mem.flush()
        await mem.add_turn("u", "s2", "user", "my name is Quxwell")
        await mem.flush()
        assert "Zqfoobar" in {e.name for e in await mem.list_entities("u")}
        await mem.forget_session("u", "s1")
        await mem.flush()
        assert await mem.entity_info("u", "Zqfoobar") is None
        assert "Zqfoobar" not in {e.name for e in await mem.list_entities("u")}
        assert await mem.entity_info("u", "Quxwell") is not None
    everything = b"".join(k + v for rows in raw_databases(store_path).values() for k, v in rows)
    assert b"Zqfoobar" not in everything and b"zqfoobar" not in everything


async def test_a_name_only_a_deleted_note_held_goes_with_it(store_path) -> None:
    """delete_note (and forget_scope's notes, and the reflections forget_session deletes)
    never touched the entity registry: a name only the note held stayed in list_entities
    and entity_info, pointing at the deleted note, and in the file after flush."""
    async with open_engine(store_path) as mem:
        await mem.add_turn("u", "s0", "user", "I flew to Berlin today")
        await mem.flush()
        note = await mem.store_note("u", "The user met Zqnoteonlyx in Berlin.")
        await mem.store_note("u", "Scoped note about Zqscopedabc.", agent_id="a1")
        await mem.flush()
        assert {"Zqnoteonlyx", "Zqscopedabc"} <= {e.name for e in await mem.list_entities("u")}
        await mem.delete_note("u", note.note_id)
        await mem.forget_scope("u", agent_id="a1")
        await mem.flush()
        names = {e.name for e in await mem.list_entities("u")}
        assert not names & {"Zqnoteonlyx", "Zqscopedabc"}
        assert await mem.entity_info("u", "Zqnoteonlyx") is None
        assert (await mem.entity_info("u", "Berlin")).entity.last_id != note.note_id
    everything = b"".join(k + v for rows in raw_databases(store_path).values() for k, v in rows)
    assert b"Zqnoteonlyx" not in everything and note.note_id.encode() not in everything


async def test_the_entity_leg_searches_only_what_the_filters_admit(mem) -> None:
    """The entity leg takes the recall's filters inside the leg, as the others do: memories of
    other sessions, times, roles or kinds naming the entity take no place in its ranking (they
    were ranked, then dropped after fusion, so a memory the filter admits showed a worse rank
    and a score normalised over memories it could never be shown beside)."""
    wanted = await mem.add_turn("ana", "trip", "user", "Tomás drove us to the crag.")
    await mem.add_turn("ana", "trip", "assistant", "Sounds like a good day out.")
    for i in range(6):  # later: the leg ranks equal scores newest first
        await mem.add_turn("ana", "elsewhere", "user", f"Tomás called about the rope, day {i}.")
    for i in range(40):  # the entity stays rare among the user's memories
        await mem.add_turn("ana", "other", "user", f"A note about nothing much, number {i}.")
    await mem.flush()
    for filters in ({"session_id": "trip"}, {"kinds": ["turn"], "session_id": "trip"}):
        hits = await mem.recall("ana", "tomás", legs=["entity"], **filters)
        assert (hits[0].id, hits[0].explain.ranks) == (wanted.turn_id, {"entity": 1}), (
            filters, [(h.text, h.explain.ranks) for h in hits])
    hits = await mem.recall("ana", "tomás", legs=["entity"], roles=["assistant"])
    assert not [h for h in hits if "entity" in h.explain.ranks]
