"""recall and the retrieve API: fusion, filters, focus, links, budgets, deletion, shapes."""

from __future__ import annotations

import re
from datetime import timedelta

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import Engine, HashEmbedder, InvalidInput, RetrieveResult

from .conftest import T0, StepClock, open_engine, text_index_held


class SynonymEmbedder(HashEmbedder):
    """Embeds 'canine' like 'dog', so a vector search finds what BM25 cannot."""

    def encode(self, texts):
        return super().encode([t.replace("canine", "dog") for t in texts])


async def _ids(hits) -> list[str]:
    return [h.text for h in hits]


async def test_keyword_only_and_vector_only_hits_both_reach_the_result(store_path) -> None:
    """Fusion keeps a hit only BM25 finds and a hit only the vectors find."""
    async with open_engine(store_path, embedder=SynonymEmbedder()) as mem:
        await mem.add_turn("ana", "s", "user", "my dog barks at night")
        await mem.add_turn("ana", "s", "user", "canine training class on friday")
        for i in range(30):
            await mem.add_turn("ana", "s", "user", f"unrelated note {i} about the weather")
        await mem.flush()
        hits = await mem.recall("ana", "canine", limit=5, kinds=["turn"])
    by_text = {h.text: h for h in hits}
    assert by_text["canine training class on friday"].via == ("vector", "bm25") or set(
        by_text["canine training class on friday"].via) == {"vector", "bm25"}
    assert by_text["my dog barks at night"].via == ("vector",)


async def test_a_tag_filter_of_one_few_or_many_tags_keeps_the_turns_it_names(
        store_path) -> None:
    """The text index takes a tag filter of a few tags as a union of term queries and one of
    more than SET_AFTER as a term-set query: either way exactly the turns carrying one of the
    tags come back."""
    from actors.fulltext.query import SET_AFTER

    tags = [f"t{i}" for i in range(SET_AFTER + 4)]
    async with open_engine(store_path) as mem:
        for i, tag in enumerate(tags):
            await mem.add_turn("ana", "s", "user", f"the dog walk {i}", meta={"tags": [tag]})
            await mem.add_turn("ana", "s", "user", f"the dog park {i}")
        await mem.flush()
        for count in (1, 2, SET_AFTER, SET_AFTER + 1, len(tags)):
            hits = await mem.recall("ana", "dog", limit=50, tags=tags[:count], legs=["bm25"])
            assert sorted(h.text for h in hits) == sorted(
                f"the dog walk {i}" for i in range(count)), count


def test_fusion_sums_the_legs_in_one_order_whatever_order_they_finished_in() -> None:
    """The legs' lists reach fusion in the order their searches finished; the fused scores
    (to the last bit) and each memory's ranks (and so a hit's ``via``) come out the same."""
    from itertools import permutations

    from engine._retrieval import fuse

    ranked = {"bm25": [(1, 7.1), (2, 3.3), (3, 0.7)], "vector": [(2, 0.93), (3, 0.61), (1, 0.29)],
              "entity": [(3, 2.2), (1, 1.1)], "window": [(1, 3.0)]}
    results = [fuse({leg: ranked[leg] for leg in order}, 40) for order in permutations(ranked)]
    first = results[0]
    for result in results:
        assert result == first
        assert [list(result[lsn][1]) for lsn in result] == [list(first[lsn][1]) for lsn in first]
    assert list(first[1][1]) == ["vector", "bm25", "entity", "window"]


async def test_a_turn_is_recallable_before_any_index_has_it(store_path) -> None:
    """Read-your-writes: the window leg finds a turn acknowledged a moment ago."""
    async with open_engine(store_path, config={"background_embedding": False}) as mem:
        await mem.add_turn("ana", "s", "user", "my passport number ends in 4411")
        hits = await mem.recall("ana", "passport number")
    assert [h.text for h in hits] == ["my passport number ends in 4411"]
    assert hits[0].via == ("window",)


