"""Fact extraction through the engine: a plugged-in Extractor, its failures, and text in other
languages, which is stored and searchable whether or not a rule extracts from it."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from actors.base.keys import MAX_ID_BYTES
from engine import Candidate, Engine, Extractor, InvalidInput, RuleExtractor

from .conftest import open_engine


class PetExtractor:
    """A stand-in for spaCy or a model: finds what the rules do not ("Kiwi the parrot")."""

    name = "pets"

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def extract(self, text: str) -> Sequence[Candidate]:
        self.seen.append(text)
        if "Kiwi" not in text:
            return []
        return [Candidate("pet", "parrot:kiwi", "Kiwi", "Has a parrot called Kiwi", 0.9, 0.6),
                Candidate("pet", "", "nameless", "dropped: no key", 0.9, 0.6),
                Candidate("pet", "x", "y", "dropped: confidence over 1", 1.5, 0.6),
                "not a candidate"]


class GarbageExtractor:
    """A model that answers garbage: keys too long for a store key once in UTF-8, NULs (the
    key separator), lone surrogates (no UTF-8 at all), among one good fact."""

    name = "garbage"

    async def extract(self, text: str) -> Sequence[Candidate]:
        if "Kiwi" not in text:
            return []
        return [Candidate("pet", "\U0001F99C" * 128, "Kiwi", "A key of 512 bytes", 0.9, 0.6),
                Candidate("pet", "a\x00b", "Kiwi", "A NUL in the key", 0.9, 0.6),
                Candidate("pe\x00t", "k", "v", "A NUL in the category", 0.9, 0.6),
                Candidate("pet", "bird", "Ki\ud800wi", "A lone surrogate in the value", 0.9, 0.6),
                Candidate("pet", "song", "v", "A lone surrogate in the text\udfff", 0.9, 0.6),
                Candidate("pet", "parrot:kiwi", "Kiwi", "Has a parrot called Kiwi", 0.9, 0.6,
                          ("\ud800", "x\x00", "parrot"))]


class BrokenExtractor:
    name = "broken"

    async def extract(self, text: str) -> Sequence[Candidate]:
        raise RuntimeError("the model server is down")


async def test_a_plugged_in_extractor_is_what_the_engine_extracts_with(store_path, clock) -> None:
    """The follower gives every user turn to the caller's extractor; its facts carry its name
    as their origin, and whatever it returns that is not a valid candidate is dropped."""
    extractor = PetExtractor()
    assert isinstance(extractor, Extractor)
    async with open_engine(store_path, clock=clock, extractor=extractor) as mem:
        await mem.add_turn("ana", "s1", "user", "Kiwi the parrot sings all morning.")
        await mem.add_turn("ana", "s1", "assistant", "Kiwi sounds lovely.")
        await mem.add_turn("ana", "s1", "user", "I live in Lisbon.")
        await mem.flush()
        profile = await mem.profile("ana")
    assert [(f.category, f.key, f.value, f.origin) for f in profile] == [
        ("pet", "parrot:kiwi", "Kiwi", "pets")]
    # Only user turns, in log order; the rules did not run (no Lisbon).
    assert extractor.seen == ["Kiwi the parrot sings all morning.", "I live in Lisbon."]


async def test_what_an_extractor_returns_never_fails_a_write(store_path, clock) -> None:
    """An extractor's candidates meet the rules a caller's facts do: a key cut to what a store
    key holds (and then forgettable like any other), a candidate with a NUL in its category or
    key or no UTF-8 in its text dropped, bad keywords left out. Before, such a fact was refused
    by the store and every caller's flush() raised RecordRefused for a write it never made."""
    async with open_engine(store_path, clock=clock, extractor=GarbageExtractor()) as mem:
        await mem.add_turn("bo", "s1", "user", "Nothing to see.")
        await mem.add_turn("ana", "s1", "user", "Kiwi the parrot sings all morning.")
        await mem.add_turn("bo", "s1", "user", "Still nothing.")
        await mem.flush()
        assert await mem.failures() == []
        profile = {f.key: f for f in await mem.profile("ana")}
        long_key = next(k for k in profile if k.startswith("\U0001F99C"))
        assert len(long_key.encode()) <= MAX_ID_BYTES
        assert set(profile) == {"parrot:kiwi", long_key}
        assert profile["parrot:kiwi"].keywords == ("parrot",)
        assert await mem.forget_fact("ana", "pet", long_key)
        assert [t.text for t in await mem.session_history("bo", "s1")] == [
            "Nothing to see.", "Still nothing."]


