"""Episodes as the engine serves them: found by recall, closed by close_session, consolidated
by maintenance on the trio clock, reviewed through retrieve_memory and review, ranked by
retrievability, and forgotten with their session (the actor alone: tests/actors/test_episodic.py)."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
import trio

from engine import InvalidInput

from .conftest import T0, StepClock, open_engine, raw_databases

TRIP = ["We booked the train to Porto for the festival in June.",
        "Great, the festival in Porto sounds fun. Did you find a hotel?",
        "Yes, a small hotel near the river, with a view of the bridges.",
        "Lovely. Remember to pack a raincoat, Porto is rainy in June."]
COOKING = ["I baked sourdough bread with rye flour this weekend.",
           "Rye sourdough is tricky, how did the crumb turn out?",
           "Dense but tasty, my starter needs more feeding before baking.",
           "Feed the starter twice a day and the bread will rise better."]


async def _session(mem, session: str, texts: list[str], turns: int) -> None:
    for i in range(turns):
        await mem.add_turn("ana", session, "user" if i % 2 == 0 else "assistant",
                           texts[i % len(texts)])


async def test_twenty_turns_make_an_episode_of_the_oldest_ten(store_path) -> None:
    """Seed 002's window: at 20 unepisoded turns the oldest 10 become an episode, linked to
    its turns and searchable; the turns stay searchable too."""
    async with open_engine(store_path, clock=StepClock()) as mem:
        await _session(mem, "trip", TRIP, 19)
        await mem.flush()
        assert await mem.episodes("ana") == []
        await _session(mem, "trip", TRIP, 1)
        await mem.flush()
        (episode,) = await mem.episodes("ana", "trip")
        turns = await mem.session_history("ana", "trip", limit=100)
        assert (episode.first_seq, episode.last_seq) == (0, 9)
        assert episode.turn_ids == tuple(t.turn_id for t in turns[:10])
        assert (episode.start_at, episode.end_at) == (turns[0].at, turns[9].at)
        sentences = re.split(r"(?<=[.!?]) ", episode.summary)
        assert 1 <= len(sentences) <= 3 and all(s in " ".join(TRIP) for s in sentences)
        assert "porto" in episode.keywords and episode.title
        assert episode.surprise == 0.5 and episode.stability > 0 and episode.consolidated_at is None
        links = await mem.links("ana", episode.episode_id)
        assert {link.to_id for link in links if link.type == "summarises"} == set(episode.turn_ids)
        hits = await mem.recall("ana", "hotel near the river in Porto", kinds=["episode"])
        assert [h.id for h in hits] == [episode.episode_id]
        assert hits[0].turn_ids == episode.turn_ids
        assert await mem.recall("ana", "hotel near the river", kinds=["turn"])
        await _session(mem, "trip", TRIP, 10)
        await mem.flush()
        assert [(e.first_seq, e.last_seq) for e in await mem.episodes("ana")] == [(0, 9), (10, 19)]


async def test_closing_a_session_makes_an_episode_of_the_rest(mem) -> None:
    """close_session consolidates the turns no episode covers yet, once."""
    await _session(mem, "cook", COOKING, 6)
    assert await mem.close_session("ana", "cook") is True
    assert await mem.close_session("ana", "cook") is False
    (episode,) = await mem.episodes("ana")
    assert (episode.first_seq, episode.last_seq) == (0, 5)
    assert episode.consolidated_at is not None
    with pytest.raises(InvalidInput, match=r"session_id: expected a session of user 'ana', found "
                                           r"none called 'nope'"):
        await mem.close_session("ana", "nope")


async def test_maintenance_consolidates_idle_sessions_on_the_trio_clock(store_path,
                                                                        mock_clock) -> None:
    """With maintenance every minute and sessions idle after ten, a quiet session becomes an
    episode as trio's clock runs on; nothing sleeps for a minute for real."""
    # The clock jumps whenever every task waits, worker threads included, so how far it has
    # run at a given line depends on the machine's load. The test therefore asks *when* the
    # episode was made (by its stamp, on the same clock), not whether it exists at a moment.
    mock_clock.autojump_threshold = 0.05

    def clock():
        return T0 + timedelta(seconds=trio.current_time())

    config = {"maintenance_seconds": 60, "session_idle_seconds": 600}
    async with open_engine(store_path, clock=clock, config=config) as mem:
        await _session(mem, "cook", COOKING, 4)
        await mem.flush()
        last_turn = (await mem.session_history("ana", "cook"))[-1].at
        episodes = []
        for _ in range(60):  # an hour of trio's clock, a maintenance pass every minute
            await trio.sleep(60)
            if episodes := await mem.episodes("ana"):
                break
        (episode,) = episodes
        assert episode.consolidated_at is not None and episode.last_seq == 3
        idle = (episode.consolidated_at - last_turn).total_seconds()
        assert 600 <= idle <= 600 + 2 * 60  # once idle, at the next pass or so, not before


async def test_surprise_measures_novelty_and_raises_stability(mem) -> None:
    """The same topic again is no surprise; a new topic is, and starts more stable."""
    for session, texts in (("trip1", TRIP), ("trip2", TRIP), ("bread", COOKING)):
        await _session(mem, session, texts, 4)
        await mem.close_session("ana", session)
    first, again, new = sorted(await mem.episodes("ana"), key=lambda e: e.created_at)
    assert first.surprise == 0.5
    assert again.surprise == 0.0 and new.surprise > 0.3
    assert new.stability > again.stability