async def test_a_note_and_a_fact_are_recallable_before_the_text_index_has_them(
        store_path, monkeypatch) -> None:
    """Read-your-writes for notes and facts: with the text index's commits held back and no
    vectors made, recall finds a note and a fact stored a moment ago (the window leg); an
    updated note is found by its new text only, a deleted one not at all."""
    async with open_engine(store_path, config={"background_embedding": False}) as mem:
        with text_index_held(monkeypatch):
            await mem.add_turn("ana", "s", "user", "we talked about the weather")
            note = await mem.store_note("ana", "the spare key is under the blue flowerpot")
            fact = await mem.remember_fact("ana", "identity", "employer", "Acme Robotics",
                                           text="works at Acme Robotics")
            assert mem._fulltext.indexed_lsn < fact.lsn
            hits = await mem.recall("ana", "where is the spare key?")
            assert [(h.id, h.kind) for h in hits] == [(note.note_id, "note")]
            assert "window" in hits[0].via
            # The entity leg may find the fact too, once the entities follower has its name.
            hits = await mem.recall("ana", "which company, Acme Robotics?", kinds=["fact"])
            assert [h.id for h in hits] == [fact.fact_id] and "window" in hits[0].via
            assert await mem.recall("ana", "spare key", kinds=["turn"]) == []

            await mem.update_note("ana", note.note_id, "the spare key hangs in the garage")
            assert [h.text for h in await mem.recall("ana", "spare key garage flowerpot")] == [
                "the spare key hangs in the garage"]
            await mem.delete_note("ana", note.note_id)
            assert await mem.recall("ana", "spare key") == []
            assert mem._fulltext.indexed_lsn < fact.lsn


async def test_filters_restrict_every_leg(store_path) -> None:
    """session_id, since/until and roles hold for vector, BM25 and window hits alike."""
    clock = StepClock()
    async with open_engine(store_path, clock=clock) as mem:
        await mem.add_turn("ana", "a", "user", "a trip to porto", at=T0)
        await mem.add_turn("ana", "b", "assistant", "trip to porto", at=T0 + timedelta(days=2))
        await mem.add_turn("ana", "b", "user", "trip to porto", at=T0 + timedelta(days=4))
        await mem.flush()
        await mem.add_turn("ana", "b", "user", "trip to porto soon", at=T0 + timedelta(days=5))
        in_b = await mem.recall("ana", "porto trip", session_id="b")
        assert {h.session_id for h in in_b} == {"b"} and len(in_b) == 3
        window = await mem.recall("ana", "porto trip", since=T0 + timedelta(days=1),
                                  until=T0 + timedelta(days=4, hours=1))
        assert sorted(h.at for h in window) == [T0 + timedelta(days=2), T0 + timedelta(days=4)]
        users = await mem.recall("ana", "porto trip", roles=["user"])
        assert {h.role for h in users} == {"user"} and len(users) == 3
        assert await mem.recall("ana", "porto trip", kinds=["fact"]) == []


async def test_focus_levels_set_limit_window_and_link_depth(store_path) -> None:
    """Focus 0 keeps 2 hits from the last hour; focus 5 reaches back a week."""
    clock = StepClock(start=T0 + timedelta(days=10))
    async with open_engine(store_path, clock=clock) as mem:
        for i in range(5):
            await mem.add_turn("ana", "s", "user", f"coffee memory {i}", at=T0 + timedelta(days=10, minutes=-10 - i))
        await mem.add_turn("ana", "s", "user", "coffee from last week", at=T0 + timedelta(days=5))
        await mem.add_turn("ana", "s", "user", "coffee from last month", at=T0 - timedelta(days=20))
        await mem.flush()
        assert len(await mem.recall("ana", "coffee", focus=0)) == 2
        week = {h.text for h in await mem.recall("ana", "coffee", focus=5)}
        assert "coffee from last week" in week and "coffee from last month" not in week
        assert "coffee from last month" in {h.text for h in await mem.recall("ana", "coffee")}
        with pytest.raises(InvalidInput, match=r"focus: expected an integer from 0 to 5, found 6"):
            await mem.recall("ana", "coffee", focus=6)


