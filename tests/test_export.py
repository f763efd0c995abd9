"""Per-user export and import: every record as JSON Lines; another store then answers the same,
and importing twice changes nothing."""

from __future__ import annotations

import io
import os
import json
import re
import unicodedata
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lmdb
import msgspec
import pytest
import trio

import engine
from actors.base.messages import PutState
from engine import Engine, InvalidInput, StoreCorrupt
from engine.__main__ import main

from .conftest import T0, open_engine

CONFIG = {"episode_after_turns": 6, "episode_keep_turns": 2}
QUERIES = ["where does she live", "the dog Pixel", "peanuts allergy", "climbing on tuesday"]


class FixedClock:
    """Both stores answer at the same moment, so time-dependent scores compare equal."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self):
        return self.now


async def _fill(mem: Engine, clock: FixedClock) -> None:
    """A user with every kind of record: sessions long enough for episodes, facts with a
    history, a note updated once, a link, a review, a summary and entities."""
    said = ["Hi! I'm Maya. I live in Lisbon now.", "Welcome, Maya!",
            "My dog Pixel loves the beach.", "Pixel sounds fun.",
            "I'm allergic to peanuts.", "Noted, no peanuts.",
            "Every Tuesday I go climbing with Ana.", "Climbing with Ana, nice.",
            "I moved to Porto last week.", "Porto is lovely."]
    for i, text in enumerate(said):
        clock.now = T0.replace(minute=i)
        await mem.add_turn("maya", "s1", "user" if i % 2 == 0 else "assistant", text,
                           meta={"channel": "web", "n": i})
    for i, text in enumerate(["Pixel chewed my shoe.", "Oh no, Pixel!", "Ana says hi."]):
        clock.now = T0.replace(hour=12, minute=i)
        await mem.add_turn("maya", "s2", "user" if i % 2 == 0 else "assistant", text)
    clock.now = T0.replace(hour=13)
    await mem.flush()
    await mem.close_session("maya", "s1")
    await mem.remember_fact("maya", "preference", "coffee", "flat white", importance=0.6)
    await mem.correct_fact("maya", "preference", "coffee", "espresso")
    note = await mem.store_note("maya", "Maya is planning a trip to Madeira", tags=["travel"])
    await mem.update_note("maya", note.note_id, "Maya booked Madeira for May", tags=["travel"])
    history = await mem.session_history("maya", "s2")
    await mem.link("maya", history[0].turn_id, history[2].turn_id, "relates_to")
    await mem.review("maya", history[0].turn_id, "easy")
    await mem.write_session_summary("maya", "s1", "Maya moved from Lisbon to Porto.", 10, 0)
    await mem.flush()
    clock.now = T0.replace(hour=14)


def plain(value):
    """Records as dicts, without what is the store's own: log positions (and so an entity's
    list of them) and the user id (an import may rename)."""
    if isinstance(value, msgspec.Struct):
        value = {k: v for k, v in msgspec.structs.asdict(value).items()
                 if k not in ("lsn", "lsns", "user_id")}
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


async def _answers(mem: Engine, user: str = "maya") -> dict:
    """Everything a caller can ask about the user, as plain data. Asking counts as use (facts
    shown in a prompt restart their decay), so rounds compare with the same round elsewhere."""
    out: dict = {"sessions": plain(await mem.list_sessions(user))}
    for info in await mem.list_sessions(user):
        out[f"history {info.session_id}"] = plain(await mem.session_history(
            user, info.session_id, limit=100))
        out[f"summary {info.session_id}"] = plain(await mem.session_summary(
            user, info.session_id))
    out["episodes"] = plain(await mem.episodes(user))
    profile = await mem.profile(user)
    out["profile"] = plain(profile)
    out["history"] = {f"{f.category}/{f.key}": plain(await mem.fact_history(
        user, f.category, f.key)) for f in profile}
    for query in QUERIES:
        hits = await mem.recall(user, query, limit=8, link_depth=1)
        # Ids, kinds, order and legs: scores move in the third decimal, as BM25's statistics
        # count the documents a text index still holds deleted (an old note version).
        out[f"recall {query}"] = [(h.id, h.kind, sorted(h.via)) for h in hits]
        out[f"scores {query}"] = [h.score for h in hits]
        out[f"prompt {query}"] = await mem.retrieve_memory(user, query)
    memories = {h.id for q in QUERIES for h in await mem.recall(user, q, limit=8)}
    out["links"] = {m: sorted(plain(await mem.links(user, m)), key=str) for m in sorted(memories)}
    out["pixel"] = plain(await mem.entity_info(user, "pixel"))
    out["stats"] = await mem.memory_stats(user)
    await mem.flush()  # the uses counted land before the next round reads the history
    return out


SHOWN_SCORE = re.compile(r"score: (-?[0-9.]+)")


def _same(after: dict, before: dict) -> bool:
    """Equal answers; scores within 0.01, also those the prompt shows rounded to two decimals
    (0.795 against 0.794 prints as 0.80 and 0.79)."""
    assert after.keys() == before.keys()
    for key, value in before.items():
        if key.startswith("scores"):
            assert after[key] == pytest.approx(value, abs=0.01), key
        elif key.startswith("prompt"):
            masked = SHOWN_SCORE.sub("score: _", after[key])
            assert masked == SHOWN_SCORE.sub("score: _", value), key
            shown = [float(s) for s in SHOWN_SCORE.findall(value)]
            assert [float(s) for s in SHOWN_SCORE.findall(after[key])] == pytest.approx(
                shown, abs=0.02), key
        else:
            assert after[key] == value, key
    return True


async def test_an_imported_user_answers_as_in_the_store_it_came_from(tmp_path) -> None:
    """Export a user, import the file into a fresh store: every question gets the same answer
    (histories, episodes, facts with history, notes, links, reviews, summary, entities, recall
    and the prompt); the followers derived nothing again; a second import writes nothing."""
    clock = FixedClock()
    export = tmp_path / "maya.jsonl"
    async with open_engine(tmp_path / "a", clock=clock, config=CONFIG) as mem:
        await _fill(mem, clock)
        counts = await mem.export_user("maya", export)
        rounds = [await _answers(mem) for _ in range(3)]
    assert counts["turn"] == 13 and counts["fact"] >= 6 and counts["note"] == 1
    assert counts["episode"] >= 2 and counts["summary"] == 1 and counts["review"] >= 1
    lines = [json.loads(line) for line in export.read_bytes().splitlines()]
    assert lines[0]["format"] == "engram-user-export" and lines[0]["version"] == 3
    assert lines[-1] == {"record": "end", "records": len(lines) - 2}
    assert "user_id" not in lines[1]  # records name no user: import may rename

    async with open_engine(tmp_path / "b", clock=clock, config=CONFIG) as mem:
        written = await mem.import_user(export)
        await mem.flush()
        assert written["turns"] == 13 and written["skipped"] == 0
        assert _same(await _answers(mem), rounds[0])
        again = await mem.import_user(export.read_bytes())
        await mem.flush()
        assert again == {"skipped": sum(counts[k] for k in ("turn", "note", "episode", "fact"))}
        assert _same(await _answers(mem), rounds[1])
        stats = await mem.stats()
    assert stats.turns == 13
    report = await Engine.verify(tmp_path / "b")
    assert report["ok"], report["problems"]
    # And after a restart, with the followers replaying the log, still nothing is derived twice.
    async with open_engine(tmp_path / "b", clock=clock, config=CONFIG) as mem:
        await mem.flush()
        assert _same(await _answers(mem), rounds[2])


async def test_import_under_another_user_and_beside_live_turns(tmp_path) -> None:
    """as_user moves the memory to another id in the same store; turns added after the import
    are extracted and compressed as usual."""
    clock = FixedClock()
    export = io.BytesIO()
    async with open_engine(tmp_path / "a", clock=clock, config=CONFIG) as mem:
        await _fill(mem, clock)
        await mem.export_user("maya", export)
        before = await _answers(mem)
        await mem.import_user(export.getvalue(), as_user="maya2")
        await mem.flush()
        assert _same(await _answers(mem, "maya2"), before)
        for i in range(6):
            await mem.add_turn("maya2", "s2", "user", f"I love sailing, day {i}.")
        await mem.flush()
        assert {f.key for f in await mem.profile("maya2")} >= {"likes:sailing"}
        episodes = await mem.episodes("maya2", "s2")
        assert episodes and episodes[0].first_seq == 0  # the imported tail was compressed too


async def _exported(store: Path, user_id: str, session_id: str, *texts: str) -> bytes:
    """An export of the user's turns, said in a store of their own."""
    async with open_engine(store) as mem:
        for text in texts:
            await mem.add_turn(user_id, session_id, "user", text)
        await mem.flush()
        export = io.BytesIO()
        await mem.export_user(user_id, export)
    return export.getvalue()


