"""Notes (seed 003): stored, updated in place, deleted, and recalled like other memories."""

from __future__ import annotations

import unicodedata

import pytest

from engine import InvalidInput

from .conftest import open_engine, raw_databases


async def test_a_note_is_recalled_updated_and_deleted(store_path) -> None:
    """A note is found by recall; an update replaces what is found; a delete removes it."""
    async with open_engine(store_path) as mem:
        await mem.add_turn("ana", "s", "user", "we talked about the weather")
        note = await mem.store_note("ana", "prefers the window seat on trains", tags=["travel"])
        await mem.flush()
        hits = await mem.recall("ana", "window seat train")
        assert (hits[0].id, hits[0].kind, hits[0].session_id) == (note.note_id, "note", "")
        assert await mem.recall("ana", "window seat", tags=["travel"], kinds=["note"])

        updated = await mem.update_note("ana", note.note_id, "prefers the aisle seat on trains")
        assert (updated.note_id, updated.created_at) == (note.note_id, note.created_at)
        assert updated.lsn > note.lsn
        await mem.flush()
        texts = [h.text for h in await mem.recall("ana", "seat on trains", kinds=["note"])]
        assert texts == ["prefers the aisle seat on trains"]
        # The old text is gone from both indexes: "window" matches no note well enough to be
        # returned (the relevance floor), and the vector index holds the updated version only.
        assert await mem.recall("ana", "window", kinds=["note"]) == []
        nearest = await mem._ann.search("ana", (await mem.embed(["window"]))[0], 10)
        assert [lsn for lsn, _ in nearest if lsn in (note.lsn, updated.lsn)] == [updated.lsn]
        assert (await mem.get_note("ana", note.note_id)).text == "prefers the aisle seat on trains"

        assert await mem.delete_note("ana", note.note_id) is True
        assert await mem.delete_note("ana", note.note_id) is False
        await mem.flush()
        assert await mem.recall("ana", "aisle seat", kinds=["note"]) == []
        assert await mem.get_note("ana", note.note_id) is None
        assert note.lsn not in [lsn for lsn, _ in await mem._ann.search(
            "ana", (await mem.embed(["aisle seat"]))[0], 10)]


async def test_note_ids_are_per_user_and_checked(store_path) -> None:
    """Another user cannot see or update a note; ids are unique per user; refusals keep the log gapless."""
    async with open_engine(store_path) as mem:
        note = await mem.store_note("ana", "likes jazz", note_id="n_music")
        with pytest.raises(InvalidInput, match=r"note_id: expected a new note id, found 'n_music' in use"):
            await mem.store_note("ana", "likes rock", note_id="n_music")
        with pytest.raises(InvalidInput, match=r"note_id: expected the id of a note of user 'bo'"):
            await mem.update_note("bo", "n_music", "hijacked")
        assert await mem.get_note("bo", "n_music") is None
        await mem.store_note("bo", "likes rock", note_id="n_music")
        await mem.flush()
        assert [h.text for h in await mem.recall("bo", "likes jazz rock", kinds=["note"])] == ["likes rock"]
        assert (await mem.get_note("ana", "n_music")).text == note.text
    log_keys = [int.from_bytes(k, "big") for k, _ in raw_databases(store_path)["log"]]
    assert log_keys == list(range(1, len(log_keys) + 1))


async def test_forget_user_removes_notes_everywhere(store_path) -> None:
    """forget_user deletes a user's notes from the store and both indexes."""
    async with open_engine(store_path) as mem:
        await mem.store_note("zed-user", "xyzzy secret note")
        await mem.store_note("ana", "ana keeps this note")
        await mem.flush()
        await mem.forget_user("zed-user")
        await mem.flush()
        assert await mem.recall("zed-user", "xyzzy secret note") == []
        assert [h.kind for h in await mem.recall("ana", "note")] == ["note"]
    for name, items in raw_databases(store_path).items():
        for key, value in items:
            assert b"zed-user" not in key + value and b"xyzzy" not in value, name


async def test_a_near_repeat_whose_twin_is_deleted_meanwhile_is_stored_on_its_own(
        mem) -> None:
    """store_note found a note to merge into, then that note was deleted before the merge
    was written: the caller, who named no note, got NotFound for the other note's id and
    lost the note. It is stored as a new note of its own, with only its own tags."""
    twin = await mem.store_note("maya", "Maya is planning a trip to Madeira in May",
                                tags=["travel"], importance=0.9)
    memory = mem._memory
    real = memory._write_note

    async def deleted_first(user_id, text, note_id, tags, replace, given):
        if replace:  # the merge: the twin is deleted right before it is written
            assert await mem.delete_note(user_id, note_id)
        return await real(user_id, text, note_id, tags, replace, given)

    memory._write_note = deleted_first
    try:
        note = await mem.store_note("maya", "Maya is planning a trip to Madeira in late May",
                                    tags=["may"], importance=0.2)
    finally:
        memory._write_note = real
    assert note.note_id != twin.note_id
    assert (note.text, note.tags, note.importance) == (
        "Maya is planning a trip to Madeira in late May", ("may",), 0.2)
    assert await mem.get_note("maya", twin.note_id) is None
    assert await mem.get_note("maya", note.note_id) == note


async def test_a_repeated_note_is_kept_once_and_a_near_repeat_merged(mem) -> None:
    """The same note again (case and spacing aside) is skipped: the existing one comes back;
    one sharing at least 3/4 of its words is merged into it (new wording, both tags); other
    notes, and notes given an id of their own, are stored as they are (seeds 003 and 004)."""
    first = await mem.store_note("maya", "Maya is planning a trip to Madeira in May",
                                 tags=["travel"])
    again = await mem.store_note("maya", "maya is planning a trip to  Madeira in May")
    assert again == first
    near = await mem.store_note("maya", "Maya is planning a trip to Madeira in late May",
                                tags=["may"])
    assert near.note_id == first.note_id and near.tags == ("travel", "may")
    assert near.text == "Maya is planning a trip to Madeira in late May"
    other = await mem.store_note("maya", "Maya's sister Ana lives in Porto")
    named = await mem.store_note("maya", "Maya is planning a trip to Madeira in May",
                                 note_id="mine")
    assert len({first.note_id, other.note_id, named.note_id}) == 3
    assert (await mem.memory_stats("maya"))["notes"] == 3
    elsewhere = await mem.store_note("ana", "Maya is planning a trip to Madeira in May")
    assert elsewhere.note_id != first.note_id  # per user


async def test_a_note_repeated_with_its_accents_decomposed_is_the_same_note(mem) -> None:
    """The same words sent decomposed (NFD: a letter, then its accent as a combining mark) are
    the same note: skipped when exactly the same, merged when nearly so."""
    first = await mem.store_note("maya", "Coffee at the café in São Bento on Friday")
    again = await mem.store_note("maya", unicodedata.normalize(
        "NFD", "Coffee at the café in São Bento on Friday"))
    assert again == first
    near = await mem.store_note("maya", unicodedata.normalize(
        "NFD", "Coffee at the café in São Bento on Friday morning"))
    assert near.note_id == first.note_id
    assert (await mem.memory_stats("maya"))["notes"] == 1
