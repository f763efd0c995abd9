"""Scopes beyond the user (mem0's agent_id and run_id): stored, filtered inside every leg,
and forgotten exactly, nothing else with them."""

from __future__ import annotations

from datetime import datetime

import httpx
import msgspec
import pytest

from actors.base.records import SessionInfo, Turn
from engine import InvalidInput, NewTurn

from .conftest import open_engine
from .reliability.test_forget_means_gone import MARKER, _holding, _index_docs_with_marker

SCOPES = {"s_a1r1": ("a1", "r1"), "s_a1r2": ("a1", "r2"), "s_a2r3": ("a2", "r3"),
          "s_none": (None, None)}


async def _fill(mem) -> None:
    for session, (agent, run) in SCOPES.items():
        for i in range(3):
            await mem.add_turn("ana", session, "user", f"the harbour plan, part {i}, {session}",
                               agent_id=agent, run_id=run)
        await mem.store_note("ana", f"harbour note of {session}", agent_id=agent, run_id=run)
    await mem.add_turn("bo", "s_a1r1", "user", "the harbour plan of bo", agent_id="a1",
                       run_id="r1")
    await mem.flush()


async def test_turns_and_notes_carry_their_scope_and_recall_filters_inside_each_leg(
        store_path) -> None:
    """agent_id and run_id come back on turns, notes and sessions; recall keeps one scope,
    in every leg alone too."""
    async with open_engine(store_path, config={"long_term": False}) as mem:
        await _fill(mem)
        turn = (await mem.session_history("ana", "s_a1r2", 1))[0]
        assert (turn.agent_id, turn.run_id) == ("a1", "r2")
        sessions = {s.session_id: (s.agent_id, s.run_id) for s in await mem.list_sessions("ana")}
        assert sessions == {s: (a or "", r or "") for s, (a, r) in SCOPES.items()}
        note = next(n for n in await mem.list_notes("ana") if n.text.endswith("s_a2r3"))
        assert (note.agent_id, note.run_id) == ("a2", "r3")

        async def sessions_found(**scope) -> set[str]:
            found = set()
            for legs in (None, ["bm25"], ["vector"]):
                hits = await mem.recall("ana", "harbour plan note", limit=50, legs=legs, **scope)
                found |= {h.text.rsplit(" ", 1)[-1] for h in hits}
            return found

        assert await sessions_found(agent_id="a1") == {"s_a1r1", "s_a1r2"}
        assert await sessions_found(run_id="r3") == {"s_a2r3"}
        assert await sessions_found(agent_id="a1", run_id="r2") == {"s_a1r2"}
        assert await sessions_found(where={"agent_id": {"ne": "a1"}}) == {"s_a2r3", "s_none"}


async def test_a_session_belongs_to_one_scope(store_path) -> None:
    """A turn naming no scope takes its session's; naming another is refused, and a batch
    that would mix scopes in a session writes nothing."""
    async with open_engine(store_path) as mem:
        await mem.add_turn("ana", "s", "user", "first", agent_id="a1", run_id="r1")
        await mem.add_turn("ana", "s", "assistant", "second")
        assert [(t.agent_id, t.run_id) for t in await mem.session_history("ana", "s", 5)] == [
            ("a1", "r1"), ("a1", "r1")]
        with pytest.raises(InvalidInput) as err:
            await mem.add_turn("ana", "s", "user", "third", agent_id="a2")
        assert err.value.field == "agent_id"
        assert "expected 'a1', the agent_id of session 's' (a session belongs to one" in str(
            err.value)
        with pytest.raises(InvalidInput, match="run_id: expected '', the run_id of session"):
            await mem.add_turn("ana", "plain", "user", "x")
            await mem.add_turn("ana", "plain", "user", "y", run_id="r9")
        with pytest.raises(InvalidInput, match=r"items\[1\].agent_id: expected 'a3'"):
            await mem.add_turns([
                NewTurn(user_id="ana", session_id="new", role="user", text="a", agent_id="a3"),
                NewTurn(user_id="ana", session_id="new", role="user", text="b", agent_id="a4")])
        with pytest.raises(InvalidInput, match=r"items\[1\].run_id: expected ''"):
            await mem.add_turns([
                NewTurn(user_id="ana", session_id="new", role="user", text="a"),
                NewTurn(user_id="ana", session_id="new", role="user", text="b", run_id="r")])
        assert await mem.session_history("ana", "new", 5) == []
        with pytest.raises(InvalidInput, match="agent_id: expected no NUL"):
            await mem.add_turn("ana", "t", "user", "x", agent_id="a\x00b")


