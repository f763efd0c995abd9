"""Ids of 251-256 bytes, which stores written before the byte limit could hold (issue 11): every
call that only reads or forgets what is there accepts them, so their owner can still read and
erase that data; every call that writes refuses them, as it refuses any id over the limit."""

from __future__ import annotations

from pathlib import Path

import pytest

import actors.base.validate as validate
from engine import InvalidInput

from ..conftest import open_engine, raw_databases

LEGACY_USER = "u" * 253  # over today's 250-byte limit, within what older stores held
LEGACY_SESSION = "s" * 254  # of a short user id: both long would not have fit one key


async def _legacy_store(path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A store as an engine before the byte limit wrote it: a 253-byte user with two sessions
    and a note, a user with a 254-byte session, and a bystander. Returns the first turn's id."""
    with monkeypatch.context() as old_rules:
        old_rules.setattr(validate, "MAX_ID_BYTES", 256)
        async with open_engine(path) as mem:
            turn = await mem.add_turn(LEGACY_USER, "short", "user", "my old locker code is 4711")
            await mem.add_turn(LEGACY_USER, "other", "user", "a second session")
            await mem.add_turn("ana", LEGACY_SESSION, "user", "ana's session with a long id")
            await mem.store_note(LEGACY_USER, "prefers the window seat", note_id="seat")
            await mem.add_turn("bystander", "s", "user", "the bystander's own turn")
            await mem.flush()
    return turn.turn_id


async def test_a_legacy_length_id_can_be_read_and_forgotten(store_path, monkeypatch) -> None:
    """History, sessions, turn, note, recall and stats answer for the legacy user; forget_session
    and forget_user erase it; the bystander keeps everything."""
    turn_id = await _legacy_store(store_path, monkeypatch)
    async with open_engine(store_path) as mem:
        history = await mem.session_history(LEGACY_USER, "short")
        assert [t.text for t in history] == ["my old locker code is 4711"]
        assert {s.session_id for s in await mem.list_sessions(LEGACY_USER)} == {"short", "other"}
        assert [t.text for t in await mem.session_history("ana", LEGACY_SESSION)] == [
            "ana's session with a long id"]
        hits = await mem.recall("ana", "long id", session_id=LEGACY_SESSION)
        assert [h.text for h in hits] == ["ana's session with a long id"]
        assert (await mem.get_turn(LEGACY_USER, turn_id)).text == "my old locker code is 4711"
        assert (await mem.get_note(LEGACY_USER, "seat")).text == "prefers the window seat"
        assert [h.text for h in await mem.recall(LEGACY_USER, "locker code")][:1] == [
            "my old locker code is 4711"]
        assert (await mem.memory_stats(LEGACY_USER))["turns"] == 2
        assert await mem.failures(LEGACY_USER) == []
        await mem.forget_session("ana", LEGACY_SESSION)
        assert await mem.session_history("ana", LEGACY_SESSION) == []
        await mem.forget_session(LEGACY_USER, "short")
        assert [s.session_id for s in await mem.list_sessions(LEGACY_USER)] == ["other"]
        await mem.forget_user(LEGACY_USER)
        await mem.flush()
        assert await mem.list_sessions(LEGACY_USER) == []
        assert await mem.get_note(LEGACY_USER, "seat") is None
    raw = raw_databases(store_path)
    assert not any(long.encode() in key for rows in raw.values() for key, _ in rows
                   for long in (LEGACY_USER, LEGACY_SESSION))
    async with open_engine(store_path) as mem:
        assert [t.text for t in await mem.session_history("bystander", "s")] == [
            "the bystander's own turn"]


async def test_a_legacy_length_id_is_still_refused_by_every_write(store_path, monkeypatch) -> None:
    """Writing under a legacy-length id is refused as any id over the limit is, saying why."""
    await _legacy_store(store_path, monkeypatch)
    async with open_engine(store_path) as mem:
        for write in (lambda: mem.add_turn(LEGACY_USER, "short", "user", "new"),
                      lambda: mem.store_note(LEGACY_USER, "new note"),
                      lambda: mem.remember_fact(LEGACY_USER, "identity", "name", "Ana"),
                      lambda: mem.retrieve_memory(LEGACY_USER, "locker")):
            with pytest.raises(InvalidInput, match="expected at most 250 bytes in UTF-8, found 253"):
                await write()
        with pytest.raises(InvalidInput, match="found 258; ids of up to 256 bytes"):
            await mem.session_history("é" * 129, "s")  # a read, but longer than any store held
