"""Hostile calls to links, reviews and session closing and summaries: each gives a correct
result or an InvalidInput naming its field, and the store verifies afterwards."""

from __future__ import annotations

import contextlib
import math
from datetime import timedelta

import pytest
import trio

import actors.store as store_mod

from engine import Engine, InvalidInput, NotFound
from engine._recall import record_shown
from engine._retrieval import LINK_FANOUT

from .conftest import T0, StepClock, open_engine, raw_databases


async def _verified(store_path) -> None:
    report = await Engine.verify(store_path)
    assert report["ok"], report["problems"]


async def test_a_user_never_links_to_or_reaches_another_users_memory(store_path) -> None:
    """Linking across users is refused, and neither links nor recall show one user another's
    memory."""
    async with open_engine(store_path, clock=StepClock()) as mem:
        ana = await mem.add_turn("ana", "s1", "user", "zebra stripes are unique")
        bo = await mem.add_turn("bo", "s1", "user", "zebra secrets of bo")
        await mem.flush()
        with pytest.raises(NotFound, match="to_id"):
            await mem.link("ana", ana.turn_id, bo.turn_id, "relates_to")
        with pytest.raises(NotFound, match="from_id"):
            await mem.link("ana", bo.turn_id, ana.turn_id, "relates_to")
        assert await mem.links("ana", bo.turn_id) == []
        assert await mem.links("bo", ana.turn_id) == []
        hits = await mem.recall("bo", "zebra", limit=5, link_depth=5)
        assert {h.id for h in hits} == {bo.turn_id}
    await _verified(store_path)


async def test_self_links_deleted_ends_and_bad_types_are_refused(store_path) -> None:
    """A self-link, a deleted note and malformed types are refused by field; any unicode
    type and a second type for one pair are kept."""
    async with open_engine(store_path, clock=StepClock()) as mem:
        a = await mem.add_turn("ana", "s1", "user", "alpha")
        note = await mem.store_note("ana", "a note to delete")
        await mem.flush()
        with pytest.raises(InvalidInput, match="to_id"):
            await mem.link("ana", a.turn_id, a.turn_id, "self")
        await mem.delete_note("ana", note.note_id)
        with pytest.raises(NotFound, match="to_id"):
            await mem.link("ana", a.turn_id, note.note_id, "relates_to")
        for bad in ("", "x" * 300, "a\x00b", "\ud800", None, 3, b"t"):
            with pytest.raises(InvalidInput, match="type"):
                await mem.link("ana", a.turn_id, "nope", bad)
        b = await mem.add_turn("ana", "s1", "user", "beta")
        await mem.flush()
        await mem.link("ana", a.turn_id, b.turn_id, "関連 🦓")
        await mem.link("ana", b.turn_id, a.turn_id, "relates_to")
        got = {(l.from_id, l.to_id, l.type) for l in await mem.links("ana", a.turn_id)}
        assert got == {(a.turn_id, b.turn_id, "関連 🦓"), (b.turn_id, a.turn_id, "relates_to")}
    await _verified(store_path)


async def test_a_ring_of_links_is_walked_once_at_the_deepest_depth(store_path) -> None:
    """A ring (and a two-cycle) expands to each memory once, at link_depth 5."""
    async with open_engine(store_path, clock=StepClock()) as mem:
        ring = [await mem.add_turn("ana", "s1", "user", f"ring member {i} quokka" if i == 0
                                   else f"plain member {i}") for i in range(9)]
        await mem.flush()
        for i, t in enumerate(ring):
            await mem.link("ana", t.turn_id, ring[(i + 1) % len(ring)].turn_id, "next")
            await mem.link("ana", ring[(i + 1) % len(ring)].turn_id, t.turn_id, "prev")
        hits = await mem.recall("ana", "quokka", limit=1, link_depth=5, legs=["bm25"])
        ids = [h.id for h in hits]
        assert ids[0] == ring[0].turn_id and len(ids) == len(set(ids)) == 9
    await _verified(store_path)


