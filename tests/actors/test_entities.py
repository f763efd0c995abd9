"""The Entities actor: extraction, the registry with aliases, links, and forgetting.

Driven bare over a real Store (tests/actors/ground.py); entity_info, the entity leg of recall
and the engine's forgetting are tested through the engine in tests/test_entities_in_engine.py.
"""

from __future__ import annotations

import unicodedata
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
import trio.testing

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
    # The demo showed "Pixel (person)" beside the fact "Has a dog called Pixel": a name right
    # after the animal it is (or "called", "named") is a pet.
    ("Also, my dog Pixel is coming with me to Lisbon.", [("Pixel", "pet"), ("Lisbon", "place")]),
    ("We adopted a cat called Miso and their puppy, Biscuit.",
     [("Miso", "pet"), ("Biscuit", "pet")]),
    ("Our horse named Storm Chaser won.", [("Storm Chaser", "pet")]),
    # An animal word before a name is no cue unless the animal is someone's or called so.
    ("I gave the dog Emma's old blanket.", [("Emma", "person")]),
    ("I fed the cat Sarah brought home.", [("Sarah", "person")]),
    ("Is it ok to pet Anna's cat?", [("Anna", "person")]),
    # The fact rules' own texts ("Lives in Lisbon", "Works at Acme") are searchable records
    # too: the inspector showed "Lives" as a person. Their first words are never names.
    ("Lives in Lisbon", [("Lisbon", "place")]),
    ("Works at Acme Labs.", [("Acme Labs", "place")]),
    ("Prefers Earl Grey. Speaks Portuguese. Allergic to peanuts. Comes from Porto.",
     [("Earl Grey", "person"), ("Porto", "place")]),
    ("Usually walks Pixel at seven. Favourite cafe: Bettina.",
     [("Pixel", "person"), ("Bettina", "person")]),
])
def test_entities_are_extracted_by_kind(text, expected) -> None:
    """Mentions, hashtags, emails, URLs, dates and capitalised names; sentence starters and
    pleasantries are not names."""
    assert extract_entities(text) == expected


def test_a_decomposed_name_is_the_name_composed() -> None:
    """Text typed decomposed (NFD: a letter, then its accent as a combining mark) names what
    the composed text names: 'São Paulo' was the place 'Sa' and the person 'Paulo'."""
    text = "José and Zoë moved to São Paulo."
    expected = [("José", "person"), ("Zoë", "person"), ("São Paulo", "place")]
    assert extract_entities(text) == expected
    assert extract_entities(unicodedata.normalize("NFD", text)) == expected


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


async def test_a_name_first_guessed_a_person_becomes_the_pet_a_later_turn_says_it_is(
        store_path) -> None:
    """A capitalised name with no cue is taken for a person; a later "my dog Pixel" says what
    it is, and the registry keeps the better word. A cue never turns a pet back."""
    async with running_entities(store_path) as (ground, entities):
        for text in ("Pixel loves the beach.", "My dog Pixel is coming with me.",
                     "Pixel slept all day."):
            await ground.add_turn("maya", "s1", text)
        await flush(ground, entities)
        found = await registry(ground, "maya", "pixel")
    assert found["pixel"].type == "pet"
    assert found["pixel"].mentions == 3


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


class CountingReads:
    """Counts the registry reads through the store (``read_entities``: the follower's, the
    lookups', the tests'); ``hold``, when set, is awaited after the next such read and before
    it returns (a change may land meanwhile)."""

    def __init__(self, monkeypatch, store) -> None:
        self.count = 0
        self.hold: trio.Event | None = None
        read = store.read

        async def counting(fn, *args):
            found = await read(fn, *args)
            if fn is store_mod.read_entities:
                self.count += 1
                hold, self.hold = self.hold, None
                if hold is not None:
                    await hold.wait()
            return found

        monkeypatch.setattr(store, "read", counting)


async def test_a_lookup_is_kept_until_a_step_changes_the_registry(store_path, monkeypatch) -> None:
    """The entity leg's lookups come from RAM once read, the same as a read gives them (an
    alias's target included); a new mention, once its step is committed, is seen."""
    async with running_entities(store_path) as (ground, entities):
        await ground.add_turn("ana", "s", "Maya Lindqvist moved to Lisbon.")
        await ground.add_turn("ana", "s", "Maya loves trams.")
        await flush(ground, entities)
        reads = CountingReads(monkeypatch, ground.store)
        names = ["lisbon", "maya", "nobody"]
        first = await entities.lookup("ana", names)
        assert first == await registry(ground, "ana", *names) and reads.count == 2
        assert set(first) == {"lisbon", "maya", "maya lindqvist"}
        assert await entities.lookup("ana", names) == first and reads.count == 2  # from RAM
        assert await entities.lookup("ana", ["lisbon"]) == {"lisbon": first["lisbon"]}
        assert reads.count == 2
        later = await ground.add_turn("ana", "s", "Back in Lisbon with Maya.")
        await flush(ground, entities)
        again = await entities.lookup("ana", names)
        assert reads.count == 4  # the follower's step read the registry, then this lookup
        assert again == await registry(ground, "ana", *names)
        assert again["lisbon"].mentions == 2 and again["lisbon"].lsns[-1] == later
        assert again["maya lindqvist"].mentions == 3


async def test_a_lookup_read_while_the_registry_changed_is_not_kept(store_path,
                                                                   monkeypatch) -> None:
    """A lookup whose read a step committed after (or a forget) answers what it read but
    keeps nothing: the next lookup reads the registry as it is."""
    async with running_entities(store_path) as (ground, entities):
        await ground.add_turn("ana", "s1", "Zebulon visited Reykjavik.")
        await flush(ground, entities)
        reads = CountingReads(monkeypatch, ground.store)
        hold = reads.hold = trio.Event()
        old: dict = {}

        async def look() -> None:
            old.update(await entities.lookup("ana", ["reykjavik"]))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(look)
            await trio.testing.wait_all_tasks_blocked()
            await ground.add_turn("ana", "s2", "Reykjavik was cold.")
            await flush(ground, entities)  # the step commits while the lookup holds its read
            hold.set()
        assert old["reykjavik"].mentions == 1
        assert (await entities.lookup("ana", ["reykjavik"]))["reykjavik"].mentions == 2
        assert reads.count == 3  # the held lookup, the follower's step, this lookup
        # A forget scrubs the registry; the engine then drops what was kept.
        await ground.store.forget("ana", "s1")
        entities.forget("ana")
        assert await entities.lookup("ana", ["zebulon", "reykjavik"]) == await registry(
            ground, "ana", "zebulon", "reykjavik")
        assert "zebulon" not in await entities.lookup("ana", ["zebulon"])
        assert len((await entities.lookup("ana", ["reykjavik"]))["reykjavik"].lsns) == 1


async def test_a_reader_keeps_no_lookup(store_path, monkeypatch) -> None:
    """Entities made for a reader (its store's owner writes the registry out of its sight)
    reads every lookup."""
    async with running_store(store_path) as ground:
        entities = Entities(ground.store, cache_records=False)
        reads = CountingReads(monkeypatch, ground.store)
        for _ in range(3):
            assert await entities.lookup("ana", ["lisbon"]) == {}
        assert reads.count == 3
