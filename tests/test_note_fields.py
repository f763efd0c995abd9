"""Seed 000's note fields: importance, emotion and category, stored, filtered, moved, shown."""

from __future__ import annotations

import json
import unicodedata
from datetime import datetime

import httpx
import msgspec
import pytest

from actors.base.records import Note
from engine import InvalidInput

from .conftest import open_engine


async def test_an_emotion_label_typed_decomposed_is_the_label(mem) -> None:
    """'alegría' sent decomposed (NFD: the accent a combining mark) is the label 'alegría',
    not a refusal for a character outside letters and digits, nor a label of its own."""
    note = await mem.store_note("ana", "got the Lisbon offer",
                                emotion=unicodedata.normalize("NFD", "Alegría"))
    assert note.emotion == "alegría"
    found = await mem.recall("ana", "Lisbon offer", emotion="alegría")
    assert [h.id for h in found] == [note.note_id]


@pytest.mark.parametrize("label", ["खुशी", "ความสุข", "আনন্দ", "İyi", "naïve"])
async def test_an_emotion_label_in_a_script_with_combining_marks_is_taken(mem, label) -> None:
    """Hindi, Thai and Bengali words, and Turkish 'İ' (lower-cased to 'i' and a combining
    dot), were refused as "not letters": the check took combining marks for punctuation. A
    user's own emotion words are stored, and recall filters by them."""
    note = await mem.store_note("ana", "felt this about the Lisbon offer", emotion=label)
    assert note.emotion == " ".join(unicodedata.normalize("NFC", label).split()).lower()
    found = await mem.recall("ana", "Lisbon offer", emotion=label)
    assert [h.id for h in found] == [note.note_id]
    # A mark belongs to the letter before it: none after a space, a '-' or nothing.
    for bad in ("joy!", "-joy", "\u0301joy", "joy \u0301", "joy-\u0301x"):
        with pytest.raises(InvalidInput, match="emotion"):
            await mem.store_note("ana", "x", emotion=bad)


async def test_a_note_keeps_importance_emotion_and_category(store_path) -> None:
    """Stored with the note, defaults when not given, kept by an update that does not name
    them, changed by one that does; a near duplicate merges them."""
    async with open_engine(store_path) as mem:
        plain = await mem.store_note("ana", "likes long walks by the river")
        assert (plain.importance, plain.emotion, plain.category) == (0.5, "", "")
        note = await mem.store_note("ana", "was thrilled about the Lisbon offer",
                                    importance=0.9, emotion=" Joy ", category="career")
        assert (note.importance, note.emotion, note.category) == (0.9, "joy", "career")
        kept = await mem.update_note("ana", note.note_id, "was thrilled about the Lisbon job")
        assert (kept.importance, kept.emotion, kept.category) == (0.9, "joy", "career")
        changed = await mem.update_note("ana", note.note_id, "worried about the Lisbon job",
                                        importance=0.7, emotion="anxiety", category="")
        assert (changed.importance, changed.emotion, changed.category) == (0.7, "anxiety", "")
        assert await mem.get_note("ana", note.note_id) == changed
        merged = await mem.store_note("ana", "likes long walks by the river", importance=0.8,
                                      emotion="calm")
        assert merged.note_id == plain.note_id
        assert (merged.importance, merged.emotion) == (0.8, "calm")
        lower = await mem.store_note("ana", "likes long walks by the river!", importance=0.1)
        assert lower.note_id == plain.note_id and lower.importance == 0.8  # the higher stays


def test_a_note_stored_before_the_fields_reads_with_their_defaults() -> None:
    """Old stores: a note encoded without the new fields decodes with the defaults."""

    class OldNote(msgspec.Struct, array_like=True):
        lsn: int
        note_id: str
        user_id: str
        text: str
        tags: tuple[str, ...]
        created_at: datetime
        updated_at: datetime

    at = datetime.fromisoformat("2026-03-01T09:00:00+00:00")
    raw = msgspec.msgpack.encode(OldNote(7, "n1", "ana", "old", ("x",), at, at))
    note = msgspec.msgpack.decode(raw, type=Note)
    assert (note.importance, note.emotion, note.category) == (0.5, "", "")