async def _lisbon_trip(store: Path) -> bytes:
    """An export of maya's two turns naming Lisbon (and Ana)."""
    return await _exported(store, "maya", "trip", "I flew to Lisbon last spring with Ana",
                           "Lisbon had amazing pastel de nata")


async def test_an_entity_the_user_has_here_takes_in_the_imports_mentions(tmp_path) -> None:
    """Imported into a user who already mentioned Lisbon here, the export's record of Lisbon
    was dropped: its memories were out of entity_info and the entity leg for good (the
    long-term layer skips imported positions). The two are merged; an import of the same
    file again adds nothing."""
    export = await _lisbon_trip(tmp_path / "a")
    async with open_engine(tmp_path / "b") as mem:
        await mem.add_turn("maya", "home", "user", "My cousin lives in Lisbon")
        await mem.flush()
        for _ in range(2):
            await mem.import_user(export)
            await mem.flush()
            info = await mem.entity_info("maya", "Lisbon")
            assert info.entity.mentions == 3
            assert sorted(h.text for h in info.memories) == [
                "I flew to Lisbon last spring with Ana", "Lisbon had amazing pastel de nata",
                "My cousin lives in Lisbon"]
        assert (await mem.entity_info("maya", "Ana")).entity.mentions == 1


async def test_an_imported_name_that_is_an_alias_here_counts_for_its_entity(tmp_path) -> None:
    """Live, "São" said by a user whose registry files it as an alias of "São Paulo" counts
    for São Paulo. Imported into such a user, an export's own entity "São" was dropped: the
    record here was an alias, so its mention was counted nowhere and its turn listed under
    no entity. It counts for the entity the alias names, as a live mention would; an import
    of the same file again adds nothing."""
    export = await _exported(tmp_path / "a", "bo", "s", "I met São and Fiona yesterday.")
    async with open_engine(tmp_path / "b") as mem:
        await mem.add_turn("ana", "s1", "user", "I met São Paulo and Fiona yesterday.")
        await mem.flush()
        assert (await mem.entity_info("ana", "São")).entity.name == "São Paulo"
        for _ in range(2):
            await mem.import_user(export, as_user="ana")
            await mem.flush()
            info = await mem.entity_info("ana", "São")
            assert (info.entity.name, info.entity.mentions) == ("São Paulo", 2)
            assert sorted(m.text for m in info.memories) == [
                "I met São Paulo and Fiona yesterday.", "I met São and Fiona yesterday."]
    assert (await Engine.verify(tmp_path / "b"))["ok"]


