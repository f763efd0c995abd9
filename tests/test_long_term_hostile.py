"""What a chat user can type against the long-term layer (fact rules, episodes, entities,
maintenance, the LLM's replies): each hostile turn may cost its own derived memories, never a
follower, another user's memories, the loop's responsiveness, or a store that verifies."""

from __future__ import annotations

import json
import random
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

import actors.base.validate as validate
import actors.embedder.embedder as embedder_actor
from actors.base.config import Config
from actors.entities import MAX_ALIASES
from actors import episodic
from actors.episodic import MAX_KEYWORD_CHARS, MAX_SENTENCES, MAX_TITLE_CHARS, mmr
from actors.extraction import MAX_CANDIDATES, extract_facts
from engine import Engine, HashEmbedder

from .actors.test_facts import ManualClock
from .conftest import T0, StepClock, open_engine

MAX_TEXT = Config().max_text_chars


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
    """Two 32,000-character turns of distinct likes: the profile stays bounded (before: 2,207
    facts a turn, each compared with every active one, so flush took 15 s, then 45 s), another
    user's profile is untouched and the store verifies. (Timing is the benchmarks' to judge;
    the count is what made it slow.)"""
    async with open_engine(store_path) as mem:
        await mem.add_turn("bob", "s", "user", "I live in Lisbon.")
        for prefix in ("zq", "zr"):
            text = " ".join(f"I like {prefix}{i}." for i in range(4_000))[:MAX_TEXT]
            await mem.add_turn("eve", "s", "user", text)
            await mem.flush()
        assert len(await mem.profile("eve")) <= 2 * MAX_CANDIDATES
        assert [(f.key, f.value) for f in await mem.profile("bob")] == [("location", "Lisbon")]
    await _verified(store_path)


async def test_case_variants_of_one_entity_do_not_grow_its_record(store_path) -> None:
    """A URL (or an address, hashtag, handle) typed in a new mix of cases each turn is one
    entity whose aliases stay bounded (before: every spelling kept, a 3,000-character URL in
    1,000 turns made a 3 MB registry record rewritten at every step, and without end)."""
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


def _one_long_word_turn(n: int) -> str:
    """A sentence whose tenth word is a run of letters filling the text: an extractive title
    keeps ten words, whatever their length."""
    head = f"Zebras walk north through valleys number {n} carrying "
    return head + "w" * (MAX_TEXT - len(head))