@pytest.mark.parametrize(("kwargs", "field", "message"), [
    ({"importance": 1.5}, "importance", "expected a number from 0 to 1, found 1.5"),
    ({"importance": "high"}, "importance", "expected a number from 0 to 1"),
    ({"emotion": "!!"}, "emotion", "expected a label of letters, digits, spaces"),
    ({"emotion": "x" * 65}, "emotion", "expected at most 64 characters"),
    ({"emotion": 3}, "emotion", "expected a string"),
    ({"category": "a\x00b"}, "category", "expected no NUL character"),
])
async def test_bad_note_fields_are_refused(mem, kwargs, field, message) -> None:
    with pytest.raises(InvalidInput) as err:
        await mem.store_note("ana", "a note", **kwargs)
    assert err.value.field == field and message in str(err.value)
    assert await mem.list_notes("ana") == []


async def test_recall_filters_by_category_importance_and_emotion(store_path) -> None:
    """category matches notes' and facts' categories, min_importance their importance, emotion
    notes' labels; turns and episodes have none of them, so these filters leave them out."""
    async with open_engine(store_path, config={"long_term": False}) as mem:
        await mem.add_turn("ana", "s", "user", "Lisbon trip talk in a turn")
        await mem.store_note("ana", "Lisbon trip booked, so happy", importance=0.9,
                             emotion="joy", category="travel")
        await mem.store_note("ana", "Lisbon trip costs worry me", importance=0.3,
                             emotion="anxiety", category="travel")
        await mem.store_note("ana", "Lisbon office move", importance=0.6, category="work")
        await mem.remember_fact("ana", "travel", "next_trip", "Lisbon",
                                text="next trip is to Lisbon", importance=0.8)
        await mem.flush()

        async def texts(**filters) -> set[str]:
            return {h.text for h in await mem.recall("ana", "Lisbon trip", limit=20, **filters)}

        assert await texts(category="travel") == {
            "Lisbon trip booked, so happy", "Lisbon trip costs worry me", "next trip is to Lisbon"}
        assert await texts(category=["work"]) == {"Lisbon office move"}
        assert await texts(min_importance=0.7) == {
            "Lisbon trip booked, so happy", "next trip is to Lisbon"}
        assert await texts(emotion="JOY") == {"Lisbon trip booked, so happy"}
        assert await texts(emotion=["joy", "anxiety"], min_importance=0.5) == {
            "Lisbon trip booked, so happy"}
        assert await texts(category="travel", where={"kind": "note"}, legs=["vector"]) == {
            "Lisbon trip booked, so happy", "Lisbon trip costs worry me"}
        with pytest.raises(InvalidInput, match="min_importance: expected a number from 0 to 1"):
            await mem.recall("ana", "x", min_importance=2)
        with pytest.raises(InvalidInput, match="emotion: expected a label"):
            await mem.recall("ana", "x", emotion="??")


async def test_export_import_and_the_markdown_mirror_carry_the_fields(store_path,
                                                                      tmp_path) -> None:
    """The export's note lines (format version 2 on) carry the fields and import keeps them; a
    version 1 export still imports, with the defaults; the front matter shows them."""
    root = tmp_path / "notes"
    export = tmp_path / "ana.jsonl"
    async with open_engine(store_path, config={"notes_markdown_dir": str(root)}) as mem:
        note = await mem.store_note("ana", "loves the sea", note_id="sea", importance=0.8,
                                    emotion="joy", category="places")
        text = (root / "ana" / "sea.md").read_text(encoding="utf-8")
        assert 'category: "places"\nimportance: 0.8\nemotion: "joy"\n' in text
        await mem.export_user("ana", export)
    lines = [json.loads(line) for line in export.read_bytes().splitlines()]
    assert lines[0]["version"] == 3
    assert [(l["importance"], l["emotion"], l["category"]) for l in lines
            if l["record"] == "note"] == [(0.8, "joy", "places")]
    async with open_engine(tmp_path / "copy") as other:
        await other.import_user(export)
        assert await other.get_note("ana", "sea") == msgspec.structs.replace(
            note, lsn=(await other.get_note("ana", "sea")).lsn)
        old = [lines[0] | {"version": 1}] + [
            {k: v for k, v in l.items() if k not in ("importance", "emotion", "category")}
            for l in lines[1:]]
        await other.import_user("\n".join(json.dumps(l) for l in old).encode(), as_user="bo")
        bo = await other.get_note("bo", "sea")
        assert (bo.importance, bo.emotion, bo.category) == (0.5, "", "")
        # A label as another tool wrote it is stored as the engine keeps labels, so the
        # emotion filter finds it.
        odd = [lines[0]] + [l | {"emotion": unicodedata.normalize("NFD", " Alegría ")}
                            if l["record"] == "note" else l for l in lines[1:]]
        await other.import_user("\n".join(json.dumps(l) for l in odd).encode(), as_user="cy")
        assert (await other.get_note("cy", "sea")).emotion == "alegría"