async def test_an_entitys_live_mentions_meanwhile_and_later_stay_counted_once(
        tmp_path, monkeypatch) -> None:
    """The import merged the export's Lisbon with the record it had read, then wrote it: a
    live mention registered in between was written over. And once 256 later mentions had
    pushed the imported memories out of the record's list, importing the file again counted
    them again. The merge now runs in the write's transaction, and adds only the memories
    this import wrote."""
    export = await _lisbon_trip(tmp_path / "a")
    async with open_engine(tmp_path / "b") as mem:
        await mem.add_turn("maya", "home", "user", "My cousin lives in Lisbon")
        await mem.flush()
        store = mem._parts.store
        original = store.write_unlogged

        async def a_live_mention_first(*ops):
            if any(isinstance(op, PutState) and op.merges for op in ops):
                store.write_unlogged = original
                await mem.add_turn("maya", "home", "user", "Back in Lisbon tonight")
                await mem.flush()
            return await original(*ops)

        monkeypatch.setattr(store, "write_unlogged", a_live_mention_first)
        await mem.import_user(export)
        await mem.flush()
        info = await mem.entity_info("maya", "Lisbon")
        assert info.entity.mentions == 4
        assert "Back in Lisbon tonight" in {h.text for h in info.memories}
        await mem.add_turns([{"user_id": "maya", "session_id": "later", "role": "user",
                              "text": f"Lisbon again, day {i}"} for i in range(260)])
        await mem.flush()
        before = (await mem.entity_info("maya", "Lisbon")).entity.mentions
        assert before >= 264  # and the episodes made of them
        await mem.import_user(export)
        await mem.flush()
        assert (await mem.entity_info("maya", "Lisbon")).entity.mentions == before


async def test_entities_an_import_writes_are_counted_once_whatever_the_writer_retries(
        tmp_path) -> None:
    """The writer writes a batch again when the map fills (it grows it first) or an op of
    it is refused; the entity merges counted themselves at every attempt, so an import
    reported twice the entities it wrote. A merge is counted from what the commit wrote."""
    export = await _exported(tmp_path / "a", "maya", "trip",
                             "I flew to Lisbon last spring with Ana")
    lines = [json.loads(line) for line in export.splitlines()]
    turn = next(line for line in lines if line["record"] == "turn")
    body = [line for line in lines if line["record"] not in ("entity", "end")]
    body += [{"record": "entity", "name": f"Entity number {i} " + "x" * 150, "type": "person",
              "aliases": [f"alias {i} {j} " + "y" * 100 for j in range(5)], "mentions": 1,
              "first_seen": turn["at"], "last_seen": turn["at"], "lsns": [turn["lsn"]],
              "last_id": turn["turn_id"]} for i in range(1500)]
    body.append({"record": "end", "records": len(body) - 1})
    data = b"".join(json.dumps(line).encode() + b"\n" for line in body)
    async with open_engine(tmp_path / "b", config={"initial_map_bytes": 1 << 20}) as mem:
        done = await mem.import_user(data)
        assert done["entities"] == len(await mem.list_entities("maya")) == 1500