async def test_long_episode_titles_do_not_stop_the_weekly_reflections(store_path) -> None:
    """Episodes of a user whose titles are tens of thousands of characters long: maintenance
    still writes every user's weekly reflection (before, the reflection was longer than a
    note may be, the pass raised at that user and the users after her got none, every week);
    so does a user whose facts' texts are that long; and the store verifies."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        for n in range(3):
            await mem.add_turn("eve", f"s{n}", "user", _one_long_word_turn(n))
            await mem.add_turn("eve", f"s{n}", "assistant", _one_long_word_turn(n))
            assert await mem.close_session("eve", f"s{n}")
        await mem.add_turn("kim", "s", "user", "Hello.")
        for topic in ("Ferries", "Gardens", "Harbours"):  # a bot's facts, each a text long
            text = f"{topic} " + "w" * (MAX_TEXT - len(topic) - 1)
            await mem.remember_fact("kim", "notes", topic.lower(), "v", text=text)
        for text in ("I'm allergic to peanuts.", "I moved to Porto last month.",
                     "I work as a pharmacist, long shifts."):
            await mem.add_turn("zed", "s", "user", text)
        await mem.flush()
        assert (await mem.maintain()).reflections == 3
        year, week, _ = T0.isocalendar()
        for user_id in ("eve", "kim", "zed"):
            assert await mem.get_note(user_id, f"reflection-{year}-W{week:02d}") is not None
    await _verified(store_path)


async def test_an_offline_episode_title_and_keywords_are_bounded_as_the_models_are(
        store_path) -> None:
    """Ten words of a turn can be a whole text: the extractive title and keywords are cut as
    the LLM's are (before, a 31,000-character title and keyword, quoted whole wherever the
    episode is shown)."""
    word = "a" + "\u4e2d" * 31_000
    async with open_engine(store_path) as mem:
        await mem.add_turn("eve", "s", "user", "alpha beta gamma delta " + word)
        await mem.add_turn("eve", "s", "assistant", word + " alpha beta")
        assert await mem.close_session("eve", "s")
        (episode,) = await mem.episodes("eve")
    assert len(episode.title) <= MAX_TITLE_CHARS + len("...")
    assert episode.keywords and all(len(k) <= MAX_KEYWORD_CHARS for k in episode.keywords)


async def test_a_session_closed_after_a_burst_is_summarised_in_bounded_pieces(
        store_path, monkeypatch) -> None:
    """A thousand turns of twenty sentences, closed before the follower reached them: the
    episodes are the follower's ten-turn ones, no summary weighs more than MAX_SENTENCES
    sentences (before: one episode of all 1,000 turns, and it and the rolling summary each
    built a 20,000-square similarity matrix, 9 s of the loop), and the store verifies."""
    sizes: list[int] = []

    def spied(vectors, weights, k):
        sizes.append(len(vectors))
        return mmr(vectors, weights, k)

    monkeypatch.setattr(episodic, "mmr", spied)
    text = " ".join(f"Green trains carry {j} boxes." for j in range(20))
    async with open_engine(store_path) as mem:
        await mem.add_turns([{"user_id": "eve", "session_id": "s", "role": "user",
                              "text": text}] * 1_000)
        assert await mem.close_session("eve", "s")
        await mem.flush()
        episodes = await mem.episodes("eve")
    assert max(sizes) <= MAX_SENTENCES
    assert max(e.last_seq - e.first_seq for e in episodes) < 20
    assert sorted((e.first_seq, e.last_seq) for e in episodes)[-1][1] == 999
    await _verified(store_path)


async def test_a_legacy_length_user_does_not_stop_the_others_reflections(
        store_path, monkeypatch) -> None:
    """A store written before the id byte limit holds a 253-byte user, whose reflection note
    no write may take: the pass still writes the other users' reflections (before, it raised
    at her, every pass, and nobody after her got one)."""
    facts = ("I'm allergic to peanuts.", "I moved to Porto last month.",
             "I work as a pharmacist, long shifts.")
    with monkeypatch.context() as old_rules:
        old_rules.setattr(validate, "MAX_ID_BYTES", 256)
        async with open_engine(store_path, clock=ManualClock()) as mem:
            for text in facts:
                await mem.add_turn("u" * 253, "s", "user", text)
    async with open_engine(store_path, clock=ManualClock()) as mem:
        for text in facts:
            await mem.add_turn("zed", "s", "user", text)
        await mem.flush()
        assert (await mem.maintain()).reflections == 1
        year, week, _ = T0.isocalendar()
        assert await mem.get_note("zed", f"reflection-{year}-W{week:02d}") is not None


class _GatedSummaries:
    """A fake LLM whose episode summaries wait for ``release`` (``entered`` is set when one
    is waiting); no facts."""

    def __init__(self) -> None:
        self.entered = trio.Event()  # set when a summary waits
        self.release = trio.Event()  # set by the test to let summaries answer

    async def complete(self, system: str, prompt: str) -> str:
        if "extract durable facts" in system:
            return '{"facts": []}'
        if not self.release.is_set():
            self.entered.set()
            await self.release.wait()
        return json.dumps({"title": "Cargo", "summary": "They talked cargo.", "keywords": []})


async def test_a_session_forgotten_while_compressed_gets_episodes_when_written_again(
        store_path) -> None:
    """close_session's episode is being summarised when the session is forgotten; the same
    session id is then written again: its new turns get their episodes from seq 0 (before,
    the compressor kept the forgotten episode's end, and the new session's first fifteen
    turns never became an episode)."""
    model = _GatedSummaries()
    async with open_engine(store_path, llm=model, config={"summary_every_turns": 0}) as mem:
        for i in range(15):
            await mem.add_turn("eve", "s", "user", f"Green trains carry {i} boxes today.")
        await mem.flush()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(mem.close_session, "eve", "s")
            await model.entered.wait()
            await mem.forget_session("eve", "s")
            model.release.set()
        await mem.flush()
        assert await mem.episodes("eve") == []
        for i in range(25):
            await mem.add_turn("eve", "s", "user", f"Blue boats carry {i} crates today.")
        await mem.flush()
        assert [(e.first_seq, e.last_seq) for e in await mem.episodes("eve")] == [(0, 9)]
    await _verified(store_path)


async def test_what_a_slow_model_made_of_forgotten_turns_is_not_written_to_their_session_anew(
        store_path) -> None:
    """The model is summarising a session's turns when the session is forgotten, and the bot
    writes to the same session id again before the model answers: the store checked only
    that the session existed, so the episode of the forgotten turns (their ids, the model's
    words about them) and the rolling summary of them were written into the new session.
    Neither is written now: the store checks, in the write, that every turn they were made
    of is still held."""
    model = _GatedSummaries()
    async with open_engine(store_path, llm=model, config={"summary_every_turns": 0}) as mem:
        for i in range(15):
            await mem.add_turn("eve", "s", "user", f"Green trains carry {i} boxes today.")
        await mem.flush()
        forgotten = {t.turn_id for t in await mem.session_history("eve", "s")}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(mem.close_session, "eve", "s")
            await model.entered.wait()
            await mem.forget_session("eve", "s")
            await mem.add_turn("eve", "s", "user", "Hello again, a fresh start.")
            model.release.set()
        await mem.flush()
        for episode in await mem.episodes("eve"):
            assert not set(episode.turn_ids) & forgotten, episode
    await _verified(store_path)


async def test_a_rolling_summary_of_forgotten_turns_is_not_written_to_their_session_anew(
        store_path) -> None:
    """The same race for the session's rolling summary: made of the forgotten turns with the
    epoch read before the forget (0, as the forget leaves it), it was taken for the new
    session's, claiming turns it never had."""
    model = _GatedSummaries()
    async with open_engine(store_path, llm=model,
                           config={"summary_every_turns": 3, "episode_after_turns": 1000}) as mem:
        for i in range(3):
            await mem.add_turn("eve", "s", "user", f"Green trains carry {i} boxes today.")
        await model.entered.wait()
        await mem.forget_session("eve", "s")
        await mem.add_turn("eve", "s", "user", "Hello again, a fresh start.")
        model.release.set()
        await mem.flush()
        summary = await mem.session_summary("eve", "s")
        assert summary is None or summary.upper_seq <= 1, summary
    await _verified(store_path)


