"""Every failure a caller causes is InvalidInput naming the right field, and a refused batch
writes nothing (case 9 of issue 11)."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import trio

from engine import Engine, EngineClosed, InvalidInput, StoreInUse

from ..conftest import open_engine

TURN = {"user_id": "ana", "session_id": "s", "role": "user", "text": "hello"}


@pytest.mark.parametrize("n", [2**70, -(2**70), 2**63, -(2**63) - 1,
                               pytest.param(10**5000, id="10**5000")])
async def test_an_integer_msgpack_cannot_hold_is_refused(mem: Engine, n: int) -> None:
    """meta={"n": 2**70} is InvalidInput naming meta['n'], not an OverflowError (nor, for an int
    too long to print, a ValueError)."""
    with pytest.raises(InvalidInput, match=r"expected an integer from -2\*\*63 to 2\*\*63-1") as info:
        await mem.add_turn("ana", "s", "user", "hi", meta={"n": n})
    assert info.value.field == "meta['n']"
    receipt = await mem.add_turn("ana", "s", "user", "hi", meta={"n": 2**63 - 1}, durable=True)
    assert (await mem.get_turn("ana", receipt.turn_id)).meta == {"n": 2**63 - 1}


async def test_add_turns_writes_nothing_when_one_item_is_bad(store_path: Path) -> None:
    """All or nothing, as its docstring promises: the items before the bad one are not written."""
    async with open_engine(store_path) as mem:
        with pytest.raises(InvalidInput) as info:
            await mem.add_turns([TURN, TURN, {**TURN, "meta": {"deep": [[{"n": 2**70}]]}}])
        assert info.value.field == "items[2].meta['deep'][0][0]['n']"
        assert await mem.session_history("ana", "s") == []
        await mem.flush()
        assert (await mem.stats()).last_lsn == 0
    async with open_engine(store_path) as mem:
        assert (await mem.stats()).turns == 0


async def test_meta_too_deep_or_too_large_is_refused(mem: Engine) -> None:
    """Depth and size are checked before encoding."""
    deep: dict = {}
    node = deep
    for _ in range(40):
        node["d"] = {}
        node = node["d"]
    with pytest.raises(InvalidInput, match="nested at most 32 levels"):
        await mem.add_turn("ana", "s", "user", "hi", meta=deep)
    with pytest.raises(InvalidInput, match="expected at most 65536 bytes as JSON"):
        await mem.add_turn("ana", "s", "user", "hi", meta={"x": "y" * 70_000})


async def test_too_many_or_too_long_tags_are_refused(mem: Engine) -> None:
    """Tags and keywords are bounded in count and bytes."""
    with pytest.raises(InvalidInput, match="expected at most 64 tags") as info:
        await mem.store_note("ana", "a note", tags=[f"t{i}" for i in range(65)])
    assert info.value.field == "tags"
    with pytest.raises(InvalidInput, match="expected at most 250 bytes in UTF-8") as info:
        await mem.remember_fact("ana", "c", "k", "v", keywords=["w" * 251])
    assert info.value.field == "keywords[0]"


async def test_compact_of_a_served_store_says_it_is_in_use(store_path: Path) -> None:
    """compact refuses a store an engine serves with a message that says so, not EngineClosed."""
    async with open_engine(store_path) as mem:
        await mem.add_turn("ana", "s", "user", "hello", durable=True)
        with pytest.raises(StoreInUse, match=f"in use by process {os.getpid()}") as info:
            await Engine.compact(store_path)
        assert not isinstance(info.value, EngineClosed)
        await mem.add_turn("ana", "s", "user", "still serving", durable=True)


async def test_no_exception_group_escapes_a_search(mem: Engine) -> None:
    """Errors raised inside recall's parallel legs come out as engine errors, never as groups."""
    await mem.add_turn("ana", "s", "user", "hello there", durable=True)
    for kwargs in ({"tags": ["\ud800"]}, {"since": "yesterday"}, {"roles": ["bot"]},
                   {"kinds": [["x"]]}, {"limit": 10**9}, {"tags": [1]}):
        with pytest.raises(InvalidInput):
            await mem.recall("ana", "hello", **kwargs)
    await trio.lowlevel.checkpoint()