async def test_a_damaged_registry_record_fails_the_import_not_the_engine(tmp_path) -> None:
    """The import's merge of an entity read the registry in the writer's transaction: a
    damaged record there (StoreCorrupt) broke the writer, and the engine stopped serving
    every user. The import reads the records it merges first, and fails alone."""
    export = await _exported(tmp_path / "a", "maya", "trip", "I flew to Berlin last spring")
    async with open_engine(tmp_path / "b") as mem:
        await mem.add_turn("maya", "home", "user", "Berlin is cold in winter")
        await mem.flush()
    env = lmdb.open(str(tmp_path / "b"), max_dbs=32)
    with env.begin(write=True) as txn:
        db = env.open_db(b"entities", txn=txn)
        key = next(k for k, _ in txn.cursor(db) if k.endswith(b"berlin"))
        value = bytearray(txn.get(key, db=db))
        value[len(value) // 2] ^= 0x01
        txn.put(key, bytes(value), db=db)
    env.close()
    async with open_engine(tmp_path / "b") as mem:
        with pytest.raises(StoreCorrupt):
            await mem.import_user(export)
        await mem.add_turn("bo", "s", "user", "a bystander's turn", durable=True)
        assert [t.text for t in await mem.session_history("bo", "s")] == ["a bystander's turn"]


async def test_bad_sources_are_refused_and_nothing_is_written(tmp_path) -> None:
    """Not an export, another version, a file cut short, a broken line, or a session that holds
    other turns here: InvalidInput naming what is wrong, and the store is as it was."""
    clock = FixedClock()
    async with open_engine(tmp_path / "a", clock=clock, config=CONFIG) as mem:
        await _fill(mem, clock)
        buffer = io.BytesIO()
        await mem.export_user("maya", buffer)
        good = buffer.getvalue().splitlines()
        await mem.add_turn("ana", "s1", "user", "not Maya's session")
        await mem.flush()
        stats = await mem.stats()
        newer = json.loads(good[0]) | {"version": 4}
        broken = json.loads(good[1]) | {"seq": "first"}
        cases = {
            b"hello\n": "line 1: expected a JSON header line",
            b'{"format": "other"}\n': "expected format 'engram-user-export'",
            json.dumps(newer).encode() + b"\n" + b"\n".join(good[1:]):
                "expected format version 1, 2 or 3, found 4",
            b"\n".join(good[:-1]): "expected an end line, found none after",
            b"\n".join(good[:-2] + good[-1:]): "the export was cut short or edited",
            b"\n".join([good[0], json.dumps(broken).encode(), *good[2:]]):
                r"line 2: expected a record of the export format, found Expected `int`",
        }
        for data, message in cases.items():
            with pytest.raises(InvalidInput, match=message) as e:
                await mem.import_user(data)
            assert e.value.field == "source"
        # A bad turn among good ones: the turns' checks run a column at a time where every
        # turn passes, so each kind of bad value must still fall to the check that names it.
        at = [i for i, line in enumerate(good) if json.loads(line)["record"] == "turn"]
        first, second = json.loads(good[at[0]]), json.loads(good[at[1]])

        def changed(i: int, line: dict) -> bytes:
            lines = list(good)
            lines[at[i]] = json.dumps(line).encode()
            return b"\n".join(lines)

        bad_turns = [
            (changed(1, second | {"turn_id": first["turn_id"]}), "source", "twice"),
            (changed(0, first | {"turn_id": "t_\u0000x"}), "source.turn_id", "no NUL"),
            (changed(0, first | {"turn_id": "t_é" * 200}), "source.turn_id", "at most"),
            (changed(0, first | {"turn_id": "t" * 251}), "source.turn_id", "250 bytes"),
            (changed(0, first | {"turn_id": "é" * 126}), "source.turn_id", "250 bytes"),
            (changed(0, first | {"turn_id": " "}), "source.turn_id", "non-empty"),
            (changed(0, first | {"session_id": "s" * 300}), "source.session_id", "at most"),
            (changed(0, first | {"text": "   "}), "source.text", "non-empty"),
            (changed(0, first | {"agent_id": "a\u0000"}), "source.agent_id", "no NUL"),
            (changed(0, first | {"meta": {"k": "x" * 70_000}}), "meta", "bytes as JSON"),
            (changed(1, second | {"role": "narrator"}), "source", "expected a role among"),
            (changed(0, first | {"at": "1500-01-01T00:00:00Z"}), "source.at",
             "expected a date from 1700-01-01"),
        ]
        for data, field, message in bad_turns:
            with pytest.raises(InvalidInput, match=message) as e:
                await mem.import_user(data, as_user="new")
            assert e.value.field == field

        def edited(kind: str, **fields: object) -> bytes:
            lines = list(good)
            i = next(i for i, line in enumerate(good) if json.loads(line)["record"] == kind)
            lines[i] = json.dumps(json.loads(good[i]) | fields).encode()
            return b"\n".join(lines)

        # Every other record's ids and ranges, as the calls that write one hold theirs.
        bad_records = [
            (edited("fact", session_id="s\u0000"), "source.session_id", "no NUL"),
            (edited("fact", source_turn_ids=["t\u0000"]), "source.source_turn_ids[0]",
             "no NUL"),
            (edited("episode", surprise=-1), "source.surprise", "from 0 to 1"),
            (edited("episode", turn_ids=[], first_seq=0, last_seq=0), "source",
             "expected the turns it covers"),
            (edited("episode", turn_ids=["t\u0000"]), "source.turn_ids[0]", "no NUL"),
        ]
        for data, field, message in bad_records:
            with pytest.raises(InvalidInput, match=message) as e:
                await mem.import_user(data, as_user="new")
            assert e.value.field == field
        with pytest.raises(InvalidInput, match="session s1: expected its 1 turns here"):
            await mem.import_user(b"\n".join(good), as_user="ana")
        with pytest.raises(InvalidInput, match="expected an export file, found nothing"):
            await mem.import_user(tmp_path / "missing.jsonl")
        with pytest.raises(InvalidInput, match="expected an export file, found a directory"):
            await mem.import_user(tmp_path)
        with pytest.raises(InvalidInput, match="found a character device at /dev/zero"):
            await mem.import_user("/dev/zero")  # would be read for ever
        await mem.flush()
        assert await mem.stats() == stats


async def test_an_export_is_read_from_a_named_pipe(tmp_path) -> None:
    """A named pipe (a shell's <(...) names one under /dev/fd) is read like a file; it used
    to be refused as "found nothing" though the CLI's own stdin worked."""
    async with open_engine(tmp_path / "a") as mem:
        await mem.add_turn("ana", "s1", "user", "hello through a pipe")
        await mem.flush()
        out = io.BytesIO()
        await mem.export_user("ana", out)
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)

    async def feed() -> None:
        await trio.to_thread.run_sync(pipe.write_bytes, out.getvalue(), abandon_on_cancel=True)

    async with open_engine(tmp_path / "b") as mem:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(feed)
            try:
                assert (await mem.import_user(pipe))["turns"] == 1
            finally:  # a writer no reader opened would wait for ever
                nursery.cancel_scope.cancel()
        await mem.flush()
        assert [t.text for t in await mem.session_history("ana", "s1")] == [
            "hello through a pipe"]


