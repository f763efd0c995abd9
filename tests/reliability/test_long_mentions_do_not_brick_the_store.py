"""A turn mentioning a very long URL, e-mail address or name (case 1 of issue 11) is taken in
by the entity registry under a bounded key; the engine keeps running and the store reopens."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import Engine

from ..conftest import open_engine

URL = "https://example.com/" + "a" * 600
EMAIL = "x" * 600 + "@example.com"
NAMES = " ".join(f"Word{chr(97 + i % 26)}x" for i in range(90))  # 90 Title-Case words in a row

CASES = [
    ("url", f"look at {URL} please", URL),
    ("email", f"write to {EMAIL} today", EMAIL),
    ("names", f"we met {NAMES} yesterday", NAMES),
]


@pytest.mark.parametrize(("kind", "text", "entity"), CASES, ids=[c[0] for c in CASES])
async def test_a_long_mention_is_registered_and_the_store_reopens(
        store_path: Path, kind: str, text: str, entity: str) -> None:
    """The mention is an entity (found by its full name); later turns are taken in; reopening
    with the long-term layer on works and still finds it."""
    async with open_engine(store_path) as mem:
        await mem.add_turn("ana", "s1", "user", text)
        await mem.add_turn("bo", "s1", "user", "a bystander's turn", durable=True)
        await mem.flush()
        assert await mem.entity_info("ana", entity) is not None
        await mem.add_turn("ana", "s1", "user", "after the long one", durable=True)
        await mem.flush()
        assert (await mem.stats()).committed_lsn == 3
    async with open_engine(store_path) as mem:
        await mem.add_turn("ana", "s1", "user", f"again: {text}")
        await mem.flush()
        hits = await mem.recall("ana", "after the long one", limit=5)
        assert any(h.text == "after the long one" for h in hits)
        history = await mem.session_history("ana", "s1")
        assert [t.text for t in history][-2:] == ["after the long one", f"again: {text}"]


async def test_entity_info_finds_a_long_url_by_its_full_text(mem: Engine) -> None:
    """The registry keeps the full value in the record: the full URL finds it, twice counted."""
    await mem.add_turn("ana", "s1", "user", f"see {URL}")
    await mem.add_turn("ana", "s1", "user", f"and {URL} again")
    await mem.flush()
    found = await mem.entity_info("ana", URL)
    assert found is not None
    assert (found.entity.name, found.entity.type, found.entity.mentions) == (URL, "url", 2)
    assert [m.text for m in found.memories] == [f"and {URL} again", f"see {URL}"]
