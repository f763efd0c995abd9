"""The long-term memory model under hostile callers: bad input is refused with InvalidInput
naming the field, and nothing a caller sends leaves the store failing for anyone later."""

from __future__ import annotations

import io
import json
from datetime import timedelta

import pytest

from engine import InvalidInput, NotFound

from .conftest import StepClock, open_engine
from .test_export import CONFIG, FixedClock, _fill

DAWN = "1500-01-01T00:00:00Z"  # before the text index's range
NAIVE = "2026-03-01T09:00:00"  # no zone


async def test_an_import_refuses_every_bad_field_and_writes_nothing(tmp_path) -> None:
    """Dates out of range or without a zone, ints msgpack cannot hold, ids LMDB cannot key,
    labels and statuses the engine never writes, and an alias without its target, in any kind
    of record: InvalidInput naming the field, nothing written, the store usable after reopen."""
    clock = FixedClock()
    async with open_engine(tmp_path / "a", clock=clock, config=CONFIG) as mem:
        await _fill(mem, clock)
        buffer = io.BytesIO()
        await mem.export_user("maya", buffer)
    good = [json.loads(line) for line in buffer.getvalue().splitlines()]
    first = {}
    for i, line in enumerate(good):
        first.setdefault(line["record"], i)

    def changed(kind: str, **fields) -> bytes:
        lines = [dict(line) for line in good]
        lines[first[kind]] |= fields
        return b"\n".join(json.dumps(line).encode() for line in lines)

    cases = [
        (changed("note", updated_at=NAIVE), "source.updated_at", "timezone-aware"),
        (changed("note", created_at=DAWN), "source.created_at", "from 1700-01-01"),
        (changed("note", tags=["a\u0000"]), "source.tags[0]", "no NUL"),
        (changed("note", category="a\u0000"), "source.category", "no NUL"),
        (changed("note", emotion="JOY!!"), "source.emotion", "expected a label"),
        (changed("note", agent_id="a" * 400), "source.agent_id", "at most"),
        (changed("episode", start_at="9999-01-01T00:00:00Z"), "source.start_at",
         "from 1700-01-01"),
        (changed("episode", session_id="s" * 400), "source.session_id", "at most"),
        (changed("episode", stability=-1.0), "source.stability", "a positive number"),
        (changed("fact", valid_at=DAWN), "source.valid_at", "from 1700-01-01"),
        (changed("fact", access_count=2**70), "source.access_count",
         "integer from 0 to 2\\*\\*63-1"),
        (changed("fact", key="k\u0000"), "source.key", "no NUL"),
        (changed("fact", value=" "), "source.value", "non-empty"),
        (changed("fact", confidence=5.0), "source.confidence", "from 0 to 1"),
        (changed("fact", status="zombie"), "source.status", "expected one of"),
        (changed("link", at=DAWN), "source.at", "from 1700-01-01"),
        (changed("link", from_id="a" * 600), "source.from_id", "at most"),
        (changed("link", type=""), "source.type", "non-empty"),
        (changed("review", last_review=NAIVE), "source.last_review", "timezone-aware"),
        (changed("review", reps=2**70), "source.reps", "integer from 0 to 2\\*\\*63-1"),
        (changed("review", memory_id="m\u0000"), "source.memory_id", "no NUL"),
        (changed("summary", epoch=2**70), "source.epoch", "integer from 0 to 2\\*\\*63-1"),
        (changed("summary", epoch=-3), "source.epoch", "integer from 0 to 2\\*\\*63-1"),
        (changed("summary", session_id="s" * 600), "source.session_id", "at most"),
        (changed("summary", summary="x" * 40_000), "source.summary", "at most"),
        (changed("summary", updated_at=DAWN), "source.updated_at", "from 1700-01-01"),
        (changed("entity", first_seen=NAIVE), "source.first_seen", "timezone-aware"),
        (changed("entity", name=" "), "source.name", "non-empty"),
        (changed("entity", type="alias", aliases=[]), "source.aliases",
         "expected the key of the entity it names"),
    ]
    fact = good[first["fact"]]
    twice = [*good[: first["fact"] + 1],
             fact | {"fact_id": "f_other", "key": f" {fact['key'].upper()} ", "value": "else"},
             *good[first["fact"] + 1 :]]
    twice[-1] = twice[-1] | {"records": twice[-1]["records"] + 1}
    async with open_engine(tmp_path / "b", clock=clock, config=CONFIG) as mem:
        assert fact["status"] == "active"  # one file, one key spelt twice: two active values
        with pytest.raises(InvalidInput, match="expected one active version per category"):
            await mem.import_user(b"\n".join(json.dumps(line).encode() for line in twice))
        for data, field, message in cases:
            with pytest.raises(InvalidInput, match=message) as e:
                await mem.import_user(data)
            assert e.value.field == field, (field, str(e.value))
        await mem.flush()
        stats = await mem.stats()
        assert stats.turns == 0 and not await mem.failures()
        assert await mem.import_user(buffer.getvalue())
        await mem.flush()
    async with open_engine(tmp_path / "b", clock=clock, config=CONFIG) as mem:
        assert len(await mem.list_notes("maya")) == 1
        assert await mem.entity_info("maya", "pixel") is not None
        assert not await mem.failures()


