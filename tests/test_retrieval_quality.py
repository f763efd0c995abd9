"""Retrieval quality mechanisms: rare entities, episodes lifting turns, neighbouring turns,
the relevance floor, explained scores, and retrieve_memory filling its episodic section."""

from __future__ import annotations

import unicodedata
from datetime import datetime, timezone

import pytest

from actors.base.records import Turn
from engine import Engine
from engine._retrieval import asked_speaker, speaker_of

from .conftest import StepClock, open_engine

TOPICS = ["the weather was grey again", "work was busy with meetings", "we cooked pasta tonight",
          "the train was late this morning", "a documentary about whales", "the gym was packed"]


async def _chat(mem: Engine, session: str, texts: list[str]) -> None:
    for i, text in enumerate(texts):
        await mem.add_turn("ana", session, "user" if i % 2 == 0 else "assistant", text)


async def test_a_name_in_every_turn_does_not_make_the_entity_leg_fire(store_path) -> None:
    """Caroline speaks in every turn: her name is no evidence. Sweden, named once, is."""
    async with open_engine(store_path, clock=StepClock()) as mem:
        texts = [f"Caroline: {TOPICS[i % len(TOPICS)]} {i}" for i in range(40)]
        texts[17] = "Caroline: my grandmother was born in Sweden"
        await _chat(mem, "s", texts)
        await mem.flush()
        for hit in await mem.recall("ana", "What did Caroline say?", limit=20):
            assert "entity" not in hit.explain.ranks, hit
        hits = await mem.recall("ana", "Which country is Caroline's family from, Sweden?")
        assert hits[0].text == texts[17] and hits[0].explain.ranks["entity"] == 1


class Summariser:
    """An LLM at the edge: it summarises every episode in words no turn of it uses."""

    async def complete(self, system: str, prompt: str) -> str:
        if "facts" in system:
            return '{"facts": []}'
        return ('{"title": "Holiday", "summary": "Ana plans a summer holiday: lodging by the '
                'water for the saints\' feast.", "keywords": []}')


def _trip() -> list[str]:
    texts = [f"{TOPICS[i % len(TOPICS)]}, said at {i}" for i in range(20)]
    texts[2] = "the trip to Porto is booked for June, the festival"
    texts[4] = "we booked a small hotel near the river in Porto"
    texts[6] = "Porto in June: the river, the festival and the hotel"
    return texts


async def test_an_episode_points_at_its_best_turn_instead_of_taking_the_slots(store_path) -> None:
    """An episode whose summary says what none of its turns says in those words ("lodging by
    the water") is found where no turn is: recall over every kind returns the turn it lifts,
    one turn (each prefix of the results differs from the turns-only ranking's by at most
    one turn per lifting episode, as if the episode held one slot), not the episode (which
    would spend ten turns' slots); asked for by kind, the episode is returned itself."""
    async with open_engine(store_path, clock=StepClock(), llm=Summariser()) as mem:
        texts = _trip()
        await _chat(mem, "trip", texts)
        await _chat(mem, "later", ["a hotel by the river would be nice",
                                   "Porto or Lisbon, we will see", "the river walk was long"])
        await mem.flush()
        (episode,) = await mem.episodes("ana", "trip")
        query = "summer holiday lodging by the water"
        alone = [h.id for h in await mem.recall("ana", query, limit=20, kinds=["turn"])]
        full = await mem.recall("ana", query, limit=20)
        assert [h.kind for h in full] == ["turn"] * len(full)
        lifted = [h for h in full if episode.episode_id in h.explain.lifted_by]
        assert len(lifted) == 1 and lifted[0].id in episode.turn_ids
        assert full[0].id == lifted[0].id
        ids = [h.id for h in full]
        for k in range(1, len(alone) + 1):
            assert len(set(alone[:k]) - set(ids[:k])) <= 1, k
        by_kind = await mem.recall("ana", query, kinds=["episode"])
        assert [h.id for h in by_kind] == [episode.episode_id]
        assert 0 < by_kind[0].explain.fsrs <= 1.0


async def test_an_episode_no_better_than_its_best_turn_lifts_nothing(store_path) -> None:
    """Asked in one turn's own words, that turn matches better than the episode that holds
    it: the episode knows nothing the turn does not say, and lifting the turn by it would
    count the same words twice (enough to pass a turn whose evidence counts once). The turns
    come in the turns-only order (beyond the first five, fillers only the neighbour lift
    found tie within what the entity leg's list of every kind shifts)."""
    async with open_engine(store_path, clock=StepClock()) as mem:
        texts = _trip()
        await _chat(mem, "trip", texts)
        await mem.flush()
        (episode,) = await mem.episodes("ana", "trip")
        query = "hotel near the river in Porto"
        alone = [h.id for h in await mem.recall("ana", query, limit=10, kinds=["turn"])]
        full = await mem.recall("ana", query, limit=10)
        assert full[0].text == texts[4]
        assert all(episode.episode_id not in h.explain.lifted_by for h in full)
        assert [h.id for h in full][:5] == alone[:5]