class _Poisoned(HashEmbedder):
    """An embedding model that fails on any text naming poison."""

    def encode(self, texts: list[str]) -> np.ndarray:
        if any("Poison" in t for t in texts):
            raise RuntimeError("the model fails on this text")
        return super().encode(texts)


class _PoisonedLate(HashEmbedder):
    """The model fails on poison only once let go: the failure lands when the test wants."""

    def __init__(self) -> None:
        super().__init__()
        self.inside, self.go = threading.Event(), threading.Event()

    def encode(self, texts: list[str]) -> np.ndarray:
        if any("Poison" in t for t in texts):
            self.inside.set()
            self.go.wait(30)
            raise RuntimeError("the model fails on this text")
        return super().encode(texts)


async def test_a_model_failure_landing_while_the_engine_closes_does_not_fail_the_close(
        store_path, monkeypatch) -> None:
    """The model fails on a turn's text just as the engine closes: the close ends cleanly
    (before, the embedder saw it was closed and raised the model's failure as EngineBroken,
    and the engine's exit raised "the engine failed"), and the next open takes the turn up
    again and keeps the failure as a record's."""
    model = _PoisonedLate()
    close = embedder_actor.Embedder.close

    def closing(self) -> None:
        close(self)
        model.go.set()  # the model's answer arrives after the actor is closed

    monkeypatch.setattr(embedder_actor.Embedder, "close", closing)
    async with open_engine(store_path, embedder=model) as mem:
        await mem.add_turn("amy", "s", "user", "Poison ivy grows here.")
        await trio.to_thread.run_sync(model.inside.wait, 30)
    monkeypatch.setattr(embedder_actor.Embedder, "close", close)
    async with open_engine(store_path, embedder=_Poisoned()) as mem:
        await mem.flush()
        assert [f.actor for f in await mem.failures()] == ["embedder"]
        assert [t.text for t in await mem.session_history("amy", "s")] == [
            "Poison ivy grows here."]


async def test_sentences_the_model_fails_on_still_make_episodes(store_path) -> None:
    """A session whose sentences the embedding model fails on: its episodes are made from its
    first sentences, the failure is kept, the sessions after it are consolidated and the
    reflections written, and the engine goes on (before, the compressor's follower raised
    EngineBroken and took the engine down, again at every open; maintenance raised at it)."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock, embedder=_Poisoned()) as mem:
        for i in range(25):
            await mem.add_turn("amy", "s", "user", f"Poison ivy grows {i} meters here.")
        await mem.add_turn("amy", "t", "user", "Poison ivy again, here and there.")
        await mem.add_turn("amy", "t", "user", "Poison everywhere in the garden.")
        for text in ("I'm allergic to peanuts.", "I moved to Porto last month.",
                     "I work as a pharmacist, long shifts."):
            await mem.add_turn("zed", "s", "user", text)
        await mem.flush()
        assert [(e.first_seq, e.last_seq) for e in await mem.episodes("amy", "s")] == [(0, 9)]
        clock.now = T0 + timedelta(days=3)
        report = await mem.maintain()
        assert (report.consolidated_sessions, report.reflections) == (3, 2)
        assert len(await mem.episodes("zed")) == 1
        assert {f.actor for f in await mem.failures("amy")} == {"embedder", "episodic"}
        assert await mem.failures("zed") == []
    await _verified(store_path)


class _ExitingExtractor:
    """A caller's extractor that ends the program from inside the engine."""

    name = "exiting"

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    async def extract(self, text: str) -> list[Any]:
        raise self.exc


@pytest.mark.parametrize("exc", [SystemExit(3), KeyboardInterrupt()])
async def test_an_extractor_ending_the_program_ends_it_as_itself(store_path, exc) -> None:
    """SystemExit or KeyboardInterrupt raised in a caller's extractor ended the engine's
    ``async with`` as a bare BaseExceptionGroup: an ``except SystemExit`` or ``except
    KeyboardInterrupt`` missed it, and ``sys.exit(3)`` left the process with status 1. It
    is now raised as itself, and the turn acknowledged durable before it is stored."""
    with pytest.raises(type(exc)) as raised:
        async with open_engine(store_path, clock=StepClock(),
                               extractor=_ExitingExtractor(exc)) as mem:
            await mem.add_turn("ana", "s", "user", "I live in Lisbon", durable=True)
            await trio.sleep_forever()
    assert raised.value is exc
    async with open_engine(store_path, clock=StepClock()) as mem:
        assert [t.text for t in await mem.session_history("ana", "s")] == ["I live in Lisbon"]
