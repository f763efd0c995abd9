"""Imports of crafted exports: a file whose records clash with what the store holds, or whose
order cannot be written as it stands, is refused with InvalidInput before anything is written,
and the store answers as before."""

from __future__ import annotations

import io
import json
import re

import msgspec
import numpy as np
import pytest
import trio

from engine import Engine, InvalidInput, NewTurn, NotFound

from .conftest import T0, StepClock, open_engine


async def _lines_of(mem: Engine, user: str) -> list[dict]:
    out = io.BytesIO()
    await mem.export_user(user, out)
    return [json.loads(line) for line in out.getvalue().splitlines()]


def _file(lines: list[dict]) -> bytes:
    """The lines as an export, its end line counting them."""
    lines = [*lines[:-1], {"record": "end", "records": len(lines) - 2}]
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


async def _maya(mem: Engine) -> tuple[list[dict], str]:
    """Maya's export (four turns of s1 and a note) and her note's id."""
    for i in range(4):
        await mem.add_turn("maya", "s1", "user", f"My dog Pixel likes the beach, day {i}")
    note = await mem.store_note("maya", "Maya plans a trip to Madeira", tags=["travel"])
    await mem.flush()
    return await _lines_of(mem, "maya"), note.note_id


@pytest.mark.parametrize("clash", ["note", "turn of another session"])
async def test_a_turn_taking_an_id_the_user_holds_is_refused(tmp_path, clash) -> None:
    """A turn of a new session whose id the user already holds (a note's, or a turn's in
    another session) would file the id under the new turn, so the old record could no longer
    be read, deleted or exported whole: refused, and the store is as it was."""
    async with open_engine(tmp_path / "a", clock=StepClock()) as mem:
        lines, note_id = await _maya(mem)
        turn = next(line for line in lines if line["record"] == "turn")
        taken = note_id if clash == "note" else turn["turn_id"]
        crafted = [lines[0], turn | {"turn_id": taken, "session_id": "s9", "lsn": 99},
                   lines[-1]]
        before = await mem.stats()
        with pytest.raises(InvalidInput, match=f"turn {taken}: expected an id maya does not "
                                               "hold yet") as e:
            await mem.import_user(_file(crafted), as_user="maya")
        assert e.value.field == "source"
        await mem.flush()
        assert await mem.stats() == before
        assert [s.session_id for s in await mem.list_sessions("maya")] == ["s1"]
        assert (await mem.get_note("maya", note_id)).text == "Maya plans a trip to Madeira"
        again = io.BytesIO()
        await mem.export_user("maya", again)
    async with open_engine(tmp_path / "b", clock=StepClock()) as other:
        assert (await other.import_user(again.getvalue()))["turns"] == 4


async def test_a_record_taking_the_id_of_another_kind_is_refused(tmp_path) -> None:
    """A note whose id is one of the user's turns is not that turn already imported: it is
    refused (skipping it would drop the note, and tie its entities and review to the turn)."""
    async with open_engine(tmp_path / "a", clock=StepClock()) as mem:
        lines, _ = await _maya(mem)
        turn = next(line for line in lines if line["record"] == "turn")
        note = next(line for line in lines if line["record"] == "note")
        crafted = [lines[0], note | {"note_id": turn["turn_id"], "lsn": 99}, lines[-1]]
        before = await mem.stats()
        with pytest.raises(InvalidInput, match=f"note {turn['turn_id']}: expected an id maya "
                                               "does not hold yet, found a turn"):
            await mem.import_user(_file(crafted), as_user="maya")
        await mem.flush()
        assert await mem.stats() == before


async def test_turns_whose_positions_disagree_with_their_seqs_are_refused_whole(
        tmp_path, monkeypatch) -> None:
    """Turns are written in the order of their lsns and must take their seqs in that order:
    a file where a later seq has an earlier lsn is refused before any block is written, not
    half-imported with advice to import it again (which could never finish it)."""
    from engine import _export

    monkeypatch.setattr(_export, "IMPORT_CHUNK", 4)
    async with open_engine(tmp_path / "a") as a:
        await a.add_turns([NewTurn(user_id="maya", session_id="s1", role="user",
                                   text=f"turn {i}", at=T0) for i in range(10)])
        lines = await _lines_of(a, "maya")
    at = [i for i, line in enumerate(lines) if line["record"] == "turn"]
    lines[at[5]]["lsn"], lines[at[6]]["lsn"] = lines[at[6]]["lsn"], lines[at[5]]["lsn"]
    async with open_engine(tmp_path / "b") as b:
        with pytest.raises(InvalidInput, match="session s1: expected its turns' lsns to rise "
                                               "with their seqs"):
            await b.import_user(_file(lines), as_user="new")
        await b.flush()
        assert await b.list_sessions("new") == []
    assert (await Engine.verify(tmp_path / "b"))["ok"]