async def test_review_refuses_a_rating_of_another_type(mem) -> None:
    """A list, a float or None as the rating: InvalidInput naming rating, never a TypeError
    from the ratings table, and 1.0 is not taken for 1."""
    turn = await mem.add_turn("ana", "s1", "user", "I climb on Tuesdays")
    await mem.flush()
    for rating in ([], {"good": 1}, 1.0, None, "GOOD"):
        with pytest.raises(InvalidInput, match="expected again/hard/good/easy or 1-4") as e:
            await mem.review("ana", turn.turn_id, rating)
        assert e.value.field == "rating"
    assert (await mem.review("ana", turn.turn_id, 3)).reps == 1


async def test_a_fact_key_spelt_in_another_case_or_spacing_is_the_same_fact(mem) -> None:
    """"Location " and "location" are one key: the new value supersedes the old instead of
    standing beside it, and history, confirm and forget find it by either spelling."""
    await mem.remember_fact("ana", "identity", "location", "Lisbon")
    fact = await mem.remember_fact("ana", "Identity", " Location ", "Porto", confidence=0.95)
    assert [f.value for f in await mem.profile("ana")] == ["Porto"]
    # The category the caller spelt first still finds the value that replaced it.
    assert [f.value for f in await mem.profile("ana", category="identity")] == ["Porto"]
    history = await mem.fact_history("ana", "identity", "LOCATION")
    assert [(f.value, f.status) for f in history] == [("Lisbon", "superseded"),
                                                       ("Porto", "active")]
    assert (await mem.confirm_fact("ana", "identity", "location")).fact_id == fact.fact_id
    assert await mem.forget_fact("ana", "IDENTITY", "location")
    assert await mem.profile("ana") == []


async def test_a_note_may_not_take_the_id_of_another_memory_of_its_user(mem, tmp_path) -> None:
    """A note given a turn's or a fact's id was stored, then hidden from get_note by that
    memory, and its user's export named the id twice so no store would import it: refused,
    while another user may still use the id."""
    turn = await mem.add_turn("ana", "s1", "user", "I live in Lisbon")
    fact = await mem.remember_fact("ana", "pref", "coffee", "espresso")
    for taken in (turn.turn_id, fact.fact_id):
        with pytest.raises(InvalidInput, match="expected a new note id, found .* in use") as e:
            await mem.store_note("ana", "a note of my own", note_id=taken)
        assert e.value.field == "note_id"
    note = await mem.store_note("bo", "a note of bo", note_id=turn.turn_id)
    assert await mem.get_note("bo", turn.turn_id) == note
    for user in ("ana", "bo"):
        await mem.export_user(user, tmp_path / f"{user}.jsonl")
    async with open_engine(tmp_path / "other") as other:
        for user in ("ana", "bo"):
            assert await other.import_user(tmp_path / f"{user}.jsonl")


async def test_an_import_refuses_a_second_active_value_for_a_key_the_user_has(mem) -> None:
    """Importing an export under a user who holds another active value for one of its keys
    left both active in the store (one hidden from the profile, never retired): refused, and
    nothing written; a key the user does not hold imports."""
    await mem.remember_fact("maya", "pref", "coffee", "flat white")
    await mem.remember_fact("ana", "pref", "Coffee", "espresso")
    export = io.BytesIO()
    await mem.export_user("maya", export)
    with pytest.raises(InvalidInput, match="expected no other active value of .*coffee.* "
                                           "found 'espresso'") as e:
        await mem.import_user(export.getvalue(), as_user="ana")
    assert e.value.field == "source"
    assert [(f.value, f.status) for f in await mem.fact_versions("ana")] == [
        ("espresso", "active")]
    assert await mem.import_user(export.getvalue(), as_user="bo")
    assert [f.value for f in await mem.profile("bo")] == ["flat white"]


async def test_a_first_name_alias_survives_an_export_and_import(mem, tmp_path) -> None:
    """"Maya" files under "Maya Lindqvist": the alias record named its target, so an import
    wrote it under the target's key and the first name found nothing in the new store."""
    await mem.add_turn("ana", "s1", "user", "I met Maya Lindqvist at the climbing gym.")
    await mem.add_turn("ana", "s1", "user", "Later Maya called me about the trip.")
    await mem.flush()
    before = await mem.entity_info("ana", "maya")
    assert before is not None and before.entity.name == "Maya Lindqvist"
    await mem.export_user("ana", tmp_path / "ana.jsonl")
    async with open_engine(tmp_path / "other") as other:
        await other.import_user(tmp_path / "ana.jsonl")
        after = await other.entity_info("ana", "maya")
        assert after is not None and after.entity.name == "Maya Lindqvist"
        assert [m.id for m in after.memories] == [m.id for m in before.memories]
        full = await other.entity_info("ana", "maya lindqvist")
        assert full is not None and full.entity.type == "person"