async def test_a_store_commands_paths_and_key_of_the_wrong_type_are_invalid_input(
        tmp_path: Path) -> None:
    """restore, verify and compact took any value: a number as a path was a TypeError out of
    os.fspath, a number or bytes as the key an AttributeError out of its encoding."""
    async with open_engine(tmp_path / "live") as mem:
        await mem.add_turn("ana", "s", "user", "hello")
        await mem.snapshot(tmp_path / "snap")
    snap, live = tmp_path / "snap", tmp_path / "live"
    calls = {
        "snapshot": lambda: Engine.restore(123, tmp_path / "r"),
        "store_path": lambda: Engine.restore(snap, None),
        "integrity_key": lambda: Engine.restore(snap, tmp_path / "r", integrity_key=5),
    }
    for field, call in calls.items():
        with pytest.raises(InvalidInput, match=rf"^{field}: expected") as info:
            await call()
        assert info.value.field == field
    for call in (lambda: Engine.verify(live, integrity_key=5),
                 lambda: Engine.verify(live, integrity_key=b"a key of sixteen bytes")):
        with pytest.raises(InvalidInput, match=r"^integrity_key: expected a string"):
            await call()
    for call in (lambda: Engine.verify(3.5), lambda: Engine.compact(["x"])):
        with pytest.raises(InvalidInput, match=r"^store_path: expected a directory path"):
            await call()
    assert not (tmp_path / "r").exists()
    assert (await Engine.verify(live))["ok"]


async def test_an_empty_path_or_an_embedder_that_is_none_is_invalid_input(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Engine.open("") opened the current folder as a store (an unset variable defaulting to
    "" put LMDB files wherever the bot ran); embedder=5 failed inside the actor with an
    AttributeError."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidInput, match=r"^path: expected a directory path, found an "
                                           r"empty one"):
        async with Engine.open(""):
            pass
    assert list(tmp_path.iterdir()) == []
    from engine import HashEmbedder
    for wrong, found in ((5, "int"), (HashEmbedder, "the class HashEmbedder"),
                         (object(), "object")):
        with pytest.raises(InvalidInput, match=rf"^embedder: expected .*, found {found}"):
            async with Engine.open(tmp_path / "s", embedder=wrong):
                pass
    assert list(tmp_path.iterdir()) == []


async def test_a_session_id_of_none_where_one_is_needed_is_invalid_input(mem: Engine) -> None:
    """None read as "no session given": forget_session and session_summary raised an
    AttributeError out of encoding it, session_history answered [] as if the session were
    empty, and the others failed later or answered for no session."""
    await mem.add_turn("ana", "s", "user", "hello", durable=True)
    calls = {
        "forget_session": lambda: mem.forget_session("ana", None),
        "session_summary": lambda: mem.session_summary("ana", None),
        "session_history": lambda: mem.session_history("ana", None),
        "context_for_prompt": lambda: mem.context_for_prompt("ana", None),
        "write_session_summary": lambda: mem.write_session_summary("ana", None, "s", 0, 0),
        "close_session": lambda: mem.close_session("ana", None),
    }
    for name, call in calls.items():
        with pytest.raises(InvalidInput, match=r"^session_id: expected") as info:
            await call()
        assert info.value.field == "session_id", name
    assert [t.text for t in await mem.session_history("ana", "s")] == ["hello"]
    assert await mem.episodes("ana", None) == []  # None there means every session


async def test_import_users_as_users_and_a_tool_name_of_the_wrong_type_are_invalid_input(
        mem: Engine) -> None:
    """as_users="xy" imported two exports under users "x" and "y" (a string is a sequence),
    as_users=0 raised TypeError; call_tool with a list or a dict as its name raised
    TypeError (unhashable) before the name was checked."""
    await mem.add_turn("ana", "s", "user", "hello", durable=True)
    await mem.add_turn("bo", "s", "user", "hi", durable=True)
    exports = []
    for user in ("ana", "bo"):
        out = io.BytesIO()
        await mem.export_user(user, out)
        exports.append(out.getvalue())
    for wrong in ("xy", 0, b"xy"):
        with pytest.raises(InvalidInput, match=r"^as_users: expected a list of user ids"):
            await mem.import_users(exports, as_users=wrong)
    for name in ([], {}, ["recall"]):
        with pytest.raises(InvalidInput, match=r"^name: expected one of"):
            await mem.call_tool(name, {})
    assert sorted(await mem.list_users()) == ["ana", "bo"]