async def test_records_sharing_an_lsn_are_refused(tmp_path) -> None:
    """An lsn ties a record to its vectors and to the entities that mention it: two records
    of one lsn would give the note the turn's vector. Refused, nothing written."""
    async with open_engine(tmp_path / "a", clock=StepClock()) as mem:
        lines, _ = await _maya(mem)
        vectors = await mem.export_vectors("maya")
    turn = next(line for line in lines if line["record"] == "turn")
    note = next(line for line in lines if line["record"] == "note")
    note["lsn"] = turn["lsn"]
    async with open_engine(tmp_path / "b", clock=StepClock()) as mem:
        with pytest.raises(InvalidInput, match=f"note {note['note_id']}: expected an lsn of "
                                               f"its own, found {turn['lsn']} twice"):
            await mem.import_users([_file(lines)], vectors=[vectors])
        await mem.flush()
        assert await mem.list_users() == []


async def test_an_episode_of_a_session_with_no_turns_is_refused(tmp_path) -> None:
    """The store drops an episode of a session it does not hold (one forgotten while it was
    made): an import of one counted it as written and lost it, every time it was run again.
    Refused, nothing written."""
    async with open_engine(tmp_path / "a", clock=StepClock()) as mem:
        lines, _ = await _maya(mem)
    turn = next(line for line in lines if line["record"] == "turn")
    episode = {"record": "episode", "lsn": 99, "episode_id": "ep_lost", "session_id": "s9",
               "first_seq": 0, "last_seq": 1, "turn_ids": [turn["turn_id"]],
               "title": "The beach", "summary": "Pixel at the beach.", "keywords": ["beach"],
               "start_at": turn["at"], "end_at": turn["at"], "surprise": 0.5,
               "stability": 1.0, "difficulty": 5.0, "created_at": turn["at"]}
    async with open_engine(tmp_path / "b", clock=StepClock()) as mem:
        with pytest.raises(InvalidInput, match="episode ep_lost: expected a session of the "
                                               "user's turns, found s9"):
            await mem.import_user(_file([*lines[:-1], episode, lines[-1]]))
        await mem.flush()
        assert await mem.list_users() == []
        await mem.import_user(_file(lines))
        await mem.flush()
        with pytest.raises(InvalidInput, match="found s9"):
            await mem.import_user(_file([lines[0], episode, lines[-1]]))
        assert await mem.episodes("maya") == []
        ok = await mem.import_user(_file([lines[0], episode | {"session_id": "s1"}, lines[-1]]))
        assert ok["episodes"] == 1
        assert [e.episode_id for e in await mem.episodes("maya")] == ["ep_lost"]


async def test_an_episode_of_a_turn_neither_in_the_file_nor_here_is_refused(tmp_path) -> None:
    """An episode is written only if every turn it was made of is held (8f6e71f): one naming
    a turn the export lacks was counted as imported and dropped by the store. Refused before
    anything is written, as an episode of a session with no turns is."""
    async with open_engine(tmp_path / "a", clock=StepClock()) as mem:
        lines, _ = await _maya(mem)
    turns = [line for line in lines if line["record"] == "turn"]
    episode = {"record": "episode", "lsn": 99, "episode_id": "ep_ghost", "session_id": "s1",
               "first_seq": 0, "last_seq": 3,
               "turn_ids": [t["turn_id"] for t in turns[:3]] + ["t_never_said"],
               "title": "The beach", "summary": "Pixel at the beach.", "keywords": ["beach"],
               "start_at": turns[0]["at"], "end_at": turns[-1]["at"], "surprise": 0.5,
               "stability": 1.0, "difficulty": 5.0, "created_at": turns[-1]["at"]}
    async with open_engine(tmp_path / "b", clock=StepClock()) as mem:
        with pytest.raises(InvalidInput, match="episode ep_ghost: expected the turns it covers "
                                               ".*found 't_never_said'"):
            await mem.import_user(_file([*lines[:-1], episode, lines[-1]]))
        assert await mem.list_users() == []
        await mem.import_user(_file(lines))  # the turns here now, then the episode alone
        done = await mem.import_user(_file([lines[0], episode | {
            "turn_ids": [t["turn_id"] for t in turns]}, lines[-1]]))
        assert done["episodes"] == 1 and len(await mem.episodes("maya")) == 1