async def test_an_import_of_bytes_that_are_not_utf8_or_nest_deeply_is_refused(mem) -> None:
    """Bytes that are not UTF-8, or JSON nested past the decoder's depth, in the header or
    a later line: InvalidInput naming the line, not a UnicodeDecodeError or RecursionError."""
    export = io.BytesIO()
    await mem.add_turn("ana", "s1", "user", "hello")
    await mem.export_user("ana", export)
    head, *rest = export.getvalue().splitlines()
    cases = [
        (b'{"record":"header","user_id":"\xff"}', "line 1: expected a JSON header line"),
        (b"[" * 100_000 + b"]" * 100_000, "line 1: expected a JSON header line"),
        (b"\n".join([head, b'{"record":"turn","text":"\xff"}', *rest]),
         "line 2: expected a record of the export format"),
        (b"\n".join([head, b"[" * 100_000 + b"]" * 100_000, *rest]),
         "line 2: expected a record of the export format"),
    ]
    for data, message in cases:
        with pytest.raises(InvalidInput, match=message) as e:
            await mem.import_user(data, as_user="bo")
        assert e.value.field == "source"


async def test_update_note_without_an_id_is_refused_and_the_engine_lives(mem) -> None:
    """update_note(user, None, text) reached the store's writer with no note id and broke
    the engine for every caller: InvalidInput naming note_id, and a bystander's turn lands."""
    for note_id in (None, 7, ""):
        with pytest.raises(InvalidInput, match="expected a non-empty string") as e:
            await mem.update_note("ana", note_id, "a new text")
        assert e.value.field == "note_id"
    receipt = await mem.add_turn("bo", "s1", "user", "still here", durable=True)
    await mem.flush()
    assert (await mem.get_turn("bo", receipt.turn_id)).text == "still here"


async def test_text_mode_files_are_refused_by_export_and_import(mem) -> None:
    """A file opened in text mode (sys.stdout, open(path, "w")) as an export's dest or an
    import's source raised a TypeError from deep in the write or the parse: InvalidInput."""
    await mem.add_turn("ana", "s1", "user", "hello")
    export = io.BytesIO()
    await mem.export_user("ana", export)
    with pytest.raises(InvalidInput, match="expected a binary file") as e:
        await mem.export_user("ana", io.StringIO())
    assert e.value.field == "dest"

    class Reader:
        def read(self):
            return None

    for source in (io.StringIO(export.getvalue().decode()), Reader()):
        with pytest.raises(InvalidInput, match="expected a binary file") as e:
            await mem.import_user(source, as_user="bo")
        assert e.value.field == "source"
    assert await mem.import_user(io.BytesIO(export.getvalue()), as_user="bo")


async def test_confirming_a_fact_the_user_does_not_hold_is_not_found(mem) -> None:
    """Never remembered, or retracted: NotFound (the HTTP API's 404, as for a missing note),
    not a bare InvalidInput; forgetting it again is False."""
    await mem.remember_fact("ana", "pref", "coffee", "espresso")
    assert await mem.forget_fact("ana", "pref", "coffee")
    for key in ("coffee", "tea"):
        with pytest.raises(NotFound, match="expected an active fact") as e:
            await mem.confirm_fact("ana", "pref", key)
        assert e.value.field == "key"
        assert not await mem.forget_fact("ana", "pref", key)


async def test_a_refused_fact_names_the_confidence_it_needed_after_decay(store_path) -> None:
    """The rule compares with the active value's decayed confidence: the refusal names that,
    not the confidence it was stored with, and a value at it supersedes."""
    clock = StepClock(step=timedelta(0))
    async with open_engine(store_path, clock=clock) as mem:
        await mem.remember_fact("ana", "schedule", "gym", "mondays", confidence=0.9)
        clock.now += timedelta(days=100)  # schedule facts fade at 2% a day: 0.9 -> 0.12
        with pytest.raises(InvalidInput, match=r"confidence \(0\.12 for 'mondays'\), "
                                               r"found 0\.10") as e:
            await mem.remember_fact("ana", "schedule", "gym", "fridays", confidence=0.1)
        assert e.value.field == "confidence"
        fact = await mem.remember_fact("ana", "schedule", "gym", "fridays", confidence=0.13)
        assert [f.value for f in await mem.profile("ana")] == [fact.value]