async def _two_users(path: Path, clock: FixedClock) -> tuple[list[bytes], dict]:
    """Exports of maya (every kind of record) and bo (five turns), and what the store
    answers about each (and how many fact versions maya has)."""
    async with open_engine(path, clock=clock, config=CONFIG) as mem:
        await _fill(mem, clock)
        for i in range(5):
            await mem.add_turn("bo", "s1", "user", f"Bo plays the cello, lesson {i}.")
        await mem.flush()
        sources = []
        for user in ("maya", "bo"):
            out = io.BytesIO()
            await mem.export_user(user, out)
            sources.append(out.getvalue())
        expected = {user: await _answers(mem, user) for user in ("maya", "bo")}
        expected["versions"] = len(await mem.fact_versions("maya"))
    return sources, expected


async def test_import_users_takes_many_exports_as_one_import(tmp_path) -> None:
    """``import_users`` of several exports answers as importing each alone does; one bad
    source among them, two of the same user or a list of the wrong length are refused,
    naming the source, before anything is written."""
    clock = FixedClock()
    sources, expected = await _two_users(tmp_path / "a", clock)
    async with open_engine(tmp_path / "b", clock=clock, config=CONFIG) as mem:
        broken = sources[1].replace(b'"record":"turn"', b'"record":"turm"', 1)
        refused = [
            (([sources[0], broken], None), "sources[1]", "line 2: expected a record"),
            (([sources[0], sources[1].replace(b'"meta":{}', b'"meta":{"k":"' + b"x" * 70_000
                                              + b'"}', 1)], None),
             "sources[1].meta", "bytes as JSON"),
            (([sources[0], sources[0]], None), "sources[1]", "one export per user"),
            (([sources[0], sources[1]], ["x", "x"]), "sources[1]", "one export per user"),
            (([sources[0]], ["x", "y"]), "as_users", "expected one per source"),
            ((sources[0], None), "sources", "expected a list of exports"),
        ]
        for (given, as_users), field, message in refused:
            with pytest.raises(InvalidInput, match=message) as e:
                await mem.import_users(given, as_users=as_users)
            assert e.value.field == field
        assert await mem.list_users() == []
        written = await mem.import_users(sources)
        await mem.flush()
        assert [w["turns"] for w in written] == [13, 5]
        for user in ("maya", "bo"):
            assert _same(await _answers(mem, user), expected[user])
        again = await mem.import_users(sources, as_users=[None, "bo"])
        assert [set(w) for w in again] == [{"skipped"}, {"skipped"}]
    report = await Engine.verify(tmp_path / "b")
    assert report["ok"], report["problems"]