async def test_a_hub_of_thousands_of_links_gives_a_bounded_recall(store_path) -> None:
    """One memory linked to 2,000 others: expansion returns a bounded number of hits."""
    async with open_engine(store_path, clock=StepClock()) as mem:
        hub = await mem.add_turn("ana", "s1", "user", "the quokka hub")
        spokes = await mem.add_turns([{"user_id": "ana", "session_id": "s2", "role": "user",
                                       "text": f"spoke {i}"} for i in range(2000)])
        await mem.flush()
        async with trio.open_nursery() as nursery:
            limiter = trio.Semaphore(32)

            async def link(to_id: str) -> None:
                async with limiter:
                    await mem.link("ana", hub.turn_id, to_id, "relates_to")
            for s in spokes:
                nursery.start_soon(link, s.turn_id)
        assert len(await mem.links("ana", hub.turn_id)) == 2000
        hits = await mem.recall("ana", "quokka", limit=3, link_depth=2, legs=["bm25"])
        assert hits[0].id == hub.turn_id
        assert 1 < len(hits) <= 3 + 3 * LINK_FANOUT, len(hits)
    await _verified(store_path)


async def test_review_refuses_other_users_notes_facts_and_odd_ratings(store_path) -> None:
    """Only the caller's episodes and turns are reviewable, with the four ratings."""
    async with open_engine(store_path, clock=StepClock()) as mem:
        ana = await mem.add_turn("ana", "s1", "user", "I like tea")
        bo = await mem.add_turn("bo", "s1", "user", "I like coffee")
        note = await mem.store_note("ana", "a note")
        fact = await mem.remember_fact("ana", "drink", "tea", "green")
        await mem.flush()
        for other in (bo.turn_id, note.note_id, fact.fact_id, "missing"):
            with pytest.raises(NotFound, match="memory_id"):
                await mem.review("ana", other, "good")
        for rating in (True, 1.0, "GOOD", 0, 5, None, [], "", 3.0):
            with pytest.raises(InvalidInput, match="rating"):
                await mem.review("ana", ana.turn_id, rating)
        assert (await mem.review("ana", ana.turn_id, 3)).reps == 1
    await _verified(store_path)


async def test_reviews_with_the_clock_going_back_and_by_the_thousand_stay_finite(
        store_path) -> None:
    """A clock set back never moves a review before the last; a thousand reviews of each
    rating keep stability and difficulty finite and in range."""
    clock = StepClock()
    async with open_engine(store_path, clock=clock) as mem:
        turn = await mem.add_turn("ana", "s1", "user", "I like tea")
        await mem.flush()
        clock.now = T0 + timedelta(days=30)
        first = await mem.review("ana", turn.turn_id, "easy")
        clock.now = T0 - timedelta(days=365)
        back = await mem.review("ana", turn.turn_id, "good")
        assert back.last_review >= first.last_review and back.reps == 2
        for i in range(1000):
            state = await mem.review("ana", turn.turn_id, ("again", "easy", 1, 4)[i % 4])
            assert math.isfinite(state.stability) and state.stability > 0
            assert math.isfinite(state.difficulty) and 1 <= state.difficulty <= 10
    await _verified(store_path)


async def test_pending_reviews_survive_forgets_and_other_sessions(store_path) -> None:
    """A pending review is rated only by its conversation's next assistant turn; a forgotten
    memory or conversation leaves nothing broken."""
    async with open_engine(store_path, clock=StepClock()) as mem:
        for i in range(6):
            await mem.add_turn("ana", "old", "user", f"We hiked the volcano trail {i}")
        await mem.flush()
        raw = await mem.retrieve_memory_raw("ana", "volcano trail", conversation_id="chat")
        shown = raw.episodic[0].id
        await mem.add_turn("ana", "other", "assistant", "The volcano trail was steep.")
        await mem.flush()
        # Another session's reply rated nothing: this review is the memory's first.
        assert (await mem.review("ana", shown, "good")).reps == 1
        await mem.add_turn("ana", "chat", "assistant", "The volcano trail was steep.")
        await mem.flush()
        assert (await mem.review("ana", shown, "good")).reps == 3
        await mem.retrieve_memory("ana", "volcano trail", conversation_id="chat")
        await mem.forget_session("ana", "old")
        await mem.add_turn("ana", "chat", "assistant", "The volcano trail was steep.")
        await mem.flush()
        with pytest.raises(NotFound, match="memory_id"):
            await mem.review("ana", shown, "good")
        for i in range(3):
            await mem.add_turn("ana", "new", "user", f"the volcano erupted {i}")
        await mem.flush()
        await mem.retrieve_memory("ana", "volcano", conversation_id="chat2")
        await mem.add_turn("ana", "chat2", "user", "tell me")
        await mem.forget_session("ana", "chat2")
        await mem.add_turn("ana", "chat2", "assistant", "volcano again")
        await mem.flush()
        assert await mem.failures() == []
    async with open_engine(store_path, clock=StepClock()) as mem:
        assert [t.seq for t in await mem.session_history("ana", "chat2")] == [0]
    await _verified(store_path)