async def test_links_are_followed_both_ways_to_the_requested_depth(store_path) -> None:
    """A hit brings its linked memories (either direction), hop by hop, once each."""
    async with open_engine(store_path) as mem:
        hit = await mem.add_turn("ana", "s", "user", "zebra sighting at the zoo")
        one = await mem.add_turn("ana", "s", "user", "first linked note")
        two = await mem.add_turn("ana", "s", "user", "second linked note")
        await mem.link("ana", hit.turn_id, one.turn_id, "relates_to")
        await mem.link("ana", two.turn_id, one.turn_id, "follows")  # reached backwards
        await mem.flush()
        flat = await mem.recall("ana", "zebra", limit=1)
        deep = await mem.recall("ana", "zebra", limit=1, link_depth=2)
        assert [h.text for h in flat] == ["zebra sighting at the zoo"]
        assert [h.text for h in deep] == ["zebra sighting at the zoo", "first linked note",
                                          "second linked note"]
        assert deep[1].via == ("link",) and deep[2].score < deep[1].score < deep[0].score
        assert {(l.from_id, l.to_id) for l in await mem.links("ana", one.turn_id)} == {
            (hit.turn_id, one.turn_id), (two.turn_id, one.turn_id)}
        with pytest.raises(InvalidInput, match=r"from_id: expected the id of a memory of user 'bo'"):
            await mem.link("bo", hit.turn_id, one.turn_id)
        await mem.forget_session("ana", "s")
        assert await mem.links("ana", one.turn_id) == []


async def test_hits_are_packed_into_the_token_budget(store_path) -> None:
    """Only hits whose text fits the budget are kept, best first; a long one is skipped."""
    async with open_engine(store_path) as mem:
        await mem.add_turn("ana", "s", "user", "tea " * 100 + "lisbon")
        await mem.add_turn("ana", "s", "user", "lisbon tea")
        await mem.add_turn("ana", "s", "user", "lisbon tea again")
        await mem.flush()
        hits = await mem.recall("ana", "lisbon tea", budget_tokens=12)
    assert {h.text for h in hits} == {"lisbon tea", "lisbon tea again"}


async def test_forgotten_memories_are_not_recalled(store_path) -> None:
    """After forget_session and forget_user, no leg returns the deleted turns."""
    async with open_engine(store_path) as mem:
        await mem.add_turn("ana", "old", "user", "secret recipe for bacalhau")
        await mem.add_turn("ana", "new", "user", "bacalhau tonight")
        await mem.add_turn("zed", "s", "user", "bacalhau for zed")
        await mem.flush()
        await mem.recall("zed", "bacalhau")  # loads zed's vectors and caches the query
        await mem.forget_session("ana", "old")
        await mem.forget_user("zed")
        assert "zed" not in mem._ann.loaded()
        assert all(user != "zed" for user, _ in mem._embedder._cache)
        assert [h.text for h in await mem.recall("ana", "bacalhau recipe")] == ["bacalhau tonight"]
        assert await mem.recall("zed", "bacalhau") == []


async def test_retrieve_memory_renders_seed_001_markdown(store_path) -> None:
    """Episodes carry rank, score and relative time; detail='high' adds the turns around."""
    clock = StepClock(start=T0 + timedelta(days=2, hours=1))
    async with open_engine(store_path, clock=clock) as mem:
        await mem.add_turn("ana", "s", "user", "I started learning Rust", at=T0)
        await mem.add_turn("ana", "s", "assistant", "Rust is a great choice", at=T0 + timedelta(minutes=1))
        await mem.flush()
        text = await mem.retrieve_memory("ana", "learning rust", episodic_limit=1, detail="high")
        assert text.startswith("## Episodic Memories\n\n### I started learning Rust [rank: 1, score: 0.")
        assert "**When:** 2 days ago" in text and "**Summary:** I started learning Rust" in text
        assert '- user: "I started learning Rust"' in text
        assert '- assistant: "Rust is a great choice"' in text
        summary_only = await mem.retrieve_memory("ana", "learning rust", episodic_limit=1, detail="none")
        assert "**Details:**" not in summary_only
        assert await mem.context_pre_retrieve("ana", "learning rust") == ""  # no facts yet