async def test_vectors_exported_beside_a_user_are_stored_without_running_the_model(
        tmp_path) -> None:
    """``import_users`` given each user's ``export_vectors`` stores those vectors with the
    records (the model embeds nothing), the same vectors as in the source; vectors of another
    model are not used (the model embeds the records), and malformed ones are refused
    before anything is written."""
    clock = FixedClock()
    async with open_engine(tmp_path / "a", clock=clock, config=CONFIG) as mem:
        await _fill(mem, clock)
        export = io.BytesIO()
        await mem.export_user("maya", export)
        vectors = await mem.export_vectors("maya")
        expected = await _answers(mem)
    assert len(vectors.vectors) >= 13  # every turn, and the episodes, facts and note
    async with open_engine(tmp_path / "b", clock=clock, config=CONFIG) as mem:
        row = vectors.dim * 2
        first = min(vectors.vectors)

        def edited(**fields: object) -> engine.UserVectors:
            return msgspec.structs.replace(vectors, **fields)

        bad = [
            (edited(vectors={**vectors.vectors, first: b"\x00" * (row + 1)}), "found 769 bytes"),
            (edited(vectors={**vectors.vectors, first: b"\x00\x7c" * vectors.dim}),
             "expected finite vectors"),  # float16 infinity
            (edited(vectors={**vectors.vectors,
                             first: b"\x00\x3c" * (vectors.dim - 1) + b"\x00\x7e"}),
             "expected finite vectors"),  # ones, then a NaN
            (edited(vectors={**vectors.vectors,
                             first: b"\x00\xfc" + b"\x00\xbc" * (vectors.dim - 1)}),
             "expected finite vectors"),  # minus infinity, then minus ones
            (edited(vectors={**vectors.vectors, first: b"\x00\x80" * vectors.dim}),
             "not all zeros"),  # -0.0
            (edited(vectors={**vectors.vectors, first: b"\x00" * (row * 65537)}),
             "expected 1 to 65536 vectors"),
            (edited(vectors={str(k): v for k, v in vectors.vectors.items()}),
             "found str -> bytes"),
            (edited(vectors=list(vectors.vectors.values())), "found list"),
            (edited(user_id="bo"), "expected the vectors of user 'maya'"),
            ("not vectors", "expected UserVectors"),
        ]
        for given, message in bad:
            with pytest.raises(InvalidInput, match=message) as e:
                await mem.import_users([export.getvalue()], vectors=[given])
            assert e.value.field == "vectors[0]"
        with pytest.raises(InvalidInput, match="expected a list of UserVectors") as e:
            await mem.import_users([export.getvalue()], vectors=vectors)
        assert e.value.field == "vectors"
        assert await mem.list_users() == []
        await mem.import_users([export.getvalue()], vectors=[vectors])
        await mem.flush()
        stats = await mem.stats()
        assert (stats.texts_embedded, stats.vectors_imported) == (0, len(vectors.vectors))
        assert sorted((await mem.export_vectors("maya")).vectors.values()) == sorted(
            vectors.vectors.values())
        assert _same(await _answers(mem), expected)
    other = msgspec.structs.replace(vectors, model="another-model")
    async with open_engine(tmp_path / "c", clock=clock, config=CONFIG) as mem:
        await mem.import_users([export.getvalue()], vectors=[other])
        await mem.flush()
        assert (await mem.stats()).texts_embedded >= 13
    # Some vectors given, some not: the model embeds exactly the others, in the same steps.
    some = dict(sorted(vectors.vectors.items())[::2])
    async with open_engine(tmp_path / "d", clock=clock, config=CONFIG) as mem:
        await mem.import_users([export.getvalue()], vectors=[edited(vectors=some)])
        await mem.flush()
        stats = await mem.stats()
        assert stats.vectors_imported == len(some)
        assert stats.texts_embedded + stats.embed_cache_hits >= len(vectors.vectors) - len(some)
        assert sorted((await mem.export_vectors("maya")).vectors.values()) == sorted(
            vectors.vectors.values())


def test_the_command_line_exports_to_stdout_and_imports_a_file(tmp_path, capfd) -> None:
    """`export STORE --user ID > file` and `import STORE file` move a user between stores;
    the export's counts go to stderr so stdout is the file."""
    clock = FixedClock()

    async def fill() -> dict:
        async with open_engine(tmp_path / "a", clock=clock, config=CONFIG) as mem:
            await _fill(mem, clock)
            return msgspec.to_builtins(await mem.profile("maya"))

    profile = trio.run(fill)
    assert main(["export", str(tmp_path / "a"), "--user", "maya"]) == 0
    out, err = capfd.readouterr()
    assert "maya: 13 turn" in err
    export = tmp_path / "maya.jsonl"
    export.write_text(out)
    async def make_target() -> None:
        async with open_engine(tmp_path / "b"):
            pass
    trio.run(make_target)
    assert main(["import", str(tmp_path / "b"), str(export), "--json"]) == 0
    assert json.loads(capfd.readouterr().out)["turns"] == 13

    async def read() -> dict:
        async with open_engine(tmp_path / "b", clock=clock) as mem:
            return msgspec.to_builtins(await mem.profile("maya"))

    assert trio.run(read) == profile
    assert main(["export", str(tmp_path / "a"), "--user", "maya", "--out",
                 str(tmp_path / "again.jsonl")]) == 0
    assert Path(tmp_path / "again.jsonl").read_text().splitlines()[1:] == out.splitlines()[1:]


@contextmanager
def _blocks(mem: Engine, bot_at: int = 0, user: str = "") -> Iterator[list[int]]:
    """Each block an import writes first waits for room in the store's queue: the sizes of
    those waits, in order. At wait ``bot_at`` (counted from 1), a bot's turn reaches
    ``user``'s session s1 first, as a live turn can while an import waits."""
    store, reserve = mem._store, mem._store.reserve
    waits: list[int] = []

    async def hooked(n: int) -> None:
        waits.append(n)
        if len(waits) == bot_at:
            await mem.add_turn(user, "s1", "user", "hello from the bot")
        await reserve(n)

    store.reserve = hooked
    try:
        yield waits
    finally:
        del store.reserve


async def test_an_import_stopped_by_a_live_turn_leaves_no_position_marked_imported(
        tmp_path) -> None:
    """A bot's turn can reach a session while its import waits for room in the store's queue;
    the import then stops with InvalidInput. The long-term layer skips positions marked
    imported, so nothing of the block it was about to write may be marked by then: the next
    live turns would take the marked positions, and their facts would never be extracted."""
    from engine import NewTurn
    from engine._export import IMPORT_CHUNK

    async with open_engine(tmp_path / "a") as a:
        await a.add_turns([NewTurn(user_id="maya", session_id="s1", role="user",
                                   text=f"turn {i}", at=T0) for i in range(IMPORT_CHUNK + 6)])
        source = io.BytesIO()
        await a.export_user("maya", source)
    async with open_engine(tmp_path / "b") as b:
        # The second block waits for room: the bot's turn gets in.
        with pytest.raises(InvalidInput, match="expected no other turns while importing"), \
                _blocks(b, bot_at=2, user="new"):
            await b.import_user(source.getvalue(), as_user="new")
        await b.add_turn("new", "s2", "user", "I live in Lisbon.")
        await b.flush()
        assert [f.value for f in await b.profile("new")] == ["Lisbon"]
        assert len(await b.session_history("new", "s1", limit=2000)) == IMPORT_CHUNK + 1