async def test_close_session_unknown_twice_and_beside_add_turn(store_path) -> None:
    """An unknown session is NotFound; closing twice or beside add_turn loses no turn."""
    async with open_engine(store_path, clock=StepClock()) as mem:
        with pytest.raises(NotFound, match="session_id"):
            await mem.close_session("ana", "nope")
        for i in range(3):
            await mem.add_turn("ana", "s1", "user", f"turn {i} about gardening")
        assert await mem.close_session("ana", "s1") is True
        assert await mem.close_session("ana", "s1") is False
        async with trio.open_nursery() as nursery:
            async def add() -> None:
                for i in range(50):
                    await mem.add_turn("ana", "s1", "user", f"later {i} about roses")

            async def close() -> None:
                for _ in range(10):
                    await mem.close_session("ana", "s1")
                    await trio.lowlevel.checkpoint()
            nursery.start_soon(add)
            nursery.start_soon(close)
        await mem.close_session("ana", "s1")
        await mem.flush()
        turns = await mem.session_history("ana", "s1", limit=100)
        assert [t.seq for t in turns] == list(range(53))
        covered = sorted(s for e in await mem.episodes("ana", "s1")
                         for s in range(e.first_seq, e.last_seq + 1))
        assert covered == list(range(53))
    await _verified(store_path)


async def test_write_session_summary_refuses_bad_bounds_and_forgotten_sessions(
        store_path) -> None:
    """upper_seq past the end, negative or bool, huge text and a forgotten session are
    refused by field; racing close_session keeps one summary."""
    async with open_engine(store_path, clock=StepClock()) as mem:
        for i in range(4):
            await mem.add_turn("ana", "s1", "user", f"turn {i}")
        for bad in (5, -1, True, 2**70, 1.0, None):
            with pytest.raises(InvalidInput, match="upper_seq"):
                await mem.write_session_summary("ana", "s1", "sum", bad, 0)
        with pytest.raises(InvalidInput, match="expected_epoch"):
            await mem.write_session_summary("ana", "s1", "sum", 2, True)
        with pytest.raises(InvalidInput, match="summary"):
            await mem.write_session_summary("ana", "s1", "x" * 40_000, 2, 0)
        with pytest.raises(NotFound, match="session_id"):
            await mem.write_session_summary("ana", "nope", "sum", 0, 0)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(mem.close_session, "ana", "s1")
            nursery.start_soon(mem.write_session_summary, "ana", "s1", "first", 4, 0)
        assert await mem.write_session_summary("ana", "s1", "stale", 4, 0) is False
        state = await mem.session_summary("ana", "s1")
        assert state.summary == "first" and state.epoch == 1
        await mem.forget_session("ana", "s1")
        await mem.flush()
        assert await mem.session_summary("ana", "s1") is None
        with pytest.raises(NotFound, match="session_id"):
            await mem.write_session_summary("ana", "s1", "ghost", 0, 1)
        assert await mem.session_summary("ana", "s1") is None
    await _verified(store_path)


async def test_expansion_never_brings_back_a_retracted_or_replaced_fact(store_path) -> None:
    """A fact forgotten or corrected after it was linked is not a linked hit of a recall
    of now (an ``as_of`` recall still sees the version it held then)."""
    clock = StepClock()
    async with open_engine(store_path, clock=clock) as mem:
        turn = await mem.add_turn("ana", "s1", "user", "zebra crossing talk")
        tea = await mem.remember_fact("ana", "drink", "tea", "green")
        home = await mem.remember_fact("ana", "home", "city", "Porto")
        await mem.flush()
        await mem.link("ana", turn.turn_id, tea.fact_id, "relates_to")
        await mem.link("ana", turn.turn_id, home.fact_id, "relates_to")
        linked_at = clock()
        await mem.forget_fact("ana", "drink", "tea")
        await mem.correct_fact("ana", "home", "city", "Lisbon")
        await mem.flush()
        hits = await mem.recall("ana", "zebra", limit=1, link_depth=2, legs=["bm25"])
        texts = [h.text for h in hits]
        assert hits[0].id == turn.turn_id
        assert not any("green" in t or "Porto" in t for t in texts), texts
        then = await mem.recall("ana", "zebra", limit=1, link_depth=2, legs=["bm25"],
                                as_of=linked_at)
        assert any("Porto" in h.text for h in then)
    await _verified(store_path)


