"""Bad input is refused with a message that says what was expected and found; nothing is written."""

from __future__ import annotations

import os
from datetime import datetime, timezone

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import open_engine
from engine import Config, Engine, InvalidInput, NewTurn

OK = {"user_id": "ana", "session_id": "s1", "role": "user", "text": "hello"}

BAD = [
    ({"text": ""}, "text", r"expected a non-empty string, found ''"),
    ({"text": "  \n\t"}, "text", r"expected a non-empty string, found '  \\n\\t'"),
    ({"text": None}, "text", r"expected a non-empty string, found NoneType None"),
    ({"text": "x" * 40}, "text", r"expected at most 32 characters, found 40; split it"),
    ({"text": "bad \ud800 surrogate"}, "text", r"expected text encodable as UTF-8"),
    ({"user_id": ""}, "user_id", r"expected a non-empty string, found ''"),
    ({"user_id": 42}, "user_id", r"expected a non-empty string, found int 42"),
    ({"session_id": None}, "session_id", r"found NoneType None"),
    ({"session_id": "a\x00b"}, "session_id", r"expected no NUL character"),
    ({"user_id": "u" * 300}, "user_id", r"expected at most 256 characters, found 300"),
    ({"role": "bot"}, "role", r"expected one of 'user', 'assistant', 'system', 'tool', found str 'bot'"),
    ({"at": datetime(2026, 1, 1)}, "at", r"expected a timezone-aware datetime, found a naive datetime 2026-01-01T00:00:00; pass tzinfo"),
    ({"at": "2026-01-01"}, "at", r"expected a timezone-aware datetime, found str"),
    ({"meta": {"tags": {1, 2}}}, "meta['tags']", r"expected a JSON-serialisable value, found set"),
    ({"meta": {1: "x"}}, "meta", r"expected string keys, found key int 1"),
    ({"meta": {"x": float("nan")}}, "meta['x']", r"found nan \(not valid JSON\)"),
    ({"meta": ["a"]}, "meta", r"expected a JSON-serialisable dict, found list"),
    ({"meta": {"blob": "y" * 200}}, "meta", r"expected at most 128 bytes as JSON, found 211"),
]

SMALL = {"max_text_chars": 32, "max_meta_bytes": 128}