async def test_an_import_stopped_after_a_users_records_is_completed_by_importing_again(
        tmp_path, monkeypatch) -> None:
    """``import_users`` of maya and bo stops at bo's block (a bot's turn reached bo's session
    first): maya's records are in, and what goes outside the log (reviews, past fact
    versions' ids, links, entities, the summary) was not written. Importing maya again
    writes exactly that, so she answers as in the source, no fact version twice."""
    from engine import _export

    clock = FixedClock()
    (maya, bo), expected = await _two_users(tmp_path / "a", clock)
    monkeypatch.setattr(_export, "IMPORT_CHUNK", 4)
    async with open_engine(tmp_path / "count", clock=clock, config=CONFIG) as mem:
        with _blocks(mem) as blocks:
            await mem.import_users([maya, bo])
    async with open_engine(tmp_path / "b", clock=clock, config=CONFIG) as mem:
        # The last block (bo's last turns) waits for room: the bot's turn gets in.
        with pytest.raises(InvalidInput, match="expected no other turns while importing"), \
                _blocks(mem, bot_at=len(blocks), user="bo"):
            await mem.import_users([maya, bo])
        again = await mem.import_user(maya)
        await mem.flush()
        assert set(again) >= {"skipped", "reviews"} and "turns" not in again
        assert len(await mem.fact_versions("maya")) == expected["versions"]
        assert _same(await _answers(mem), expected["maya"])
    report = await Engine.verify(tmp_path / "b")
    assert report["ok"], report["problems"]


async def test_an_export_or_import_path_that_is_no_usable_path_is_invalid_input(tmp_path) -> None:
    """A path with a NUL, a lone surrogate or a name too long, or in a folder this process
    cannot write, is InvalidInput naming dest (or source), never a ValueError or an OSError,
    and no file is left beside it."""
    async with open_engine(tmp_path / "store") as mem:
        await mem.add_turn("ana", "s", "user", "hello")
        before = sorted(p.name for p in tmp_path.iterdir())
        for dest in (tmp_path / "nul\x00", tmp_path / "\ud800", tmp_path / ("x" * 300),
                     Path("/proc/self/export.jsonl")):
            with pytest.raises(InvalidInput) as refused:
                await mem.export_user("ana", dest)
            assert refused.value.field == "dest", dest
        assert sorted(p.name for p in tmp_path.iterdir()) == before
        with pytest.raises(InvalidInput) as refused:
            await mem.import_user(tmp_path / ("x" * 300))
        assert refused.value.field == "source"
        with pytest.raises(InvalidInput) as refused:
            await mem.import_users([b"", tmp_path / ("x" * 300)])
        assert refused.value.field == "sources[1]"


class _Trickle:
    """A binary file that takes at most ``step`` bytes a write, as a pipe or a raw file may,
    and none once ``limit`` bytes are in (a reader that went away)."""

    def __init__(self, step: int, limit: int | None = None) -> None:
        self.step, self.limit, self.data = step, limit, bytearray()

    def write(self, data) -> int:
        room = self.step if self.limit is None else min(self.step, self.limit - len(self.data))
        taken = bytes(data[: max(room, 0)])
        self.data += taken
        return len(taken)


async def test_an_export_into_a_file_that_takes_part_of_a_write_is_whole_or_refused(
        mem) -> None:
    """export_user wrote its bytes with one write and ignored how many the file took: into a
    pipe or a raw file taking part of it, the export was cut and reported complete. Every
    byte is written now, or the export is refused, naming dest, with what it took."""
    for i in range(50):
        await mem.add_turn("ana", "s", "user", f"turn {i} " + "words " * 40)
    await mem.flush()  # the episodes the turns make are in, not made between two exports
    whole = io.BytesIO()
    await mem.export_user("ana", whole)
    trickle = _Trickle(1000)
    assert await mem.export_user("ana", trickle) == await mem.export_user("ana", io.BytesIO())
    # The same records (the header line holds the export's time).
    assert bytes(trickle.data).split(b"\n")[1:] == whole.getvalue().split(b"\n")[1:]
    with pytest.raises(InvalidInput, match=r"dest: expected a file that takes every byte, "
                                           r"found one that took 4000 of \d+") as refused:
        await mem.export_user("ana", _Trickle(1000, limit=4000))
    assert refused.value.field == "dest"


