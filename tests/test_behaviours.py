"""Behaviours that run by themselves: consolidation when a new session starts (seed 004) and
the rolling session summary (seed 003)."""

from __future__ import annotations

from engine import RuleExtractor

from .conftest import open_engine


async def test_a_new_session_consolidates_the_earlier_ones(store_path, clock) -> None:
    """When a user's session s2 starts, s1's remaining turns become an episode at once (not
    after the idle timeout); another user's sessions and sessions begun later are left."""
    async with open_engine(store_path, clock=clock,
                           config={"consolidate_on_new_session": True}) as mem:
        for text in ("We planned the Lisbon move.", "The movers come on the 3rd.",
                     "Alfama flat has a view."):
            await mem.add_turn("maya", "s1", "user", text)
        await mem.add_turn("ana", "a1", "user", "Ana's own session goes on.")
        await mem.add_turn("ana", "a1", "user", "Still going.")
        await mem.flush()
        assert await mem.episodes("maya") == []
        await mem.add_turn("maya", "s2", "user", "New day, new topic: my dog Pixel.")
        await mem.flush()
        (episode,) = await mem.episodes("maya")
        assert (episode.session_id, episode.first_seq, episode.last_seq) == ("s1", 0, 2)
        assert episode.consolidated_at is not None
        assert await mem.episodes("ana") == []
        assert await mem.episodes("maya", "s2") == []


async def test_without_the_option_a_new_session_leaves_the_others(store_path, clock) -> None:
    """By default only close_session and maintenance consolidate."""
    async with open_engine(store_path, clock=clock) as mem:
        for text in ("We planned the Lisbon move.", "The movers come on the 3rd."):
            await mem.add_turn("maya", "s1", "user", text)
        await mem.add_turn("maya", "s2", "user", "Another day.")
        await mem.flush()
        assert await mem.episodes("maya") == []


async def test_the_rolling_summary_follows_the_session(store_path, clock) -> None:
    """Every summary_every_turns turns the session's summary is brought up to date with the
    epoch it read; a caller's newer summary is never overwritten by the background."""
    said = ["I'm moving to Lisbon in January with my partner Luis.",
            "We found a flat in Alfama with a view of the river.",
            "The movers are booked for the third of January.",
            "My dog Pixel will travel with us in the car.",
            "I still need to cancel the Berlin internet contract.",
            "Luis starts his new job in Lisbon in February.",
            "We want to learn Portuguese before we arrive.",
            "The flat needs new curtains and a bigger desk."]
    async with open_engine(store_path, clock=clock, config={"summary_every_turns": 4}) as mem:
        for text in said[:3]:
            await mem.add_turn("maya", "s1", "user", text)
        await mem.flush()
        assert await mem.session_summary("maya", "s1") is None
        await mem.add_turn("maya", "s1", "user", said[3])
        await mem.flush()
        first = await mem.session_summary("maya", "s1")
        assert (first.epoch, first.upper_seq) == (1, 4)
        assert first.summary == " ".join(said[:4])  # four sentences: all kept
        for text in said[4:]:
            await mem.add_turn("maya", "s1", "user", text)
        await mem.flush()
        second = await mem.session_summary("maya", "s1")
        assert (second.epoch, second.upper_seq) == (2, 8)
        kept = [s for s in said if s in second.summary]
        assert len(kept) == 5 and second.summary == " ".join(kept)  # five, in order
        # A caller writes a summary covering more; the background never goes back over it.
        assert await mem.write_session_summary("maya", "s1", "Mine.", 8, second.epoch)
        await mem.add_turn("maya", "s1", "assistant", "Good luck with the move!")
        await mem.flush()
        assert (await mem.session_summary("maya", "s1")).summary == "Mine."


async def test_a_late_background_summary_loses_to_a_newer_one(store_path, clock) -> None:
    """The background writes with the epoch it read: if a caller wrote meanwhile, its write
    is refused rather than overwriting (seed 003's compare-and-set)."""
    async with open_engine(store_path, clock=clock, config={"summary_every_turns": 2}) as mem:
        await mem.add_turn("maya", "s1", "user", "First thing said here today.")
        await mem.write_session_summary("maya", "s1", "Written first by the caller.", 1, 0)
        await mem.add_turn("maya", "s1", "user", "Second thing said here today.")
        await mem.flush()
        state = await mem.session_summary("maya", "s1")
        # The follower read epoch 1 (the caller's) and moved it on; it never lowered it.
        assert state.epoch == 2 and state.upper_seq == 2
        assert "Written first by the caller." in state.summary


async def test_a_new_session_updates_the_reflection_context_for_prompt_shows(store_path,
                                                                           clock) -> None:
    """With consolidation on a switch, the user's session reflection is rewritten from their
    recent facts and episodes (extractive: no LLM), and context_for_prompt shows it as the
    latest reflection; a later switch rewrites the same note."""
    async with open_engine(store_path, clock=clock,
                           config={"consolidate_on_new_session": True}) as mem:
        for text in ("My name is Maya and I live in Lisbon.", "I work as a nurse.",
                     "We planned the Lisbon move with the movers."):
            await mem.add_turn("maya", "s1", "user", text)
        await mem.flush()
        assert await mem.get_note("maya", "reflection-latest") is None
        await mem.add_turn("maya", "s2", "user", "New day, new topic: my dog Pixel.")
        await mem.flush()
        first = await mem.get_note("maya", "reflection-latest")
        assert first is not None and set(first.tags) == {"reflection", "session"}
        assert "Lisbon" in first.text and "Key moments" in first.text
        context = await mem.context_for_prompt("maya", "s3")
        assert "## Latest reflection" in context and "Lisbon" in context.split(
            "## Latest reflection")[1]
        await mem.add_turn("maya", "s2", "user", "Pixel is a beagle.")
        await mem.add_turn("maya", "s3", "user", "Back again.")
        await mem.flush()
        second = await mem.get_note("maya", "reflection-latest")
        assert second.updated_at > first.updated_at
        assert [n.note_id for n in await mem.list_notes("maya")] == ["reflection-latest"]


async def test_the_reflection_on_a_switch_is_the_models_when_there_is_one(store_path,
                                                                         clock) -> None:
    """Given an LLM, the reflection is its text; when it fails, the extractive one stands in."""

    class Model:
        def __init__(self) -> None:
            self.fail = False

        async def complete(self, system: str, prompt: str) -> str:
            if "reflection" not in system:
                return '{"facts": []}' if "facts" in system else (
                    '{"title": "Moving", "summary": "Maya moves to Lisbon.", "keywords": []}')
            if self.fail:
                raise RuntimeError("model down")
            assert "Lisbon" in prompt
            return "Maya is settling into Lisbon and cares about the move."

    model = Model()
    async with open_engine(store_path, clock=clock, llm=model, extractor=RuleExtractor(),
                           config={"consolidate_on_new_session": True}) as mem:
        for text in ("My name is Maya and I live in Lisbon.", "We planned the move."):
            await mem.add_turn("maya", "s1", "user", text)
        await mem.add_turn("maya", "s2", "user", "Hello again.")
        await mem.flush()
        note = await mem.get_note("maya", "reflection-latest")
        assert note.text == "Maya is settling into Lisbon and cares about the move."
        model.fail = True
        await mem.add_turn("maya", "s3", "user", "And again.")
        await mem.flush()
        assert "Lisbon" in (await mem.get_note("maya", "reflection-latest")).text
        assert (await mem.get_note("maya", "reflection-latest")).text != note.text