async def test_forget_scope_forgets_that_scope_and_nothing_else(store_path) -> None:
    """Forgetting agent a1's run r1 of ana removes its sessions (turns, and what was derived
    from them) and notes from the store and both indexes, to the bytes of the text index;
    the other runs of a1, a2, ana's unscoped memories and bo's a1/r1 stay."""
    async with open_engine(store_path) as mem:
        for i in range(3):
            await mem.add_turn("ana", "doomed", "user", f"{MARKER} harbour secret {i}",
                               agent_id="a1", run_id="r1")
        await mem.store_note("ana", f"{MARKER} harbour note", agent_id="a1", run_id="r1")
        await _fill(mem)
        before = {s.session_id for s in await mem.list_sessions("ana")}
        assert await mem.forget_scope("ana", agent_id="a1", run_id="r1") == {
            "sessions": 2, "notes": 2}
        await mem.flush()
        assert {s.session_id for s in await mem.list_sessions("ana")} == before - {
            "doomed", "s_a1r1"}
        assert sorted(n.text for n in await mem.list_notes("ana")) == [
            "harbour note of s_a1r2", "harbour note of s_a2r3", "harbour note of s_none"]
        assert [h.text for h in await mem.recall("ana", MARKER, legs=["bm25"])] == []
        assert [h.text for h in await mem.recall("ana", "harbour secret", limit=50)
                if MARKER in h.text or h.text.endswith("s_a1r1")] == []
        assert {h.text for h in await mem.recall("bo", "harbour plan")} == {
            "the harbour plan of bo"}
        assert len(await mem.recall("ana", "harbour plan", limit=50, kinds=["turn"])) == 9
        assert _index_docs_with_marker(store_path / "fulltext") == 0
        assert _holding(store_path / "fulltext", [MARKER.encode()]) == []
        with pytest.raises(InvalidInput, match="expected agent_id or run_id"):
            await mem.forget_scope("ana")
        assert await mem.forget_scope("ana", agent_id="nobody") == {"sessions": 0, "notes": 0}


def test_records_stored_before_scopes_read_with_none() -> None:
    """Old stores: a turn and a session encoded without the scope fields decode with ""."""

    class OldTurn(msgspec.Struct, array_like=True):
        lsn: int
        turn_id: str
        user_id: str
        session_id: str
        seq: int
        role: str
        text: str
        at: datetime
        meta: dict = {}

    class OldSession(msgspec.Struct, array_like=True):
        user_id: str
        session_id: str
        started_at: datetime
        last_at: datetime
        turn_count: int

    at = datetime.fromisoformat("2026-03-01T09:00:00+00:00")
    turn = msgspec.msgpack.decode(msgspec.msgpack.encode(
        OldTurn(1, "t", "ana", "s", 0, "user", "hi", at)), type=Turn)
    info = msgspec.msgpack.decode(msgspec.msgpack.encode(
        OldSession("ana", "s", at, at, 1)), type=SessionInfo)
    assert (turn.agent_id, turn.run_id, info.agent_id, info.run_id) == ("", "", "", "")