async def test_hit_explain_carries_the_per_leg_ranks_and_fused_score(store_path) -> None:
    async with open_engine(store_path, clock=StepClock()) as mem:
        await _chat(mem, "s", [*TOPICS, "my sister Clara plays the cello", *TOPICS])
        await mem.flush()
        hits = await mem.recall("ana", "cello Clara", limit=3)
    best = hits[0]
    assert best.text == "my sister Clara plays the cello"
    assert best.explain.ranks["bm25"] == 1 and best.explain.ranks["vector"] == 1
    assert best.explain.fused > 0 and best.explain.fsrs == 1.0
    assert best.explain.cosine is not None and 0 < best.score < 1
    assert set(best.via) == set(best.explain.ranks)


async def test_an_answer_next_to_the_question_is_lifted(store_path) -> None:
    """The reply holds the answer but not the words: its neighbour lifts it."""
    async with open_engine(store_path, clock=StepClock()) as mem:
        texts = [*TOPICS, "what did you name the new puppy?", "Biscuit, after the colour.",
                 *TOPICS]
        await _chat(mem, "s", texts)
        await mem.flush()
        hits = await mem.recall("ana", "name of the puppy", limit=3, kinds=["turn"])
    by_text = {h.text: h for h in hits}
    answer = by_text["Biscuit, after the colour."]
    assert answer.explain.lift > 0 and answer.explain.lifted_by


async def test_a_query_with_no_good_match_returns_fewer_hits(store_path) -> None:
    async with open_engine(store_path, clock=StepClock()) as mem:
        await _chat(mem, "s", TOPICS * 4)
        await mem.flush()
        assert len(await mem.recall("ana", "the train was late", limit=10)) > 0
        assert await mem.recall("ana", "quixotic zygomorphic xylophones", limit=10) == []


async def test_retrieve_memory_fills_its_episodic_section(store_path) -> None:
    """An episode and the turns it covers compete for the same slots; the section still
    holds the number of items asked for, and no turn beside the episode that covers it."""
    async with open_engine(store_path, clock=StepClock()) as mem:
        texts = [f"the trip to Porto, part {i}: {TOPICS[i % len(TOPICS)]}" for i in range(30)]
        await _chat(mem, "trip", texts)
        await mem.flush()
        raw = await mem.retrieve_memory_raw("ana", "trip to Porto", episodic_limit=6,
                                            semantic_limit=0)
    assert len(raw.episodic) == 6
    assert any(item.kind == "episode" for item in raw.episodic)
    shown = {m.content for item in raw.episodic if item.kind == "episode" for m in item.messages}
    assert not [item for item in raw.episodic if item.kind == "turn" and item.summary in shown]


async def test_other_kinds_never_change_how_turns_are_scored(store_path) -> None:
    """Notes (like episodes and facts) that match the query better than the turns do are
    searched in lists of their own: every turn keeps the per-leg ranks and the fused score it
    has in a turns-only recall, so the other kinds can add hits but never push a turn down."""
    async with open_engine(store_path, clock=StepClock()) as mem:
        texts = [f"{TOPICS[i % len(TOPICS)]}, and the sailing club at {i}" for i in range(12)]
        await _chat(mem, "s", texts)
        for i in range(8):
            await mem.store_note("ana", f"sailing club sailing lessons sailing boat {i}")
        await mem.flush()
        query = "the sailing club"
        turns = {h.id: h for h in await mem.recall("ana", query, limit=12, kinds=["turn"])}
        mixed = await mem.recall("ana", query, limit=30, kinds=["turn", "note"])
    assert {h.kind for h in mixed} == {"turn", "note"}
    assert [h.id for h in mixed if h.kind == "turn"] == list(turns)
    for hit in mixed:
        if hit.kind == "turn":
            assert hit.explain.ranks == turns[hit.id].explain.ranks
            assert hit.explain.fused == turns[hit.id].explain.fused


async def test_a_neighbour_with_no_relevance_of_its_own_is_not_lifted(store_path) -> None:
    """A filler next to a strong hit ("Noted.") says nothing about anything: no leg found it
    and it is not like the query, so it takes no lift and stays out of the results."""
    async with open_engine(store_path, clock=StepClock()) as mem:
        texts = [f"the puppy park on {TOPICS[i % len(TOPICS)]} day {i}" for i in range(120)]
        texts[60:60] = ["what did you name the new puppy?", "Noted."]
        await _chat(mem, "s", texts)
        await mem.flush()
        hits = await mem.recall("ana", "name of the new puppy", limit=50, kinds=["turn"])
    assert hits[0].text == "what did you name the new puppy?"
    assert "Noted." not in [h.text for h in hits]