async def test_an_episode_at_the_place_of_another_is_refused(tmp_path) -> None:
    """An episode is kept under its session and first turn: one of another id starting at
    the same turn (in the file, or the user's own, made by closing the session here after an
    earlier import) replaced the other, whose log entry then named a record it no longer
    was: recall raised StoreTampered and verify failed. Refused, nothing written."""
    async with open_engine(tmp_path / "a", clock=StepClock()) as mem:
        lines, _ = await _maya(mem)
    turns = [line for line in lines if line["record"] == "turn"]
    episode = {"record": "episode", "lsn": 99, "episode_id": "ep_file", "session_id": "s1",
               "first_seq": 0, "last_seq": 3, "turn_ids": [t["turn_id"] for t in turns],
               "title": "The beach", "summary": "Pixel at the beach.", "keywords": ["beach"],
               "start_at": turns[0]["at"], "end_at": turns[-1]["at"], "surprise": 0.5,
               "stability": 1.0, "difficulty": 5.0, "created_at": turns[-1]["at"]}
    twin = episode | {"episode_id": "ep_twin", "lsn": 98, "last_seq": 1,
                      "turn_ids": episode["turn_ids"][:2]}
    async with open_engine(tmp_path / "b", clock=StepClock()) as mem:
        with pytest.raises(InvalidInput, match="episode ep_file: expected one episode starting "
                                               "at each turn of a session, found ep_twin"):
            await mem.import_user(_file([*lines[:-1], twin, episode, lines[-1]]))
        assert await mem.list_users() == []
        await mem.import_user(_file(lines))
        await mem.close_session("maya", "s1")
        await mem.flush()
        [mine] = await mem.episodes("maya", "s1")
        with pytest.raises(InvalidInput, match=f"episode ep_file: expected no episode of session "
                                               f"s1 starting at seq 0 here, found {mine.episode_id}"):
            await mem.import_user(_file([*lines[:-1], episode, lines[-1]]))
        await mem.flush()
        assert await mem.episodes("maya", "s1") == [mine]
        assert await mem.recall("maya", "Pixel beach", kinds=["episode"])
    assert (await Engine.verify(tmp_path / "b"))["ok"]


async def test_a_session_of_two_scopes_is_refused(tmp_path) -> None:
    """A session belongs to its first turn's agent and run, and add_turn refuses a turn of
    another: an import stored such turns under the session's scope instead, so
    forget_scope(agent_id=) of the scope they named forgot nothing of them. Refused, in
    the file and against the session here, nothing written."""
    async with open_engine(tmp_path / "a", clock=StepClock()) as mem:
        lines, _ = await _maya(mem)
    head = [line for line in lines if line["record"] != "note"][:-1]
    turns = [i for i, line in enumerate(head) if line["record"] == "turn"]

    def scoped(*agents: str) -> bytes:
        out = [dict(line) for line in head]
        for i, agent in zip(turns, agents):
            out[i]["agent_id"] = agent
        return _file([*out[:len(agents) + 1], lines[-1]])

    async with open_engine(tmp_path / "b", clock=StepClock()) as mem:
        for agents in (("alpha", "beta"), ("", "beta"), ("alpha", "")):
            with pytest.raises(InvalidInput, match="agent_id: expected .*, the agent_id of "
                                                   "session 's1'"):
                await mem.import_user(scoped(*agents))
        assert await mem.list_users() == []
        await mem.import_user(scoped("alpha", "alpha"))
        with pytest.raises(InvalidInput, match="agent_id: expected 'alpha', the agent_id of "
                                               "session 's1'.*found 'beta'"):
            await mem.import_user(scoped("alpha", "alpha", "beta"))
        await mem.flush()
        assert [t.agent_id for t in await mem.session_history("maya", "s1")] == ["alpha"] * 2
        assert await mem.import_user(scoped("alpha", "alpha", "alpha"))