async def test_forgetting_one_end_of_a_link_takes_the_link(store_path) -> None:
    """A link between two sessions goes with the session forgotten at either end, and the
    surviving end's recall no longer reaches the forgotten memory."""
    async with open_engine(store_path, clock=StepClock()) as mem:
        a = await mem.add_turn("ana", "s1", "user", "private okapi detail")
        b = await mem.add_turn("ana", "s2", "user", "zebra public detail")
        await mem.flush()
        await mem.link("ana", a.turn_id, b.turn_id, "relates_to")
        await mem.link("ana", b.turn_id, a.turn_id, "back")
        await mem.forget_session("ana", "s1")
        await mem.flush()
        assert await mem.links("ana", b.turn_id) == []
        hits = await mem.recall("ana", "zebra", limit=1, link_depth=5, legs=["bm25"])
        assert [h.id for h in hits] == [b.turn_id]
        with pytest.raises(NotFound, match="from_id"):
            await mem.link("ana", a.turn_id, b.turn_id, "relates_to")
    await _verified(store_path)


async def test_a_later_mention_never_links_to_a_forgotten_memory(store_path) -> None:
    """Maria's last mention was in a session since forgotten: her registry record no longer
    names it, and the next turn naming her is not linked to it (a shares_entity link to the
    forgotten id kept that id in the store)."""
    def holds(memory_id: str) -> bool:
        return memory_id.encode() in b"".join(
            k + v for rows in raw_databases(store_path).values() for k, v in rows)

    async with open_engine(store_path, clock=StepClock()) as mem:
        await mem.add_turn("ana", "s0", "user", "Maria lives in Lisbon.")
        gone = await mem.add_turn("ana", "s1", "user", "I met Maria in Lisbon.")
        await mem.flush()
        await mem.forget_session("ana", "s1")
    assert not holds(gone.turn_id)
    async with open_engine(store_path, clock=StepClock()) as mem:
        new = await mem.add_turn("ana", "s2", "user", "Maria called me from Lisbon.")
        await mem.flush()
        assert await mem.links("ana", new.turn_id) == []
    assert not holds(gone.turn_id)
    await _verified(store_path)


async def test_a_pending_review_naming_a_note_or_fact_rates_only_what_is_reviewable(
        store_path) -> None:
    """A pending review that names a note and a fact (a cluster's logged ``record_shown``
    may) does not fail the conversation's replies: they rate the turn and drop the rest."""
    async with open_engine(store_path, clock=StepClock()) as mem:
        turn = await mem.add_turn("ana", "s1", "user", "We hiked the volcano trail")
        note = await mem.store_note("ana", "volcano note")
        fact = await mem.remember_fact("ana", "drink", "tea", "green")
        await mem.flush()
        await record_shown(mem._parts, "ana", conversation_id="c", query="volcano",
                           memory_ids=[note.note_id, fact.fact_id, turn.turn_id],
                           texts=["volcano note", "tea: green", "We hiked the volcano trail"])
        for _ in range(2):
            await mem.add_turn("ana", "c", "assistant", "The volcano trail was steep.")
        await mem.flush()
        assert await mem.failures() == []
        assert (await mem.review("ana", turn.turn_id, "good")).reps == 2
    await _verified(store_path)


