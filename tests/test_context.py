"""What a prompt is given about a user: the semantic section's source counts, and the context
for a new session (seed 004's injection, in seed 002's shape)."""

from __future__ import annotations

from .conftest import open_engine


async def test_sources_count_conversations_not_turns(store_path, clock) -> None:
    """A fact said three times in one session and once in another comes from 2
    conversations, not 4 (seed 001's "(sources: N conversations)")."""
    async with open_engine(store_path, clock=clock) as mem:
        for text in ("I love jazz.", "Honestly, I love jazz.", "I really love jazz."):
            await mem.add_turn("maya", "s1", "user", text)
        await mem.add_turn("maya", "s2", "user", "I love jazz, still.")
        await mem.add_turn("maya", "s2", "user", "I'm allergic to peanuts.")
        await mem.flush()
        raw = await mem.retrieve_memory_raw("maya", "jazz music")
        text = await mem.retrieve_memory("maya", "jazz music")
    (jazz,) = [f for f in raw.semantic if f.fact == "Likes jazz"]
    assert len(jazz.source_episodic_ids) == 4 and jazz.conversations == 2
    assert "- [preference] Likes jazz (sources: 2 conversations)" in text
    assert "- [constraint] Allergic to peanuts (sources: 1 conversation)" in text
