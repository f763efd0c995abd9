"""A lone surrogate (case 4 of issue 11) cannot be encoded as UTF-8; in any text argument it is
refused at the call with InvalidInput naming the field, and the engine goes on serving."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from engine import Engine, InvalidInput

from ..conftest import open_engine

BAD = "x\ud800y"
TURN = {"user_id": "ana", "session_id": "s", "role": "user", "text": "hello"}


async def _with_note(mem: Engine, call: Callable[[Engine, str], Awaitable[Any]]) -> Any:
    return await call(mem, (await mem.store_note("ana", "a note")).note_id)


CALLS: list[tuple[str, Callable[[Engine], Awaitable[Any]]]] = [
    ("user_id", lambda m: m.add_turn(BAD, "s", "user", "hi")),
    ("session_id", lambda m: m.add_turn("ana", BAD, "user", "hi")),
    ("text", lambda m: m.add_turn("ana", "s", "user", BAD)),
    ("meta", lambda m: m.add_turn("ana", "s", "user", "hi", meta={BAD: 1})),
    ("meta['k']", lambda m: m.add_turn("ana", "s", "user", "hi", meta={"k": BAD})),
    ("meta['tags'][1]", lambda m: m.add_turn("ana", "s", "user", "hi",
                                             meta={"tags": ["ok", BAD]})),
    ("items[1].text", lambda m: m.add_turns([TURN, {**TURN, "text": BAD}])),
    ("query", lambda m: m.recall("ana", BAD)),
    ("tags[0]", lambda m: m.recall("ana", "hello", tags=[BAD])),
    ("session_id", lambda m: m.recall("ana", "hello", session_id=BAD)),
    ("query", lambda m: m.retrieve_memory("ana", BAD)),
    ("conversation_id", lambda m: m.retrieve_memory("ana", "hi", conversation_id=BAD)),
    ("category", lambda m: m.retrieve_memory_raw("ana", "hi", category=BAD)),
    ("query", lambda m: m.context_pre_retrieve("ana", BAD)),
    ("text", lambda m: m.store_note("ana", BAD)),
    ("tags[1]", lambda m: m.store_note("ana", "a note", tags=["fine", BAD])),
    ("note_id", lambda m: m.store_note("ana", "a note", note_id=BAD)),
    ("tags[0]", lambda m: _with_note(m, lambda m, n: m.update_note("ana", n, "x", tags=[BAD]))),
    ("category", lambda m: m.remember_fact("ana", BAD, "k", "v")),
    ("key", lambda m: m.remember_fact("ana", "c", BAD, "v")),
    ("value", lambda m: m.remember_fact("ana", "c", "k", BAD)),
    ("text", lambda m: m.remember_fact("ana", "c", "k", "v", text=BAD)),
    ("keywords[0]", lambda m: m.remember_fact("ana", "c", "k", "v", keywords=[BAD])),
    ("keywords[0]", lambda m: m.correct_fact("ana", "c", "k", "v", keywords=[BAD])),
    ("key", lambda m: m.confirm_fact("ana", "c", BAD)),
    ("category", lambda m: m.profile("ana", category=BAD)),
    ("type", lambda m: _with_note(m, lambda m, n: m.link("ana", n, n, type=BAD))),
    ("from_id", lambda m: m.link("ana", BAD, "b")),
    ("memory_id", lambda m: m.links("ana", BAD)),
    ("name", lambda m: m.entity_info("ana", BAD)),
    ("memory_id", lambda m: m.review("ana", BAD, "good")),
    ("summary", lambda m: m.write_session_summary("ana", "s", BAD, 0, 0)),
    ("session_id", lambda m: m.forget_session("ana", BAD)),
    ("user_id", lambda m: m.forget_user(BAD)),
    ("turn_id", lambda m: m.get_turn("ana", BAD)),
]


@pytest.mark.parametrize(("field", "call"), CALLS, ids=[f"{i}-{c[0]}" for i, c in enumerate(CALLS)])
async def test_a_lone_surrogate_is_refused_and_the_engine_goes_on(
        store_path: Path, field: str, call: Any) -> None:
    """InvalidInput naming the field, nothing else raised; the engine serves and reopens."""
    async with open_engine(store_path) as mem:
        await mem.add_turn("ana", "s", "user", "hello there")
        with pytest.raises(InvalidInput, match="UTF-8") as info:
            await call(mem)
        assert info.value.field == field
        await mem.store_note("ana", "still fine", tags=["ok"])
        await mem.flush()
    async with open_engine(store_path) as mem:
        assert [t.text for t in await mem.session_history("ana", "s")][0] == "hello there"
        assert await mem.recall("ana", "still fine", tags=["ok"])