async def test_a_link_or_review_given_twice_is_written_and_counted_once(tmp_path) -> None:
    """A pair holds one link of each type (either way) and a memory one review state: a file
    giving one twice (a crafted one, or an older store's export holding a link both ways)
    was stored once and counted twice in the result. The first is written, counted once."""
    async with open_engine(tmp_path / "a", clock=StepClock()) as mem:
        lines, note_id = await _maya(mem)
        turn = next(line for line in lines if line["record"] == "turn")
        await mem.link("maya", note_id, turn["turn_id"], "about")
        await mem.review("maya", turn["turn_id"], 3)
        await mem.flush()
        lines = await _lines_of(mem, "maya")
    link = next(line for line in lines if line["record"] == "link" and line["type"] == "about")
    review = next(line for line in lines if line["record"] == "review")
    back = link | {"from_id": link["to_id"], "to_id": link["from_id"]}
    links = sum(line["record"] == "link" for line in lines)
    async with open_engine(tmp_path / "b", clock=StepClock()) as mem:
        done = await mem.import_user(_file([*lines[:-1], link, back, review, lines[-1]]))
        assert (done["links"], done["reviews"]) == (links, 1)
        assert [(l.from_id, l.to_id) for l in await mem.links("maya", note_id)
                if l.type == "about"] == [(link["from_id"], link["to_id"])]


@pytest.mark.parametrize("summary, found", [
    ({"session_id": "s9"}, "session_id: expected a session of user 'maya', found none called "
                           "'s9'"),
    ({"upper_seq": 5}, "upper_seq: expected an integer from 0 to 4, found 5"),
])
async def test_a_summary_the_summary_call_would_refuse_is_refused(tmp_path, summary,
                                                                  found) -> None:
    """A session's summary is held to write_session_summary's rules: a session the user has
    (here or in the file) and an upper_seq within its turns; one past them would stand for
    turns the session has not had yet, and leave them out of every later prompt."""
    async with open_engine(tmp_path / "a", clock=StepClock()) as mem:
        lines, _ = await _maya(mem)
    turn = next(line for line in lines if line["record"] == "turn")
    line = {"record": "summary", "session_id": "s1", "epoch": 1, "summary": "Pixel again.",
            "upper_seq": 4, "updated_at": turn["at"]} | summary
    async with open_engine(tmp_path / "b", clock=StepClock()) as mem:
        with pytest.raises(InvalidInput, match=found):
            await mem.import_user(_file([*lines[:-1], line, lines[-1]]))
        await mem.flush()
        assert await mem.list_users() == []
        assert (await mem.import_user(_file([*lines[:-1], line | {"upper_seq": 4,
                                                                  "session_id": "s1"},
                                             lines[-1]])))["summaries"] == 1


async def test_a_user_forgotten_as_an_import_finishes_stays_forgotten(tmp_path) -> None:
    """forget_user can land between an import's logged records and what it writes outside
    the log (entities, links, review states, past fact versions' ids, summaries): none of
    those may come back for the forgotten user."""
    async with open_engine(tmp_path / "a", clock=StepClock()) as mem:
        lines, _ = await _maya(mem)
        history = await mem.session_history("maya", "s1")
        await mem.link("maya", history[0].turn_id, history[1].turn_id, "relates_to")
        await mem.review("maya", history[0].turn_id, "easy")
        await mem.remember_fact("maya", "pet", "dog", "Pixel")
        await mem.correct_fact("maya", "pet", "dog", "Pixel the terrier")
        await mem.write_session_summary("maya", "s1", "Pixel at the beach.", 4, 0)
        await mem.flush()
        lines = await _lines_of(mem, "maya")
    assert {"link", "review", "summary", "entity"} <= {line["record"] for line in lines}
    async with open_engine(tmp_path / "b", clock=StepClock()) as mem:
        store, write_unlogged = mem._store, mem._store.write_unlogged

        async def forget_first(*ops):
            if not forgotten:
                forgotten.append(True)
                await mem.forget_user("maya")
            await write_unlogged(*ops)

        forgotten: list[bool] = []
        store.write_unlogged = forget_first
        try:
            await mem.import_user(_file(lines))
        finally:
            del store.write_unlogged
        await mem.flush()
        assert forgotten
        assert await mem.list_users() == []
        assert await mem.list_entities("maya") == []
        assert await mem.links("maya", history[0].turn_id) == []
        assert await mem.session_summary("maya", "s1") is None
        with pytest.raises(NotFound):  # no record of maya is left to export
            await mem.export_user("maya", io.BytesIO())
    assert (await Engine.verify(tmp_path / "b"))["ok"]