@pytest.mark.parametrize(("change", "field", "message"), BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
async def test_bad_turn_is_refused_and_nothing_is_written(store_path, change, field, message) -> None:
    """Each bad argument raises InvalidInput naming the field, and the store stays empty."""
    async with open_engine(store_path, config=SMALL) as mem:
        with pytest.raises(InvalidInput, match=message) as info:
            await mem.add_turn(**{**OK, **change})
        assert info.value.field == field
        with pytest.raises(InvalidInput, match=message) as info:
            await mem.add_turns([{**OK, "text": "fine"}, {**OK, **change}])
        assert info.value.field == f"items[1].{field}"
        await mem.flush()
        stats = await mem.stats()
        assert (stats.turns, stats.last_lsn) == (0, 0)


async def test_add_turns_rejects_items_of_the_wrong_shape(mem: Engine) -> None:
    """An item that is neither a NewTurn nor a mapping with its keys is named by index."""
    with pytest.raises(InvalidInput, match=r"items\[0\]: expected a NewTurn or a mapping, found str"):
        await mem.add_turns(["hello"])
    with pytest.raises(InvalidInput, match=r"items\[0\]: expected the fields of a NewTurn, found Missing required argument 'text'"):
        await mem.add_turns([{"user_id": "a", "session_id": "b", "role": "user"}])


async def test_bad_limit_and_config_are_refused(store_path, mem: Engine) -> None:
    """limit must be a positive int; config fields are checked when the engine opens."""
    with pytest.raises(InvalidInput, match=r"limit: expected an integer from 1 to 1000000, found 0"):
        await mem.session_history("ana", "s1", limit=0)
    with pytest.raises(InvalidInput, match=r"config: .*window_turns"):
        async with open_engine(store_path / "other", config={"window_turns": 0}):
            pass
    with pytest.raises(InvalidInput, match=r"config: Object contains unknown field `windw`"):
        async with open_engine(store_path / "other", config={"windw": 3}):
            pass
    assert Config.checked(Config(window_turns=3)).window_turns == 3


@pytest.mark.parametrize("field, value, message", [
    ("window_turns", 2 ** 64, "window_turns"),
    ("query_cache", 10 ** 30, "query_cache"),
    ("initial_map_bytes", 2 ** 64, "initial_map_bytes"),
    ("initial_map_bytes", 2 ** 47, "initial_map_bytes"),
    ("integrity_key", "\ud800" * 16, "integrity_key: expected text encodable as UTF-8"),
    ("notes_markdown_dir", "/tmp/x\x00y", "notes_markdown_dir: expected a path with no NUL"),
    ("notes_markdown_dir", "/tmp/" + "a" * 300, "notes_markdown_dir: expected a path whose "
                                                 "names are at most 255 bytes"),
    ("model_dir", "\x00", "model_dir: expected a path with no NUL"),
    ("model_dir", os.fsdecode(b"/tmp/mod\xe9le"), "model_dir: expected a path in UTF-8"),
    ("notes_markdown_dir", "/tmp/" + "f/" * 1_500, "notes_markdown_dir: expected a path at "
                                                   "most 256 folders deep"),
    # Taken, then every maintenance pass failed with OverflowError: idle since before year 1.
    ("session_idle_seconds", float("inf"), "session_idle_seconds"),
    ("session_idle_seconds", 1e11, "session_idle_seconds"),
])
async def test_a_config_value_the_engine_cannot_use_is_refused_before_any_file(
        tmp_path, field: str, value: object, message: str) -> None:
    """Values that passed the config's checks and failed later, after the store's files were
    made: an OverflowError from the window's deque, a map LMDB cannot reserve (reported as an
    incompatible store), a key UTF-8 cannot encode, a mirror directory no file system takes."""
    store = tmp_path / "store"
    with pytest.raises(InvalidInput, match=message):
        async with open_engine(store, config={field: value}):
            pass
    assert not store.exists() or not any(store.iterdir())


async def test_a_mirror_path_of_bytes_that_are_not_utf8_is_taken_as_linux_holds_it(
        tmp_path) -> None:
    """A directory named in Latin-1 ('caf\xe9'), as Python hands it over (os.fsdecode): the
    path checks take it, and the notes are mirrored there."""
    root = os.fsdecode(os.fsencode(str(tmp_path)) + b"/caf\xe9")
    async with open_engine(tmp_path / "store", config={"notes_markdown_dir": root}) as mem:
        note = await mem.store_note("ana", "a note")
    assert (os.fsencode(root) + f"/ana/{note.note_id}.md".encode()) in {
        os.fsencode(os.path.join(d, f)) for d, _, files in os.walk(os.fsencode(root))
        for f in files}


async def test_a_clock_without_a_timezone_is_refused_at_open(tmp_path) -> None:
    """The engine's clock stamps turns and bounds focus windows against aware times; a naive
    one (``datetime.now``) opened fine, and recall(focus=...) and retrieve_memory then failed
    with TypeError. It is refused when the engine opens, and nothing is created."""
    path = tmp_path / "store"
    with pytest.raises(InvalidInput, match=r"clock: expected a callable returning a timezone-"
                                           r"aware datetime, found datetime .*no timezone"):
        async with Engine.open(path, clock=datetime.now):
            pass
    with pytest.raises(InvalidInput, match=r"clock: expected a callable .* found str"):
        async with Engine.open(path, clock=lambda: "noon"):
            pass
    with pytest.raises(InvalidInput, match=r"clock: expected a callable .* found datetime"):
        async with Engine.open(path, clock=datetime.now(timezone.utc)):
            pass

    class Stamp(datetime):  # what pendulum.now and pandas' Timestamp.now return
        pass

    with pytest.raises(InvalidInput, match=r"clock: expected .*datetime itself, found Stamp"):
        async with Engine.open(path, clock=lambda: Stamp.now(timezone.utc)):
            pass
    # A time the text index cannot hold: remember_fact stamped a fact with it, which the index
    # then refused (a failure kept for good) and recall(focus=) broke on.
    for year in (1, 9999):
        with pytest.raises(InvalidInput, match=r"clock: expected a date from 1700-01-01"):
            async with Engine.open(path, clock=lambda: datetime(year, 6, 1,
                                                                tzinfo=timezone.utc)):
                pass
    assert not path.exists()


async def test_a_file_where_the_store_should_be_is_refused(tmp_path) -> None:
    """Opening a path that is a file says so instead of failing inside LMDB."""
    path = tmp_path / "file"
    path.write_text("not a store")
    with pytest.raises(InvalidInput, match=r"path: expected a store directory, found a file"):
        async with open_engine(path):
            pass


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=40), user=st.text(max_size=8))
async def test_any_text_is_stored_exactly_or_refused(tmp_path_factory, text: str, user: str) -> None:
    """Arbitrary unicode either round-trips exactly or raises InvalidInput; nothing else."""
    async with open_engine(tmp_path_factory.mktemp("s"), config=SMALL) as mem:
        try:
            r = await mem.add_turn(user, "s", "user", text)
        except InvalidInput:
            assert (await mem.stats()).turns == 0
            return
        stored = await mem.get_turn(user, r.turn_id)
        assert (stored.text, stored.user_id) == (text, user)
        assert await mem.add_turns([NewTurn(user_id=user, session_id="s", role="user", text=text)])