async def test_a_pending_review_is_rated_by_the_next_assistant_turn(store_path) -> None:
    """retrieve_memory records what it showed; the reply that uses it rates it GOOD."""
    clock = StepClock(step=timedelta(days=1))  # a review on a later day: GOOD grows stability
    async with open_engine(store_path, clock=clock) as mem:
        await _session(mem, "trip", TRIP, 4)
        await mem.close_session("ana", "trip")
        (episode,) = await mem.episodes("ana")
        await mem.add_turn("ana", "chat", "user", "When is the Porto festival?")
        await mem.flush()
        shown = await mem.retrieve_memory_raw("ana", "Porto festival train", conversation_id="chat")
        item = next(i for i in shown.episodic if i.id == episode.episode_id)
        assert item.last_reviewed_at is None
        await mem.add_turn("ana", "chat", "assistant",
                           "You booked the train to Porto for the festival in June.")
        await mem.flush()
        after = await mem.retrieve_memory_raw("ana", "Porto festival train")
        rated = next(i for i in after.episodic if i.id == episode.episode_id)
    assert rated.last_reviewed_at is not None and rated.stability > item.stability
    pending = raw_databases(store_path)["pending"]
    assert [k for k, _ in pending] == [b"ana\x00"]  # the second, conversation-less retrieval


async def test_reviews_change_the_ranking_through_retrievability(store_path) -> None:
    """Two equal episodes: the one reviewed EASY stays retrievable and overtakes the other."""
    clock = StepClock(step=timedelta(seconds=1))
    async with open_engine(store_path, clock=clock) as mem:
        for session in ("a", "b"):
            await _session(mem, session, TRIP, 4)
            await mem.close_session("ana", session)
        await mem.flush()
        before = [h.id for h in await mem.recall("ana", "festival in Porto", kinds=["episode"])]
        clock.now += timedelta(days=10)
        state = await mem.review("ana", before[1], "easy")
        assert state.reps == 1 and state.last_review == clock.now - timedelta(seconds=1)
        clock.now += timedelta(days=10)
        after = await mem.recall("ana", "festival in Porto", kinds=["episode"])
    assert [h.id for h in after] == [before[1], before[0]]
    assert after[0].score > after[1].score


@pytest.mark.parametrize(("memory", "rating", "message"), [
    ("turn", "great", r"rating: expected again/hard/good/easy or 1-4, found 'great'"),
    ("fact", "good", r"memory_id: expected the id of an episode or turn of user 'ana'"),
])
async def test_review_arguments_are_checked(mem, memory, rating, message) -> None:
    """A bad rating, or a memory that does not follow FSRS, is refused with what was expected."""
    receipt = await mem.add_turn("ana", "s", "user", "hello there")
    fact = await mem.remember_fact("ana", "identity", "name", "Ana")
    memory_id = receipt.turn_id if memory == "turn" else fact.fact_id
    with pytest.raises(InvalidInput, match=message):
        await mem.review("ana", memory_id, rating)


async def test_forgetting_a_session_takes_its_episodes(store_path) -> None:
    """Episodes go with their session: the store, both indexes and review state."""
    async with open_engine(store_path) as mem:
        await _session(mem, "bread", COOKING, 4)
        await mem.close_session("ana", "bread")
        (episode,) = await mem.episodes("ana")
        await mem.review("ana", episode.episode_id, "good")
        await mem.forget_session("ana", "bread")
        await mem.flush()
        assert await mem.episodes("ana") == []
        assert await mem.recall("ana", "sourdough rye starter") == []
    everything = b"".join(k + v for rows in raw_databases(store_path).values() for k, v in rows)
    assert b"sourdough" not in everything and episode.episode_id.encode() not in everything


async def test_an_episode_spans_its_turns_times_whatever_their_order(store_path) -> None:
    """A late note (``at`` a month back) at the end of a session: the episode took its first
    and last turns' times in order of their seq, ended before it started, and prompts called
    today's conversation "4 weeks ago". It spans the earliest to the latest, as the session's
    listing does."""
    clock = StepClock(step=timedelta(seconds=0))
    async with open_engine(store_path, clock=clock) as mem:
        await mem.add_turn("ana", "trip", "user", "We booked the night train to Vienna.")
        await mem.add_turn("ana", "trip", "assistant", "The opera in Vienna sounds wonderful.")
        await mem.add_turn("ana", "trip", "user", "Note from last month: tickets were bought.",
                           at=T0 - timedelta(days=30))
        await mem.close_session("ana", "trip")
        await mem.flush()
        (episode,) = await mem.episodes("ana")
        assert (episode.start_at, episode.end_at) == (T0 - timedelta(days=30), T0)
        hits = await mem.recall("ana", "Vienna opera", kinds=["episode"],
                                since=T0 - timedelta(hours=1))
        assert [h.id for h in hits] == [episode.episode_id]
        assert "4 weeks ago" not in await mem.context_for_prompt("ana", "other")


async def test_a_turn_hits_context_spans_its_turns_times_whatever_their_order(
        store_path) -> None:
    """retrieve_memory_raw's item for a turn hit took its context's first and last times in
    seq order: a late note after it made the item end before it started."""
    async with open_engine(store_path, clock=lambda: T0 + timedelta(days=1),
                           config={"long_term": False}) as mem:
        await mem.add_turn("ana", "s1", "user", "my red bicycle got a flat", at=T0)
        await mem.add_turn("ana", "s1", "user", "note: bought the red bicycle",
                           at=T0 - timedelta(days=30))
        await mem.flush()
        raw = await mem.retrieve_memory_raw("ana", "red bicycle", record=False)
        assert raw.episodic and all(i.start_at <= i.end_at for i in raw.episodic)