async def test_retrieve_memory_raw_has_the_seed_json_shape(store_path) -> None:
    """The raw result encodes to seed 001's JSON: semantic and episodic lists, no embeddings."""
    async with open_engine(store_path) as mem:
        await mem.add_turn("ana", "s", "user", "I like dark mode")
        await mem.flush()
        raw = await mem.retrieve_memory_raw("ana", "dark mode", episodic_limit=3)
    assert isinstance(raw, RetrieveResult)
    data = msgspec.json.decode(msgspec.json.encode(raw))
    (fact,) = data["semantic"]  # the rules extracted "Likes dark mode"
    assert fact["category"] == "preference" and fact["fact"] == "Likes dark mode"
    assert {"id", "conversation_id", "category", "fact", "keywords", "source_episodic_ids",
            "valid_at", "invalid_at", "score"} <= set(fact)
    (episode,) = data["episodic"]
    assert {"id", "conversation_id", "messages", "title", "summary", "stability", "difficulty",
            "surprise", "start_at", "end_at", "created_at", "last_reviewed_at",
            "consolidated_at", "score"} <= set(episode)
    assert "embedding" not in episode
    assert episode["messages"] == [{"role": "user", "content": "I like dark mode"}]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"episodic_limit": 0}, r"episodic_limit: expected an integer from 1 to 100, found 0"),
    ({"episodic_limit": 101}, r"episodic_limit: expected an integer from 1 to 100, found 101"),
    ({"detail": "max"}, r"detail: expected one of 'auto', 'none', 'low', 'high', found 'max'"),
    ({"semantic_limit": -1}, r"semantic_limit: expected an integer from 0 to 100"),
    ({"conversation_id": ""}, r"conversation_id: expected a non-empty string"),
    ({"query": " "}, r"query: expected a non-empty string"),
])
async def test_retrieve_arguments_are_checked(mem: Engine, kwargs, message) -> None:
    """Each bad retrieve argument names itself, what was expected and what was found."""
    args = {"user_id": "ana", "query": "hello", **kwargs}
    with pytest.raises(InvalidInput, match=message):
        await mem.retrieve_memory(**args)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=st.lists(st.tuples(st.sampled_from(["ana", "an", "bo"]),
                                st.sampled_from(["dog lisbon", "porto train", "dog", "coffee"])),
                      min_size=1, max_size=12),
       query=st.sampled_from(["dog", "lisbon dog", "train", "coffee porto"]))
async def test_recall_never_returns_another_users_memory(tmp_path_factory, turns, query) -> None:
    """Whatever was stored by whom, each user's recall holds only that user's turns."""
    async with open_engine(tmp_path_factory.mktemp("iso")) as mem:
        owner = {}
        for user, text in turns:
            r = await mem.add_turn(user, "s", "user", text)
            owner[r.turn_id] = user
        await mem.flush()
        for user in ("ana", "an", "bo", "nobody"):
            for hit in await mem.recall(user, query, limit=50):
                assert owner[hit.id] == user


async def test_tags_in_turn_meta_filter_every_leg(store_path) -> None:
    """tags keeps turns whose meta['tags'] has any of them, in the vector, BM25 and window legs."""
    async with open_engine(store_path) as mem:
        await mem.add_turn("ana", "s", "user", "plan the porto trip", meta={"tags": ["travel"]})
        await mem.add_turn("ana", "s", "user", "porto wine for the party", meta={"tags": ["food"]})
        await mem.add_turn("ana", "s", "user", "porto notes without tags")
        await mem.flush()
        await mem.add_turn("ana", "s", "user", "porto hotel booked", meta={"tags": "travel"})
        hits = await mem.recall("ana", "porto", tags=["travel"])
        assert sorted(h.text for h in hits) == ["plan the porto trip", "porto hotel booked"]
        vector_only = await mem._retriever.recall(
            "ana", "porto", limit=10, session_id=None, since=None, until=None, roles=None,
            kinds=None, link_depth=0, budget_tokens=None, tags=("food",), legs=("vector",))
        assert [h.text for h in vector_only] == ["porto wine for the party"]
        with pytest.raises(InvalidInput, match=r"tags\[0\]: expected a non-empty string, found int 3"):
            await mem.recall("ana", "porto", tags=[3])


