"""Ids are limited in UTF-8 bytes, not characters (case 3 of issue 11): an id that would make an
LMDB key too long is refused at the call, so it can never fail a group commit and take other
callers' acknowledged turns with it. Values that may be long and become part of a key (fact
category and key, link ends) are stored under a bounded key with the full value in the record."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from engine import Engine, InvalidInput

from ..conftest import open_engine

LONG = "€" * 200  # 200 characters, 600 bytes in UTF-8
LIMIT = r"expected at most 250 bytes in UTF-8, found 600"


async def _note_then(mem: Engine, call: Callable[[Engine, str], Awaitable[Any]]) -> Any:
    return await call(mem, (await mem.store_note("ana", "a note")).note_id)


CALLS: list[tuple[str, str, Callable[[Engine], Awaitable[Any]]]] = [
    ("user_id", "add_turn", lambda m: m.add_turn(LONG, "s", "user", "hi")),
    ("session_id", "add_turn", lambda m: m.add_turn("ana", LONG, "user", "hi")),
    ("items[0].user_id", "add_turns", lambda m: m.add_turns(
        [{"user_id": LONG, "session_id": "s", "role": "user", "text": "hi"}])),
    ("note_id", "store_note", lambda m: m.store_note("ana", "text", note_id=LONG)),
    ("category", "remember_fact", lambda m: m.remember_fact("ana", LONG, "k", "v")),
    ("key", "remember_fact", lambda m: m.remember_fact("ana", "identity", LONG, "v")),
    ("conversation_id", "retrieve_memory",
     lambda m: m.retrieve_memory("ana", "hello", conversation_id=LONG)),
    ("turn_id", "get_turn", lambda m: m.get_turn("ana", LONG)),
    ("memory_id", "review", lambda m: m.review("ana", LONG, "good")),
    ("type", "link", lambda m: _note_then(m, lambda m, n: m.link("ana", n, n + "x", type=LONG))),
    ("session_id", "forget_session", lambda m: m.forget_session("ana", LONG)),
]


@pytest.mark.parametrize(("field", "method", "call"), CALLS,
                         ids=[f"{c[1]}-{c[0]}" for c in CALLS])
async def test_an_id_over_the_byte_limit_is_refused_and_bystanders_keep_their_turns(
        store_path: Path, field: str, method: str, call: Any) -> None:
    """InvalidInput names the field; 24 other users' turns queued just before all land."""
    async with open_engine(store_path) as mem:
        receipts = [await mem.add_turn(f"user{i}", "s", "user", f"turn {i}") for i in range(24)]
        with pytest.raises(InvalidInput, match=LIMIT) as info:
            await call(mem)
        assert info.value.field == field
        for receipt in receipts:
            await receipt.durable()
        await mem.flush()
        await mem.add_turn("ana", "s", "user", "still serving", durable=True)
    async with open_engine(store_path) as mem:
        for i in range(24):
            assert [t.text for t in await mem.session_history(f"user{i}", "s")] == [f"turn {i}"]


async def test_ids_at_the_byte_limit_work_everywhere(store_path: Path) -> None:
    """250-byte user, session, note ids, fact category and key: stored, linked, found, reopened."""
    user, session = "u" * 250, "é" * 125
    note_a, note_b = "n" * 247 + "€", "ñ" * 125
    category, key = "ç" * 125, "k" * 250
    async with open_engine(store_path) as mem:
        turn = await mem.add_turn(user, session, "user", "I moved to Lisbon", durable=True)
        await mem.store_note(user, "likes green tea", note_id=note_a)
        await mem.store_note(user, "drinks coffee", note_id=note_b)
        link = await mem.link(user, note_a, note_b, type="t" * 250)
        await mem.link(user, note_a, turn.turn_id)
        fact = await mem.remember_fact(user, category, key, "v" * 300)
        await mem.retrieve_memory(user, "green tea", conversation_id=session)
        await mem.add_turn(user, session, "assistant", "green tea it is")
        await mem.flush()
    async with open_engine(store_path) as mem:
        assert [t.text for t in await mem.session_history(user, session)] == [
            "I moved to Lisbon", "green tea it is"]
        assert link in await mem.links(user, note_b)
        assert len(await mem.links(user, note_a)) == 2
        assert [f.value for f in await mem.fact_history(user, category, key)] == [fact.value]
        assert [f.key for f in await mem.profile(user, category=category)] == [key]
        assert (await mem.get_note(user, note_a)).text == "likes green tea"
        await mem.forget_user(user)
        assert await mem.links(user, note_b) == []
        assert await mem.fact_history(user, category, key) == []