async def test_the_rules_stand_in_for_an_extractor_that_fails(store_path, clock) -> None:
    """A failing extractor costs nothing the rules would have found, and the engine goes on."""
    async with open_engine(store_path, clock=clock, extractor=BrokenExtractor()) as mem:
        await mem.add_turn("ana", "s1", "user", "My sister Ana lives in Porto. I'm allergic to "
                                                "peanuts.")
        await mem.flush()
        found = {(f.key, f.origin) for f in await mem.profile("ana")}
    assert found == {("sister:ana", "rules"), ("allergy:peanuts", "rules")}


async def test_an_extractor_failing_on_every_turn_is_logged_in_a_few_lines(
        store_path, clock, caplog) -> None:
    """An extractor down (a provider outage, an API key revoked: the LLM's auth pause makes
    every call fail at once) logged one warning per user turn, so a busy bot wrote thousands
    of identical lines a minute. The first failure is logged, then a count now and then; each
    turn's failure is still kept as its failure record."""
    caplog.set_level("WARNING", logger="engram.facts")
    async with open_engine(store_path, clock=clock, extractor=BrokenExtractor()) as mem:
        await mem.add_turns([{"user_id": "ana", "session_id": "s1", "role": "user",
                              "text": f"I went to the market, day {i}."} for i in range(200)])
        await mem.flush()
        failures = [f for f in await mem.failures("ana") if f.actor == "facts"]
    lines = [r for r in caplog.records if r.name == "engram.facts"]
    assert len(failures) == 200
    assert 1 <= len(lines) <= 3, [r.getMessage() for r in lines]
    assert "the model server is down" in lines[0].getMessage()


async def test_the_default_extractor_is_the_rules(mem) -> None:
    """Without an extractor or an LLM, the offline rules extract: preferences, instructions,
    relations and pets each land in their own category."""
    for text in ("I'd rather have tea than coffee.", "Don't use emojis.",
                 "My sister Ana called.", "My dog Pixel is coming with me."):
        await mem.add_turn("maya", "s1", "user", text)
    await mem.flush()
    found = {(f.category, f.key, f.text, f.origin) for f in await mem.profile("maya")}
    assert found == {
        ("preference", "likes:tea", "Would rather have tea than coffee", "rules"),
        ("instruction", "use emojis", "Never use emojis", "rules"),
        ("relationship", "sister:ana", "Their sister is called Ana", "rules"),
        ("pet", "dog:pixel", "Has a dog called Pixel", "rules"),
    }


async def test_two_friends_are_two_facts_and_a_new_partner_replaces_the_old(mem) -> None:
    """People one may have several of keep one fact each; a partner's new name supersedes."""
    for text in ("My friend Tom is a chef.", "My friend Sara is a pilot.",
                 "My partner is called Luis.", "My partner is called Marta."):
        await mem.add_turn("maya", "s1", "user", text)
    await mem.flush()
    active = {(f.key, f.value) for f in await mem.profile("maya", category="relationship")}
    assert active == {("friend:tom", "Tom"), ("friend:sara", "Sara"), ("partner", "Marta")}
    assert [f.value for f in await mem.fact_history("maya", "relationship", "partner")] == [
        "Luis", "Marta"]


@pytest.mark.parametrize("extractor", [object(), RuleExtractor, type("NoName", (), {
    "name": "", "extract": lambda self, text: []})()])
async def test_open_refuses_what_is_not_an_extractor(store_path, extractor) -> None:
    """Something without a name and an extract method is refused before anything opens."""
    with pytest.raises(InvalidInput, match="expected an object with a non-empty str name") as e:
        async with Engine.open(store_path, extractor=extractor):
            pass
    assert e.value.field == "extractor"
    assert not store_path.exists()


async def test_text_in_other_languages_is_stored_and_found(mem) -> None:
    """Turns no rule understands are kept exactly and found by their words: accented Latin,
    Cyrillic and Greek alike; a rule in the speaker's language still extracts."""
    said = ["Amanhã vou à praia com a minha irmã, se não chover.",
            "Завтра будет дождь, возьми зонтик.",
            "Η θάλασσα ήταν πολύ ήρεμη σήμερα το πρωί.",
            "Me llamo Sofía y vivo en Madrid."]
    for text in said:
        await mem.add_turn("maya", "s1", "user", text)
    await mem.flush()
    assert [t.text for t in await mem.session_history("maya", "s1")] == said
    for query, expected in (("praia irmã", said[0]), ("зонтик", said[1]),
                            ("θάλασσα", said[2]), ("Sofía", said[3])):
        hits = await mem.recall("maya", query, limit=3, kinds=["turn"])
        assert hits[0].text == expected, query
        assert "bm25" in hits[0].via
    assert {(f.key, f.value) for f in await mem.profile("maya")} == {
        ("name", "Sofía"), ("location", "Madrid")}
