"""The Entities actor: extraction, the registry with aliases, links, and forgetting.

Driven bare over a real Store (tests/actors/ground.py); entity_info, the entity leg of recall
and the engine's forgetting are tested through the engine in tests/test_entities_in_engine.py.
"""

from __future__ import annotations

import pytest

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import actors.store as store_mod
from actors.entities import Entities, extract_entities

from ..conftest import raw_databases
from .ground import Ground, running_store


@asynccontextmanager
async def running_entities(path: Path) -> AsyncIterator[tuple[Ground, Entities]]:
    """A store at ``path`` and the entities follower on its log, both running."""
    async with running_store(path) as ground:
        entities = Entities(ground.store)
        await ground.start(entities.follower.run)
        yield ground, entities


async def flush(ground: Ground, entities: Entities) -> None:
    """Wait until everything queued is committed and the follower has filed it."""
    await ground.store.wait_written()
    await entities.follower.wait(ground.store.committed_lsn)


async def registry(ground: Ground, user_id: str, *names: str) -> dict:
    """The user's registry records under these lower-case keys (and what aliases point to)."""
    return await ground.store.read(store_mod.read_entities, user_id, list(names))


@pytest.mark.parametrize(("text", "expected"), [
    ("My name is Maya Lindqvist and I live in Lisbon now.",
     [("Maya Lindqvist", "person"), ("Lisbon", "place")]),
    ("Email me at maya@example.com or see https://maya.dev/cv. #pottery @tomas",
     [("maya@example.com", "email"), ("https://maya.dev/cv", "url"), ("@tomas", "mention"),
      ("#pottery", "hashtag")]),
    ("Ines and Tomás flew to New York on March 3rd, 2026.",
     [("March 3rd, 2026", "date"), ("Ines", "person"), ("Tomás", "person"),
      ("New York", "place")]),
    ("Thanks! Sounds good. I will.", []),
    # A word alone in its sentence is an acknowledgement, not a name (the inspector showed
    # "Noted" as a person); a run of capitals is cut at words that are never names.
    ("Noted (1).", []),
    ("Done! Noted.", []),
    ("Hi Marta We went to the market on Tuesdays The stalls were busy",
     [("Marta", "person")]),
    ("Pixel is a border collie.", [("Pixel", "person")]),
])
def test_entities_are_extracted_by_kind(text, expected) -> None:
    """Mentions, hashtags, emails, URLs, dates and capitalised names; sentence starters and
    pleasantries are not names."""
    assert extract_entities(text) == expected


async def test_a_first_name_is_an_alias_of_the_full_name(store_path) -> None:
    """'Maya' after 'Maya Lindqvist' counts for the same entity, filed under the full name with
    the first name pointing to it; another user's registry is untouched."""
    async with running_entities(store_path) as (ground, entities):
        first = await ground.add_turn("ana", "s", "Maya Lindqvist, an old friend, moved to Lisbon.")
        second = await ground.add_turn("ana", "s", "maya sent a postcard. Maya loves trams.")
        third = await ground.add_turn("ana", "s2", "Dinner with Maya on Friday.")
        await flush(ground, entities)
        found = await registry(ground, "ana", "maya")
        assert found["maya"].type == "alias" and found["maya"].aliases == ("maya lindqvist",)
        entity = found["maya lindqvist"]
        assert entity.name == "Maya Lindqvist"
        assert entity.type == "person" and entity.mentions == 3
        assert "Maya" in entity.aliases
        assert entity.lsns == (first, second, third)
        assert {"maya", "maya lindqvist"} <= await entities.keys("ana")
        assert await registry(ground, "ana", "nobody") == {}
        assert await registry(ground, "bob", "maya") == {}  # another user's registry is empty


async def test_memories_sharing_an_entity_are_linked(store_path) -> None:
    """A later mention links to the previous memory that mentioned the same entity."""
    async with running_entities(store_path) as (ground, entities):
        a = await ground.add_turn("ana", "s1", "Tomás is my climbing partner.")
        await ground.add_turn("ana", "s1", "The weather was grey all week.")
        b = await ground.add_turn("ana", "s2", "Booked a gym session with Tomás for Monday.")
        await flush(ground, entities)
        links = await ground.store.read(store_mod.read_links, "ana", [f"t{b}"])
    assert [(link.from_id, link.to_id, link.type) for link in links[f"t{b}"]] == [
        (f"t{b}", f"t{a}", "shares_entity")]


async def test_forgetting_removes_entities(store_path) -> None:
    """A forgotten session's mentions leave the registry; an entity only it mentioned goes."""
    async with running_entities(store_path) as (ground, entities):
        await ground.add_turn("ana", "s1", "Zebulon visited Reykjavik.")
        await ground.add_turn("ana", "s2", "Reykjavik was cold.")
        await flush(ground, entities)
        assert "zebulon" in await entities.keys("ana")
        await ground.store.forget("ana", "s1")
        entities.forget("ana")
        await flush(ground, entities)
        assert await registry(ground, "ana", "zebulon") == {}
        assert len((await registry(ground, "ana", "reykjavik"))["reykjavik"].lsns) == 1
        assert await ground.store.read(store_mod.read_entity_keys, "ana") == ["reykjavik"]
        assert await entities.keys("ana") == {"reykjavik"}
    everything = b"".join(k + v for rows in raw_databases(store_path).values() for k, v in rows)
    assert b"Zebulon" not in everything