async def test_a_link_racing_the_forget_of_its_end_leaves_nothing_behind(store_path) -> None:
    """link() beside forget_session of one end: whichever lands first, no link to the
    forgotten memory stays, on disk or in links()."""
    async with open_engine(store_path, clock=StepClock()) as mem:
        keep = await mem.add_turn("ana", "keep", "user", "kept turn")
        for i in range(20):
            doomed = await mem.add_turn("ana", f"s{i}", "user", "doomed turn")
            await mem.flush()

            async def link(doomed_id: str = doomed.turn_id) -> None:
                with contextlib.suppress(NotFound):
                    await mem.link("ana", keep.turn_id, doomed_id, "relates_to")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(link)
                for _ in range(i % 5):
                    await trio.lowlevel.checkpoint()
                nursery.start_soon(mem.forget_session, "ana", f"s{i}")
        await mem.flush()
        assert await mem.links("ana", keep.turn_id) == []
    assert raw_databases(store_path).get("links", []) == []
    await _verified(store_path)


async def test_links_of_ids_at_the_byte_limit_are_kept_apart_and_go_with_a_note(
        store_path) -> None:
    """A user, two note ids and link types of 250 bytes each (past LMDB's 511-byte key):
    two types of one pair are two links, recall follows them, and deleting a note takes
    them."""
    user, first, second, kind = "ü" * 125, "é" * 124 + "a", "é" * 124 + "b", "ß" * 125
    async with open_engine(store_path, clock=StepClock()) as mem:
        await mem.store_note(user, "first note text", note_id=first)
        await mem.store_note(user, "second note different", note_id=second)
        await mem.flush()
        await mem.link(user, first, second, kind)
        await mem.link(user, first, second, kind[:-1] + "x")
        assert {l.type for l in await mem.links(user, second)} == {kind, kind[:-1] + "x"}
        hits = await mem.recall(user, "first", limit=1, link_depth=5, legs=["bm25"])
        assert [h.id for h in hits] == [first, second]
        await mem.delete_note(user, second)
        assert await mem.links(user, first) == []
    await _verified(store_path)


async def test_close_and_summary_racing_forget_session_leave_nothing(store_path) -> None:
    """close_session and write_session_summary beside forget_session of the same session:
    each answers or raises NotFound, and no episode, summary or session stays."""
    async with open_engine(store_path, clock=StepClock()) as mem:
        for i in range(12):
            session = f"s{i}"
            for j in range(5):
                await mem.add_turn("ana", session, "user", f"turn {j} about hiking {i}")

            async def close(session: str = session) -> None:
                with contextlib.suppress(NotFound):
                    await mem.close_session("ana", session)

            async def summarise(session: str = session) -> None:
                with contextlib.suppress(NotFound):
                    await mem.write_session_summary("ana", session, "hiking", 5, 0)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(close)
                nursery.start_soon(summarise)
                for _ in range(i % 4):
                    await trio.lowlevel.checkpoint()
                nursery.start_soon(mem.forget_session, "ana", session)
        await mem.flush()
        assert await mem.episodes("ana") == [] and await mem.list_sessions("ana") == []
        assert await mem.failures() == []
    left = raw_databases(store_path)
    assert not any(left.get(name) for name in ("episodes", "summaries", "sessions", "turns"))
    await _verified(store_path)


async def test_a_crash_after_links_write_leaves_no_link_to_a_forgotten_memory(
        store_path) -> None:
    """link() whose end is forgotten between its check and its write, the process dying
    right after the write (here: the next store read raises): no link is left on disk."""

    class Crash(Exception):
        """Stands for the process dying at this point."""

    async with open_engine(store_path) as mem:
        keep = await mem.add_turn("ana", "keep", "user", "kept turn", durable=True)
        doomed = await mem.add_turn("ana", "doomed", "user", "doomed turn", durable=True)
        store = mem._parts.store
        read = store.read
        reads = 0

        async def forget_after_the_check_then_crash(fn, *args):
            nonlocal reads
            if fn is store_mod.read_memories_by_id:
                reads += 1
                if reads == 2:
                    raise Crash
            result = await read(fn, *args)
            if fn is store_mod.read_memories_by_id and reads == 1:
                await mem.forget_session("ana", "doomed")
            return result

        store.read = forget_after_the_check_then_crash
        with pytest.raises((NotFound, Crash)) as raised:
            await mem.link("ana", keep.turn_id, doomed.turn_id, "relates_to")
        store.read = read
        assert await mem.links("ana", keep.turn_id) == []
        assert raised.type is NotFound and "forgotten meanwhile" in str(raised.value)
    assert raw_databases(store_path).get("links", []) == []