async def test_an_import_block_cut_by_a_failed_commit_leaves_no_position_marked(
        tmp_path, monkeypatch) -> None:
    """An import block's range is marked imported (the long-term layer skips it) in the same
    queue as its records. Committed apart, a store that failed between the two kept the mark
    without the records, and after a restart the next live turns took the marked positions:
    their facts were never extracted. The mark and its records commit together."""
    import lmdb

    from actors.store import writer
    from engine import EngineError

    async with open_engine(tmp_path / "a") as a:
        await a.add_turns([NewTurn(user_id="maya", session_id="s1", role="user",
                                   text=f"turn {i}", at=T0) for i in range(6)])
        lines = await _lines_of(a, "maya")

    def failing(*args):
        raise lmdb.Error("the disk went away")

    with monkeypatch.context() as patch:
        patch.setattr(writer, "BATCH_MAX", 1)
        patch.setattr(writer, "BATCH_MAX_WHILE_WAITED", 1)
        patch.setattr(writer, "_put_run", failing)
        with pytest.raises(EngineError, match="the disk went away"):
            async with open_engine(tmp_path / "b") as b:
                await b.import_user(_file(lines), as_user="new")
    async with open_engine(tmp_path / "b") as b:
        await b.add_turn("new", "s2", "user", "I live in Lisbon.")
        await b.flush()
        assert [f.value for f in await b.profile("new")] == ["Lisbon"]
    assert (await Engine.verify(tmp_path / "b"))["ok"]


async def test_a_second_import_of_a_user_while_one_is_under_way_is_refused(tmp_path) -> None:
    """Each import checks what the user holds before it writes; two of one user at once each
    found the other's records absent and both wrote them: an episode stored twice under one
    key (the store then failed verify) and a fact version twice. The second is refused."""
    async with open_engine(tmp_path / "a", clock=StepClock()) as mem:
        lines, _ = await _maya(mem)
        turn = next(line for line in lines if line["record"] == "turn")
        ids = [line["turn_id"] for line in lines if line["record"] == "turn"]
        episode = {"record": "episode", "lsn": 98, "episode_id": "ep_x", "session_id": "s1",
                   "first_seq": 0, "last_seq": 3, "turn_ids": ids, "title": "The beach",
                   "summary": "Pixel at the beach.", "keywords": ["beach"],
                   "start_at": turn["at"], "end_at": turn["at"], "surprise": 0.5,
                   "stability": 1.0, "difficulty": 5.0, "created_at": turn["at"]}
        fact = {"record": "fact", "lsn": 99, "fact_id": "f_x", "category": "pet", "key": "dog",
                "value": "Pixel", "text": "Maya's dog is Pixel", "confidence": 0.9,
                "importance": 0.5, "keywords": ["dog"], "source_turn_ids": [],
                "source_episode_ids": [], "session_id": "", "valid_at": turn["at"],
                "invalid_at": None, "created_at": turn["at"], "expired_at": None,
                "status": "active", "protected": False, "origin": "api", "access_count": 0,
                "last_access_at": None}
        data = _file([lines[0], episode, fact, lines[-1]])
        store, reserve = mem._store, mem._store.reserve
        refused: list[BaseException] = []

        async def second_import_first(n: int) -> None:
            if not refused:
                refused.append(AssertionError("the second import did not stop"))
                try:
                    await mem.import_user(data)
                except InvalidInput as exc:
                    refused[0] = exc
            await reserve(n)

        store.reserve = second_import_first
        try:
            assert await mem.import_user(data) == {"episodes": 1, "facts": 1, "skipped": 0}
        finally:
            del store.reserve
        assert re.search("expected no other import of user 'maya' under way, found one",
                         str(refused[0]))
        await mem.flush()
        assert [f.fact_id for f in await mem.fact_versions("maya")].count("f_x") == 1
        assert [e.episode_id for e in await mem.episodes("maya")] == ["ep_x"]
    assert (await Engine.verify(tmp_path / "a"))["ok"]


async def test_a_fact_remembered_while_an_import_writes_that_key_leaves_one_active_value(
        tmp_path) -> None:
    """The import checks that the user holds no other active value of each fact's key, then
    writes; a remember_fact of that key landing between the two left two active versions,
    one hidden and never superseded. Now the import takes the facts' decisions' turn: the
    live call waits for it, then decides against the imported value."""
    async with open_engine(tmp_path / "a", clock=StepClock()) as mem:
        await mem.remember_fact("maya", "identity", "location", "Lisbon")
        lines = await _lines_of(mem, "maya")
    async with open_engine(tmp_path / "b", clock=StepClock()) as mem:
        store, reserve = mem._store, mem._store.reserve
        lock = mem._parts.facts._lock

        async def remember_on_first_write(n):
            if not started:
                started.append(True)
                nursery.start_soon(remember)
                # The live call runs as far as it can: through its commit (the old code), or
                # until it waits for the decisions the import holds.
                while not done and not lock.statistics().tasks_waiting:
                    await trio.sleep(0.001)
            await reserve(n)

        async def remember():
            await mem.remember_fact("maya", "identity", "location", "Porto")
            done.append(True)

        started: list[bool] = []
        done: list[bool] = []
        store.reserve = remember_on_first_write
        try:
            async with trio.open_nursery() as nursery:
                await mem.import_user(_file(lines))
        finally:
            del store.reserve
        assert done
        active = await mem.profile("maya")
        assert [(f.key, f.value) for f in active] == [("location", "Porto")]
        history = await mem.fact_history("maya", "identity", "location")
        assert [(f.value, f.status) for f in history] == [("Lisbon", "superseded"),
                                                          ("Porto", "active")]
    assert (await Engine.verify(tmp_path / "b"))["ok"]