async def test_the_http_api_takes_scopes(store_path) -> None:
    """Turns and notes take agent_id and run_id, recall filters by them, DELETE .../scopes
    forgets one."""
    from engine._server import create_app

    async with open_engine(store_path) as mem, httpx.AsyncClient(
            transport=httpx.ASGITransport(app=create_app(mem)), base_url="http://127.0.0.1") as http:
        for session, agent in (("s1", "a1"), ("s2", "a2")):
            made = await http.post(f"/v1/users/ana/sessions/{session}/turns", json={
                "role": "user", "text": f"the harbour of {agent}", "agent_id": agent,
                "durable": True})
            assert made.status_code == 201
        await mem.flush()
        hits = (await http.post("/v1/users/ana/recall", json={
            "query": "harbour", "agent_id": "a2"})).json()["hits"]
        assert [h["text"] for h in hits] == ["the harbour of a2"]
        gone = await http.delete("/v1/users/ana/scopes", params={"agent_id": "a1"})
        assert gone.json() == {"sessions": 1, "notes": 0}
        assert [s["session_id"] for s in (await http.get("/v1/users/ana/sessions")).json()] == [
            "s2"]
        bad = await http.delete("/v1/users/ana/scopes")
        assert bad.status_code == 422


async def test_an_export_carries_scopes_and_an_import_keeps_them(store_path, tmp_path) -> None:
    """Turn and note lines (format version 3) carry the scope; the imported sessions keep it,
    so forget_scope works on the copy too."""
    export = tmp_path / "ana.jsonl"
    async with open_engine(store_path, config={"long_term": False}) as mem:
        await _fill(mem)
        await mem.export_user("ana", export)
    async with open_engine(tmp_path / "copy", config={"long_term": False}) as other:
        await other.import_user(export)
        sessions = {s.session_id: (s.agent_id, s.run_id) for s in await other.list_sessions("ana")}
        assert sessions == {s: (a or "", r or "") for s, (a, r) in SCOPES.items()}
        assert await other.forget_scope("ana", agent_id="a2") == {"sessions": 1, "notes": 1}


async def test_a_text_said_again_in_the_same_scope_takes_one_slot_of_recall(store_path) -> None:
    """seed 003 keeps one index entry per content hash: "sounds good" said in five sessions is
    one hit (the best ranked), and the slots go to memories that add something; said in
    another scope, or by the other role, it is another memory. History keeps every turn."""
    async with open_engine(store_path, config={"long_term": False}) as mem:
        for i in range(5):
            await mem.add_turn("ana", f"s{i}", "user", "Sounds good, see you at the harbour!",
                               agent_id="a1")
            await mem.add_turn("ana", f"s{i}", "user", f"the harbour ferry leaves at {i + 7}")
        await mem.add_turn("ana", "other", "user", "sounds good,  see you at the HARBOUR!",
                           agent_id="a2")
        await mem.add_turn("ana", "s0", "assistant", "Sounds good, see you at the harbour!")
        await mem.flush()
        for legs in (None, ["bm25"], ["vector"]):
            hits = await mem.recall("ana", "sounds good see you at the harbour", limit=8,
                                    legs=legs)
            said = sorted((h.role, h.session_id) for h in hits if "sounds good" in h.text.lower())
            assert len(said) == 3 and ("assistant", "s0") in said and ("user", "other") in said
            assert len(hits) == 8, legs  # the freed slots hold the ferry times
        assert len(await mem.session_history("ana", "s3", limit=10)) == 2


async def test_a_forgotten_session_leaves_no_turn_id_in_a_fact_that_stays(store_path) -> None:
    """A fact first said in s1 and restated in s2 kept s2's turn id among its sources after
    forget_session("s2"): in profile, in recall's turn_ids, and in the store's bytes, where
    a forget promises no byte of the session's ids is left once flush returns."""
    async with open_engine(store_path) as mem:
        await mem.add_turn("ana", "s1", "user", "I live in Lisbon", durable=True)
        await mem.flush()
        await mem.add_turn("ana", "s2", "user", "I live in Lisbon", durable=True)
        await mem.flush()
        first = (await mem.session_history("ana", "s1"))[0].turn_id
        doomed = (await mem.session_history("ana", "s2"))[0].turn_id
        await mem.forget_session("ana", "s2")
        await mem.flush()
        (fact,) = await mem.profile("ana")
        assert (fact.session_id, fact.source_turn_ids) == ("s1", (first,))
        hits = await mem.recall("ana", "Lisbon", kinds=["fact"])
        assert all(doomed not in h.turn_ids for h in hits)
    raw = b"".join(p.read_bytes() for p in store_path.rglob("*") if p.is_file())
    assert doomed.encode() not in raw