async def test_the_http_api_stores_shows_and_filters_the_fields(store_path) -> None:
    """POST and PUT take the fields, GET shows them, recall filters by them."""
    from engine._server import create_app

    async with open_engine(store_path) as mem, httpx.AsyncClient(
            transport=httpx.ASGITransport(app=create_app(mem)), base_url="http://127.0.0.1") as http:
        made = (await http.post("/v1/users/ana/notes", json={
            "text": "Lisbon flat found", "importance": 0.9, "emotion": "relief",
            "category": "home"})).json()
        assert (made["importance"], made["emotion"], made["category"]) == (0.9, "relief", "home")
        url = f"/v1/users/ana/notes/{made['note_id']}"
        put = (await http.put(url, json={"text": "Lisbon flat signed", "importance": 0.95})).json()
        assert (put["importance"], put["emotion"]) == (0.95, "relief")
        await http.post("/v1/users/ana/notes", json={"text": "Lisbon flat too dear"})
        await mem.flush()
        hits = (await http.post("/v1/users/ana/recall", json={
            "query": "Lisbon flat", "min_importance": 0.9, "emotion": "relief",
            "category": "home"})).json()["hits"]
        assert [h["text"] for h in hits] == ["Lisbon flat signed"]
        bad = await http.post("/v1/users/ana/notes", json={"text": "x", "importance": 2})
        assert bad.status_code == 422


async def test_a_category_filter_matches_however_the_category_was_spelt(store_path) -> None:
    """The engine takes "Identity", " identity " and "IDENTITY" (and a decomposed "é") as one
    category: a fact under one supersedes the fact under another, and profile(category=)
    finds either. recall's category filter and where={"category": ...} compared the spelling
    exactly, in every leg, and silently left out memories of that category."""
    nfd = unicodedata.normalize("NFD", "Préférence")
    async with open_engine(store_path, config={"long_term": False}) as mem:
        await mem.remember_fact("ana", "Identity", "location", "Lisbon")
        await mem.remember_fact("ana", " identity", "location", "Porto")
        await mem.store_note("ana", "Porto tram rides at dawn", category="préférence")
        await mem.store_note("ana", "Porto bakeries first", category=f" {nfd} ")
        await mem.flush()
        assert [f.value for f in await mem.profile("ana", category="IDENTITY")] == ["Porto"]

        async def texts(**filters) -> set[str]:
            return {h.text for h in await mem.recall("ana", "Porto", limit=20, **filters)}

        for spelling in ("identity", "Identity", "  IDENTITY "):
            assert await texts(category=spelling) == {"location: Porto"}
            assert await texts(where={"category": spelling}) == {"location: Porto"}
            assert await texts(category=[spelling], legs=["vector"]) == {"location: Porto"}
        both = {"Porto tram rides at dawn", "Porto bakeries first"}
        for spelling in ("préférence", "PRÉFÉRENCE", nfd, " Préférence "):
            assert await texts(category=spelling) == both
            assert await texts(where={"category": {"in": [spelling, "x"]}}) == both
        assert await texts(where={"category": {"contains": "FÉR"}}) == both
        # A space is looked for as it is: no category here has one once folded.
        assert await texts(where={"category": {"contains": " "}}) == set()
        assert await texts(where={"category": {"ne": "Préférence"}, "kind": "note"}) == set()