async def test_an_export_to_dev_stdout_on_a_pipe_writes_into_the_pipe(mem, tmp_path) -> None:
    """/dev/stdout on a pipe links to /proc/PID/fd/N, which names "pipe:[...]": the export
    followed the link, found no such file and tried to write a temporary file beside it
    ("No such file or directory"). A path that exists and is not a regular file (a device,
    a pipe, a FIFO) is written to as it is."""
    await mem.add_turn("ana", "s", "user", "I moved to Lisbon")
    read, write = os.pipe()
    try:
        counts = await mem.export_user("ana", f"/proc/self/fd/{write}")
        os.close(write)
        write = -1
        data = b""
        while chunk := os.read(read, 65536):
            data += chunk
    finally:
        os.close(read)
        if write >= 0:
            os.close(write)
    assert b"I moved to Lisbon" in data and counts
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    async with trio.open_nursery() as nursery:
        got = []
        nursery.start_soon(trio.to_thread.run_sync, lambda: got.append(fifo.read_bytes()))
        await mem.export_user("ana", fifo)
    assert b"I moved to Lisbon" in got[0] and fifo.exists() and not fifo.is_file()


async def _export_of_one_turn(path: Path, text: str) -> list[str]:
    """maya's export, as lines, from a store of one turn saying ``text``."""
    export = io.BytesIO()
    async with open_engine(path, config=CONFIG) as mem:
        await mem.add_turn("maya", "s1", "user", text)
        await mem.flush()
        await mem.export_user("maya", export)
    return export.getvalue().decode().splitlines()


async def test_an_entity_imported_with_a_decomposed_name_is_found_however_it_is_typed(
        tmp_path) -> None:
    """An export written elsewhere may spell "São Paulo" decomposed (an accent as its own
    mark). The engine keys names composed, so the imported entity is found by entity_info
    whichever way the name is sent, as one extracted here is."""
    lines = await _export_of_one_turn(tmp_path / "a", "I flew to São Paulo with Inês.")
    nfd = "\n".join(unicodedata.normalize("NFD", line) if '"entity"' in line else line
                    for line in lines)
    assert nfd != "\n".join(lines)
    async with open_engine(tmp_path / "b", config=CONFIG) as mem:
        await mem.import_user(nfd.encode())
        for name in ("São Paulo", unicodedata.normalize("NFD", "São Paulo"), "Inês"):
            info = await mem.entity_info("maya", name)
            assert info is not None and info.memories, name
            assert unicodedata.is_normalized("NFC", info.entity.name), name


async def test_a_link_to_a_memory_the_export_does_not_hold_is_not_imported(tmp_path) -> None:
    """link() joins two of the user's memories only; an export edited to link one of its
    memories to an id it does not hold imports without that link (and the rest whole)."""
    clock = FixedClock()
    async with open_engine(tmp_path / "a", clock=clock, config=CONFIG) as mem:
        await _fill(mem, clock)
        buffer = io.BytesIO()
        await mem.export_user("maya", buffer)
        lines = [json.loads(line) for line in buffer.getvalue().splitlines()]
        links = [line for line in lines if line["record"] == "link"]
        links[0]["to_id"] = "t_not_here"
        data = "\n".join(json.dumps(line) for line in lines).encode()
        counts = await mem.import_user(data, as_user="maya2")
        assert counts["links"] == len(links) - 1 and counts["turns"] > 0
        assert "t_not_here" not in {l.to_id for l in await mem.links("maya2",
                                                                     links[0]["from_id"])}


async def test_the_engines_own_export_imports_whatever_its_entities_hold(tmp_path) -> None:
    """A turn may hold any character, and the entity patterns keep what a URL holds, NUL
    included: the export of such a store imports whole. Two of an export's entities whose
    names compose the same are one entity here, counted once."""
    lines = await _export_of_one_turn(tmp_path / "a",
                                      "see https://example.com/a\x00b and São Paulo")
    entity = next(line for line in lines if '"entity"' in line and "Paulo" in line)
    twin = entity.replace("São", unicodedata.normalize("NFD", "São"))
    data = "\n".join([*lines[:-1], twin, lines[-1].replace(
        f'"records":{len(lines) - 2}', f'"records":{len(lines) - 1}')])
    async with open_engine(tmp_path / "b", config=CONFIG) as mem:
        counts = await mem.import_user(data.encode())
        assert counts["entities"] == len([line for line in lines if '"entity"' in line])
        assert (await mem.entity_info("maya", "São Paulo")) is not None


def test_exporting_a_user_the_store_does_not_hold_is_not_found(tmp_path, capsys) -> None:
    """An export of "maya" from a store holding "Maya" (a typo, a case variant in a backup
    script) wrote an empty export, returned {} and exited 0: a backup that held nothing,
    taken for one that did. It is NotFound now, naming the user, and writes no file."""
    from engine import NotFound

    store = tmp_path / "store"

    async def run() -> None:
        async with open_engine(store) as mem:
            await mem.add_turn("Maya", "s1", "user", "I live in Lisbon", durable=True)
            with pytest.raises(NotFound, match=r"'maya'.*case") as info:
                await mem.export_user("maya", tmp_path / "maya.jsonl")
            assert info.value.field == "user_id"
            assert not (tmp_path / "maya.jsonl").exists()
            assert (await mem.export_user("Maya", tmp_path / "Maya.jsonl"))["turn"] == 1

    trio.run(run)
    assert main(["export", str(store), "--user", "maya", "--out",
                 str(tmp_path / "cli.jsonl")]) == 1
    assert "'maya'" in capsys.readouterr().err and not (tmp_path / "cli.jsonl").exists()