async def test_retrieve_memory_includes_a_turn_not_yet_on_disk(store_path, monkeypatch) -> None:
    """With the disk held back, retrieve_memory still shows a just-added turn (from the window)."""
    import threading

    import actors.store as store_mod

    gate = threading.Event()
    original = store_mod.Store._write

    def held_write(self, segments, last_lsn, flush):
        gate.wait(10)
        return original(self, segments, last_lsn, flush)

    async with open_engine(store_path, config={"background_embedding": False}) as mem:
        monkeypatch.setattr(store_mod.Store, "_write", held_write)
        await mem.add_turn("ana", "s", "user", "my locker code is 4411")
        raw = await mem.retrieve_memory_raw("ana", "locker code", episodic_limit=2)
        gate.set()
    (item,) = raw.episodic
    assert [m.content for m in item.messages] == ["my locker code is 4411"]


EMPTY_FILTERS = ["roles", "kinds", "tags", "legs", "link_types", "category", "emotion"]


@pytest.mark.parametrize("field", EMPTY_FILTERS)
@pytest.mark.parametrize("empty", [[], ()], ids=repr)
async def test_an_empty_list_of_filter_values_is_refused_by_every_filter(
        mem: Engine, field: str, empty) -> None:
    """kinds=[] or tags=[] meant "no filter", category=[] and emotion=[] were refused, and a
    caller cannot tell "match nothing" from "match anything": every filter refuses an empty
    list, naming itself, and says to leave the filter out instead."""
    await mem.add_turn("ana", "s1", "user", "a dog in Lisbon", durable=True)
    with pytest.raises(InvalidInput, match=rf"{field}: expected a .*non-empty list .*found "
                                           rf"{re.escape(repr(empty))}") as info:
        await mem.recall("ana", "dog", **{field: empty})
    assert info.value.field == field
    assert [h.text for h in await mem.recall("ana", "dog", **{field: None})] == [
        "a dog in Lisbon"]


async def test_retrieve_memory_refuses_an_empty_list_of_legs(mem: Engine) -> None:
    """legs=[] ran every leg, as leaving it out does; it is refused as recall's is."""
    for call in (mem.retrieve_memory, mem.retrieve_memory_raw):
        with pytest.raises(InvalidInput, match=r"legs: expected a non-empty list") as info:
            await call("ana", "dog", legs=[])
        assert info.value.field == "legs"


async def test_a_filter_holds_for_notes_and_facts_the_text_index_has_not_taken(
        store_path, monkeypatch) -> None:
    """Read-your-writes with a filter: a fact and a note stored a moment ago, not yet in the
    text index, were dropped by every filter that names a field (category, where, a note's
    tag), because the window leg judged the index's record, whose fields it did not read; with
    tags and where together the mask failed outright on that record. A filter now admits them
    exactly as it admits them once indexed."""
    filters = [{"kinds": ["fact"], "category": "identity"},
               {"kinds": ["fact"], "where": {"category": "identity"}},
               {"kinds": ["note"], "where": {"tags": {"contains": "work"}}},
               {"tags": ["work"], "where": {"kind": "note"}}]
    async with open_engine(store_path, config={"background_embedding": False}) as mem:

        async def admitted() -> list[list[str]]:
            return [[h.id for h in await mem.recall("ana", "Acme Robotics", **f)]
                    for f in filters]

        with text_index_held(monkeypatch):
            fact = await mem.remember_fact("ana", "identity", "employer", "Acme Robotics",
                                           text="works at Acme Robotics")
            await mem.remember_fact("ana", "preference", "robots", "Acme Robotics kits",
                                    text="likes Acme Robotics kits")
            note = await mem.store_note("ana", "Acme Robotics badge is in the drawer",
                                        tags=["work"])
            assert mem._fulltext.indexed_lsn < fact.lsn
            unindexed = await admitted()
            assert mem._fulltext.indexed_lsn < fact.lsn
        await mem.flush()
        indexed = await admitted()
        assert indexed == [[fact.fact_id], [fact.fact_id], [note.note_id], [note.note_id]]
        assert unindexed == indexed