@pytest.mark.parametrize("durable", ["no", "false", 0, 1, None, [False]], ids=repr)
async def test_durable_is_true_or_false_and_anything_else_writes_nothing(mem: Engine,
                                                                         durable) -> None:
    """durable="no" was truthy: the turn was written and waited for as if durable=True; any
    value but True or False is refused naming durable, before a turn is written."""
    message = r"durable: expected True or False, found "
    with pytest.raises(InvalidInput, match=message) as info:
        await mem.add_turn(**OK, durable=durable)
    assert info.value.field == "durable"
    with pytest.raises(InvalidInput, match=message) as info:
        await mem.add_turns([OK, {**OK, "text": "again"}], durable=durable)
    assert info.value.field == "durable"
    await mem.flush()
    stats = await mem.stats()
    assert (stats.turns, stats.last_lsn) == (0, 0)
    await mem.add_turn(**OK, durable=False)
    await mem.add_turns([OK], durable=True)
    assert [t.text for t in await mem.session_history("ana", "s1")] == ["hello", "hello"]


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("field", ["user_id", "session_id", "role", "text"])
async def test_a_value_nested_thousands_deep_is_refused_not_a_recursion_error(
        mem: Engine, field: str) -> None:
    """The error message showed the whole repr of what was found: a list nested 50,000 deep
    raised RecursionError (and a million-item list built a megabyte's repr to cut it)."""
    for bad in (_nested(50_000), list(range(1_000_000))):
        with pytest.raises(InvalidInput) as info:
            await mem.add_turn(**{**OK, field: bad})
        assert info.value.field == field and len(str(info.value)) < 300
    assert (await mem.stats()).turns == 0


async def test_a_dict_for_a_notes_tags_is_refused_not_read_as_its_keys(mem: Engine) -> None:
    """store_note(tags={"topic": "food"}) stored the tag "topic" (a dict iterates its keys):
    a caller who meant key/value tags silently got others."""
    with pytest.raises(InvalidInput, match="tags: expected a list of strings, found dict"):
        await mem.store_note("ana", "I like rice", tags={"topic": "food"})
    assert await mem.list_notes("ana") == []


async def test_a_path_thousands_of_folders_deep_is_refused_by_name(tmp_path, mem) -> None:
    """pathlib makes a path's missing folders one recursion a level: a store or a snapshot
    2,000 folders deep raised RecursionError (a 500 over HTTP, a traceback on the command
    line). It is InvalidInput naming the path, and nothing is made."""
    deep = tmp_path / ("f/" * 2_000)
    with pytest.raises(InvalidInput, match="path: expected a path at most 256 folders deep"):
        async with open_engine(deep):
            pass
    with pytest.raises(InvalidInput, match="dest: expected a path at most 256 folders deep"):
        await mem.snapshot(deep)
    # A short name that leads there through a link.
    (tmp_path / "link").symlink_to(deep)
    with pytest.raises(InvalidInput, match="dest: expected a path at most 256 folders deep"):
        await mem.snapshot(tmp_path / "link")
    assert not (tmp_path / "f").exists()
