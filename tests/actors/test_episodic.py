"""The EpisodicCompressor actor: compression at 20 turns, consolidation, surprise, the review of
what a retrieval showed, and FSRS.

Driven bare over a real Store (tests/actors/ground.py): its follower reads the turns appended
to the log; the sentence vectors it asks for and the nearest earlier episode it looks up come
from ground.py's hash embedding (what the engine's embedder and vector index give it with the
HashEmbedder). Recall, close_session, maintenance, review and forgetting through the engine
are in tests/test_episodes_in_engine.py.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import trio

import actors.store as store_mod
from actors.base.config import Config
from actors.base.messages import AppendTurn, PutState
from actors.base.records import Episode, PendingReview, Turn
from actors.episodic import EpisodicCompressor, content_words
from actors.base.ids import derived_id

from ..conftest import T0, StepClock
from .ground import Ground, hash_vectors, running_store

TRIP = ["We booked the train to Porto for the festival in June.",
        "Great, the festival in Porto sounds fun. Did you find a hotel?",
        "Yes, a small hotel near the river, with a view of the bridges.",
        "Lovely. Remember to pack a raincoat, Porto is rainy in June."]
COOKING = ["I baked sourdough bread with rye flour this weekend.",
           "Rye sourdough is tricky, how did the crumb turn out?",
           "Dense but tasty, my starter needs more feeding before baking.",
           "Feed the starter twice a day and the bread will rise better."]


class HashVectors:
    """The vectors the compressor asks for, without the embedder or the vector index: its
    sentences' vectors (the embedder's background lane), and the nearest of the user's stored
    episodes (the vector index, which holds each episode's searchable text embedded), both by
    ground.py's hash embedding. Holds episodes only, so every search is an episode search."""

    embedded_lsn = 0  # the compressor is told vectors do not follow: it never waits on this

    def __init__(self, store: store_mod.Store) -> None:
        self.store = store

    async def embed(self, texts: list[str], *, query: bool = True) -> np.ndarray:
        await trio.lowlevel.checkpoint()
        return hash_vectors(texts)

    async def search(self, user_id: str, vector: np.ndarray, k: int, filters: Any = None
                     ) -> list[tuple[int, float]]:
        episodes = await self.store.read(store_mod.read_episodes, user_id, None)
        records = await self.store.read(store_mod.read_searchables, [e.lsn for e in episodes])
        if not records:
            return []
        scores = hash_vectors([r.text for r in records]) @ vector
        return [(records[i].lsn, float(scores[i])) for i in np.argsort(-scores)[:k]]


@asynccontextmanager
async def running_compressor(path: Path, clock: Callable[[], datetime] | None = None
                             ) -> AsyncIterator[tuple[Ground, EpisodicCompressor]]:
    """A store at ``path`` and the compressor's follower on its log, both running, with the
    engine's default window (Config: 20 turns, the newest 10 kept)."""
    config = Config()
    async with running_store(path) as ground:
        vectors = HashVectors(ground.store)
        compressor = EpisodicCompressor(
            ground.store, vectors, vectors, clock or StepClock(),
            after_turns=config.episode_after_turns, keep_turns=config.episode_keep_turns,
            vectors_follow=False, summary_every=config.summary_every_turns)
        await ground.start(compressor.follower.run)
        yield ground, compressor


async def flush(ground: Ground, compressor: EpisodicCompressor) -> None:
    """Wait until everything queued is committed and the follower has taken it in."""
    await ground.store.wait_written()
    await compressor.follower.wait(ground.store.committed_lsn)


async def _session(ground: Ground, session: str, texts: list[str], turns: int) -> None:
    for i in range(turns):
        await ground.add_turn("ana", session, texts[i % len(texts)],
                              role="user" if i % 2 == 0 else "assistant")


async def episodes(ground: Ground, user_id: str, session_id: str | None = None
                   ) -> list[Episode]:
    return await ground.store.read(store_mod.read_episodes, user_id, session_id)


async def test_twenty_turns_make_an_episode_of_the_oldest_ten(store_path) -> None:
    """Seed 002's window: at 20 unepisoded turns the oldest 10 become an episode, linked to
    its turns; ten more make the next."""
    async with running_compressor(store_path) as (ground, compressor):
        await _session(ground, "trip", TRIP, 19)
        await flush(ground, compressor)
        assert await episodes(ground, "ana") == []
        await _session(ground, "trip", TRIP, 1)
        await flush(ground, compressor)
        (episode,) = await episodes(ground, "ana", "trip")
        turns = await ground.store.read(store_mod.read_session_turns, "ana", "trip", 0, 2**63)
        assert (episode.first_seq, episode.last_seq) == (0, 9)
        assert episode.turn_ids == tuple(t.turn_id for t in turns[:10])
        assert (episode.start_at, episode.end_at) == (turns[0].at, turns[9].at)
        sentences = re.split(r"(?<=[.!?]) ", episode.summary)
        assert 1 <= len(sentences) <= 3 and all(s in " ".join(TRIP) for s in sentences)
        assert "porto" in episode.keywords and episode.title
        assert episode.surprise == 0.5 and episode.stability > 0 and episode.consolidated_at is None
        links = (await ground.store.read(store_mod.read_links, "ana",
                                         [episode.episode_id]))[episode.episode_id]
        assert {link.to_id for link in links if link.type == "summarises"} == set(episode.turn_ids)
        assert compressor.episodes_made == 1
        await _session(ground, "trip", TRIP, 10)
        await flush(ground, compressor)
        assert [(e.first_seq, e.last_seq) for e in await episodes(ground, "ana")] == [(0, 9), (10, 19)]


async def test_consolidating_a_session_makes_an_episode_of_the_rest(store_path) -> None:
    """consolidate makes one episode of the turns no episode covers yet, once."""
    async with running_compressor(store_path) as (ground, compressor):
        await _session(ground, "cook", COOKING, 6)
        assert await compressor.consolidate("ana", "cook", 6) is True
        assert await compressor.consolidate("ana", "cook", 6) is False
        (episode,) = await episodes(ground, "ana")
    assert (episode.first_seq, episode.last_seq) == (0, 5)
    assert episode.consolidated_at is not None


async def test_surprise_measures_novelty_and_raises_stability(store_path) -> None:
    """The same topic again is no surprise; a new topic is, and starts more stable."""
    async with running_compressor(store_path) as (ground, compressor):
        for session, texts in (("trip1", TRIP), ("trip2", TRIP), ("bread", COOKING)):
            await _session(ground, session, texts, 4)
            await compressor.consolidate("ana", session, 4)
        first, again, new = sorted(await episodes(ground, "ana"), key=lambda e: e.created_at)
    assert first.surprise == 0.5
    assert again.surprise == 0.0 and new.surprise > 0.3
    assert new.stability > again.stability


async def test_a_pending_review_is_rated_by_the_next_assistant_turn(store_path) -> None:
    """A retrieval's pending review (as retrieve_memory records it) is rated by the next
    assistant turn of that conversation: GOOD when the reply uses what was shown, and the
    pending review is gone."""
    clock = StepClock(step=timedelta(days=1))  # a review on a later day: GOOD grows stability
    async with running_compressor(store_path, clock) as (ground, compressor):
        await _session(ground, "trip", TRIP, 4)
        await compressor.consolidate("ana", "trip", 4)
        (episode,) = await episodes(ground, "ana")
        shown = PendingReview((episode.episode_id,), (episode.summary,), "Porto festival train",
                              T0)
        key = store_mod.user_prefix("ana") + b"chat"
        ground.store.submit(PutState(((b"pending", key, msgspec.msgpack.encode(shown), 0),)))
        await ground.add_turn("ana", "chat", "When is the Porto festival?")
        await ground.add_turn("ana", "chat",
                              "You booked the train to Porto for the festival in June.",
                              role="assistant")
        await flush(ground, compressor)
        states = await ground.store.read(store_mod.read_review_states, "ana",
                                         [episode.episode_id])
        pending = await ground.store.read(store_mod.read_pending)
    rated = states[episode.episode_id]
    assert rated.reps == 1 and rated.stability > episode.stability
    assert pending == []


def test_fsrs_state_is_computed_without_sleeping(monkeypatch) -> None:
    """The fsrs package's Card sleeps 1 ms to make a fresh card id; retrieval computes
    retrievability for every episode it considers, so none of these may make one."""
    import time as time_module

    from actors.episodic import RATINGS, initial_state, retrievability, review_state
    from actors.base.records import ReviewState

    def no_sleep(seconds: float) -> None:
        raise AssertionError(f"slept {seconds} s")

    monkeypatch.setattr(time_module, "sleep", no_sleep)
    stability, difficulty = initial_state(0.5, T0)
    assert 0 < retrievability(stability, T0, T0 + timedelta(days=3)) < 1
    state = ReviewState(stability, difficulty, T0, 1)
    assert review_state(state, RATINGS["good"], T0 + timedelta(days=3)).stability > stability


async def test_an_episode_is_named_by_its_turns_alike_in_two_stores(tmp_path: Path) -> None:
    """Two stores given the same turns (as two cluster nodes applying one log) make the
    episode under one id, hashed from its user, session and turn ids."""
    made = []
    for name in ("a", "b"):
        async with running_compressor(tmp_path / name) as (ground, compressor):
            await _session(ground, "trip", TRIP, 20)
            await flush(ground, compressor)
            made += await episodes(ground, "ana")
    first, second = made
    assert first.episode_id == second.episode_id == "e_" + derived_id(
        ("ana", "trip", first.turn_ids))


async def test_an_episode_whose_id_is_taken_gets_the_next_salted_one(store_path) -> None:
    """A memory already holding the id an episode's turns give (here a turn of another
    session) keeps it: the episode takes the id salted with 1, and both stay readable."""
    # The trip's turns will be t2..t21 (Ground names a turn by its lsn; this one is lsn 1).
    taken = "e_" + derived_id(("ana", "trip", tuple(f"t{lsn}" for lsn in range(2, 12))))
    async with running_compressor(store_path) as (ground, compressor):
        store = ground.store
        await store.reserve(1)
        lsn = store.next_lsn
        turn = Turn(lsn, taken, "ana", "other", 0, "user", "An unrelated remark.", T0)
        store.submit(AppendTurn(turn, store_mod.session_prefix("ana", "other") + bytes(8),
                                msgspec.msgpack.encode(turn), T0,
                                store_mod.user_prefix("ana") + taken.encode(), T0))
        await _session(ground, "trip", TRIP, 20)
        await flush(ground, compressor)
        (episode,) = await episodes(ground, "ana", "trip")
        found = await store.read(store_mod.read_memories_by_id, "ana",
                                 [taken, episode.episode_id])
    assert episode.turn_ids[0] == "t2"
    assert episode.episode_id == "e_" + derived_id(("ana", "trip", episode.turn_ids), 1)
    assert found == {taken: turn, episode.episode_id: episode}


def test_a_word_typed_decomposed_is_one_content_word() -> None:
    """An episode's keywords and the check of whether a reply used a memory compare content
    words: a decomposed 'café' (a combining accent after the e) was cut into 'caf' and
    nothing, so it matched neither 'café' nor itself as a word."""
    text = "Coffee at the café near São Bento"
    assert content_words(unicodedata.normalize("NFD", text)) == content_words(text)
    assert "café" in content_words(text)
