"""What a chat user can type against the long-term layer (fact rules, episodes, entities,
maintenance, the LLM's replies): each hostile turn may cost its own derived memories, never a
follower, another user's memories, the loop's responsiveness, or a store that verifies."""

from __future__ import annotations

import random
import time
from pathlib import Path

from actors.base.config import Config
from actors.entities import MAX_ALIASES
from actors.extraction import MAX_CANDIDATES, extract_facts
from engine import Engine

from .conftest import open_engine

MAX_TEXT = Config().max_text_chars
BOUND = 5.0  # seconds of wall time for what took tens of seconds before its fix


def _at_length(unit: str, length: int = MAX_TEXT) -> str:
    return (unit * (length // len(unit) + 1))[:length]


async def _verified(path: Path) -> None:
    report = await Engine.verify(path)
    assert report["ok"], report["problems"]


def test_one_turn_of_rule_bait_gives_at_most_max_candidates_facts() -> None:
    """Thousands of "I like ..." sentences in one turn are at most MAX_CANDIDATES facts (2,207
    before), the first ones said; a later correction of a key already taken still wins."""
    text = " ".join(f"I like zq{i}." for i in range(4_000))[:MAX_TEXT]
    found = extract_facts("I live in Porto. " + text + " I live in Lisbon.")
    assert len(found) == MAX_CANDIDATES
    assert ("likes:zq0", "likes") in {(c.key, c.value) for c in found}
    assert ("location", "Lisbon") in {(c.key, c.value) for c in found}


async def test_a_flood_of_facts_in_turns_does_not_stall_the_followers(store_path) -> None:
    """Two 32,000-character turns of distinct likes: flush returns in seconds (15 s, then 45 s
    before: every fact compared with every active one), the profile stays bounded, another
    user's profile is untouched and the store verifies."""
    async with open_engine(store_path) as mem:
        await mem.add_turn("bob", "s", "user", "I live in Lisbon.")
        for prefix in ("zq", "zr"):
            text = " ".join(f"I like {prefix}{i}." for i in range(4_000))[:MAX_TEXT]
            await mem.add_turn("eve", "s", "user", text)
            start = time.perf_counter()
            await mem.flush()
            assert time.perf_counter() - start < BOUND
        assert len(await mem.profile("eve")) <= 2 * MAX_CANDIDATES
        assert [(f.key, f.value) for f in await mem.profile("bob")] == [("location", "Lisbon")]
    await _verified(store_path)


async def test_case_variants_of_one_entity_do_not_grow_its_record(store_path) -> None:
    """A URL (or an address, hashtag, handle) typed in a new mix of cases each turn is one entity whose
    aliases stay bounded (before: every spelling kept, a 3,000-character URL in 1,000 turns made
    a 3 MB registry record rewritten at every step, and without end)."""
    rng = random.Random(7)
    base = "https://example.com/" + "a" * 300

    def spelt() -> str:
        return "".join(c.upper() if rng.random() < 0.5 else c for c in base)

    async with open_engine(store_path) as mem:
        await mem.add_turns([{"user_id": "eve", "session_id": "s", "role": "user",
                              "text": f"see {spelt()}"}
                             for _ in range(200)])
        await mem.flush()
        info = await mem.entity_info("eve", base)
        assert info is not None and info.entity.mentions >= 200  # and the episodes
        assert len(info.entity.aliases) <= MAX_ALIASES
    await _verified(store_path)