async def _two_speakers(mem: Engine, session: str, said: list[tuple[str, str]],
                        meta: bool = False) -> None:
    """A two-person transcript: each turn "Name: text", or with meta ``speaker`` instead."""
    for i, (name, text) in enumerate(said):
        role = "user" if name == said[0][0] else "assistant"
        if meta:
            await mem.add_turn("ana", session, role, text, meta={"speaker": name})
        else:
            await mem.add_turn("ana", session, role, f"{name}: {text}")


PAINTED = [("Melanie", "I painted a lake at sunrise last weekend"),
           ("Caroline", "I painted a lake at sunrise too, years ago")]


async def test_a_question_about_one_speaker_favours_what_that_speaker_said(store_path) -> None:
    """"What did Caroline paint?" in a two-person chat: of two turns that say the same thing,
    the one Caroline said ranks first, by the transcript's "Name: " or by meta ``speaker``;
    Melanie's turn ranks first when she is asked about."""
    for meta in (False, True):
        async with open_engine(store_path / str(meta), clock=StepClock()) as mem:
            filler = [(("Melanie", "Caroline")[i % 2], TOPICS[i % len(TOPICS)]) for i in range(30)]
            await _two_speakers(mem, "s", [*filler[:10], *PAINTED, *filler[10:]], meta)
            await mem.flush()
            for name in ("Caroline", "Melanie"):
                hits = await mem.recall("ana", f"What did {name} paint at sunrise?", limit=5)
                said = [h for h in hits if "lake at sunrise" in h.text]
                assert len(said) == 2, hits
                first = dict(PAINTED)[name]
                assert first in said[0].text, (name, meta, said)
                assert said[0].explain.speaker > 0 and said[1].explain.speaker == 0


async def test_naming_both_speakers_or_none_favours_neither(store_path) -> None:
    """A question naming both speakers, or neither, adds nothing for who said a turn; nor does
    a prefix that is not a name ("A: ..." in a Q&A transcript, "note to self: ...")."""
    async with open_engine(store_path, clock=StepClock()) as mem:
        await _two_speakers(mem, "s", [*PAINTED, ("Melanie", TOPICS[0])])
        await mem.add_turn("ana", "qa", "user", "A: a lake at sunrise, painted in oils")
        await mem.add_turn("ana", "qa", "user", "note to self: paint a lake at sunrise")
        await mem.flush()
        for query in ("What did Caroline and Melanie paint at sunrise?",
                      "Who painted a lake at sunrise?", "A lake at sunrise: a note"):
            for hit in await mem.recall("ana", query, limit=10):
                assert hit.explain.speaker == 0, (query, hit)


@pytest.mark.parametrize(("text", "meta", "speaker", "role"), [
    ("Caroline: I went to a support group", {}, "caroline", "user"),
    ("Caroline: I went to a support group", {}, "caroline", "assistant"),
    ('{"temp": 21}', {"name": "get_weather"}, None, "tool"),  # a function's name, no one's
    ("Error: the city is unknown", {}, None, "tool"),
    ("Reminder: be brief", {}, None, "system"),
    ("Jean-Luc Picard: engage", {}, "jean-luc", "user"),
    ("O'Brien: the transporter is fixed", {}, "o'brien", "user"),
    ("Zoë: hallo", {}, "zoë", "user"),
    (unicodedata.normalize("NFD", "Zoë: hallo"), {}, "zoë", "user"),  # decomposed: the same
    ("hallo", {"speaker": unicodedata.normalize("NFD", "José")}, "josé", "user"),
    ("A: a lake at sunrise", {}, None, "user"),  # a Q&A transcript's answer, not a person
    ("note to self: buy milk", {}, None, "user"),
    ("Caroline:no space", {}, None, "user"),
    ("I said it twice: at noon and at night", {}, None, "user"),
    ("The Very Long Name Here: x", {}, None, "user"),
    ("just text", {"speaker": "Melanie Z"}, "melanie", "user"),
    ("Caroline: hi", {"name": "Bob"}, "bob", "user"),  # meta says who, over the text
    ("Caroline: hi", {"name": 3}, "caroline", "user"),
])
def test_who_said_a_turn(text: str, meta: dict, speaker: str | None, role: str) -> None:
    turn = Turn(1, "t", "ana", "s", 0, role, text, datetime.now(timezone.utc), meta, "", "")
    assert speaker_of(turn) == speaker


def test_which_speaker_a_question_names() -> None:
    both = ["caroline", "melanie", None]
    assert asked_speaker("What is Caroline's job?", both) == "caroline"
    assert asked_speaker("what did o'brien fix?", ["o'brien", "kira"]) == "o'brien"
    assert asked_speaker("How did Caroline and Melanie meet?", both) is None
    assert asked_speaker("What did Caroline say?", ["caroline"]) is None  # one voice only
    assert asked_speaker("What happened in May?", both) is None
    assert asked_speaker(unicodedata.normalize("NFD", "What did José paint?"),
                         ["josé", "zoë"]) == "josé"