@pytest.mark.parametrize("bad", ["counts past int64", "counts not numbers",
                                 "counts of arrays", "counts of complex ones", "not a turn line",
                                 "a text that is no string", "a NaN in a vector",
                                 "a vector of zeros"])
async def test_records_restore_users_cannot_read_are_refused_as_invalid_input(
        tmp_path, bad) -> None:
    """restore_users (a partition snapshot's records and vectors) raised OverflowError,
    ValueError or AttributeError for records or counts it could not read, and a node's
    bootstrap, which falls back to the log on InvalidInput only, stopped on them."""
    async with open_engine(tmp_path / "a") as mem:
        await mem.add_turn("ana", "s1", "user", "hello there", durable=True)
        await mem.flush()
        records, rows = await mem.export_records("ana")
    turn = records.turns[0]
    users, vectors = [records], [rows]
    if bad.startswith("counts"):
        counts = {"counts past int64": [2**63], "counts not numbers": ["x"],
                  "counts of arrays": [np.array([1, 1])], "counts of complex ones": [1 + 0j]}[bad]
        vectors = [msgspec.structs.replace(rows, counts=counts)]
    elif "vector" in bad:  # one vector a record: the rows' own check
        assert rows.counts == [1]
        data = (rows.data[:-2] + b"\x00\x7e" if "NaN" in bad
                else b"\x00\x80" * (len(rows.data) // 2))
        vectors = [msgspec.structs.replace(rows, data=data)]
    else:
        line = object() if bad == "not a turn line" else msgspec.structs.replace(turn, text=123)
        users = [msgspec.structs.replace(records, turns=[line])]
    async with open_engine(tmp_path / "b") as mem:
        with pytest.raises(InvalidInput) as refused:
            await mem.restore_users(users, vectors)
        if "vector" in bad:
            assert refused.value.field == "vectors[0]" and (
                f"record {rows.lsns[0]}" in str(refused.value))
        assert await mem.list_users() == []


@pytest.mark.parametrize("kind, field, value", [
    ("episodes", "title", "\ud800"), ("facts", "origin", "\ud800"),
    ("entities", "aliases", ("\ud800",)), ("facts", "keywords", ("ok", "\udfff"))])
async def test_a_lone_surrogate_in_any_field_of_restored_records_writes_nothing(
        tmp_path, kind, field, value) -> None:
    """restore_users takes records built in Python, which JSON's decoder never checked: a
    lone surrogate in a field the import did not look at was found by the store's writer
    after the user's other records were written (an episode's title), dropped a record and
    answered success (a fact's origin), or raised UnicodeEncodeError (an entity's alias).
    Refused as InvalidInput naming the field, nothing written, and the store serves on."""
    async with open_engine(tmp_path / "a") as mem:
        await mem.add_turn("maya", "s1", "user", "I'm moving to Lisbon with my sister Ana")
        await mem.add_turn("maya", "s1", "user", "Ana works in Porto")
        await mem.remember_fact("maya", "identity", "location", "Lisbon")
        await mem.close_session("maya", "s1")
        await mem.flush()
        records, _ = await mem.export_records("maya")
    lines = list(getattr(records, kind))
    lines[0] = msgspec.structs.replace(lines[0], **{field: value})
    bad = msgspec.structs.replace(records, **{kind: lines})
    async with open_engine(tmp_path / "b") as mem:
        with pytest.raises(InvalidInput) as refused:
            await mem.restore_users([bad], [None])
        assert refused.value.field == f"users[0].{kind}[0].{field}"
        assert "lone surrogate" in str(refused.value)
        await mem.add_turn("bo", "s", "user", "hello")
        await mem.flush()
        assert await mem.list_users() == ["bo"]
