"""Ingest under hostile input: what a bot passes that the checks let through or trip over is
refused with InvalidInput naming the field, before anything is written."""

from __future__ import annotations

import enum
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest

from .conftest import T0, open_engine
from engine import Engine, InvalidInput, NewTurn

OK = {"user_id": "ana", "session_id": "s1", "role": "user", "text": "hello"}


class LibDateTime(datetime):
    """A datetime of a subclass, as pendulum and arrow hand them out."""


class Label(str):
    """A str of a subclass (not an enum), as some bot frameworks tag messages."""


class Colour(str, enum.Enum):
    RED = "red"


async def test_a_datetime_subclass_is_taken_as_the_datetime_it_is(mem: Engine) -> None:
    """A timezone-aware datetime of a subclass is stored as a plain datetime at the same
    instant, one or in bulk."""
    at = LibDateTime(2026, 1, 1, 12, tzinfo=timezone(timedelta(hours=2)))
    summer = LibDateTime(2026, 7, 1, 12, tzinfo=ZoneInfo("Europe/Lisbon"))
    await mem.add_turn(**OK, at=at)
    await mem.add_turns([{**OK, "at": at}, NewTurn(**OK, at=at), NewTurn(**OK, at=summer)])
    history = await mem.session_history("ana", "s1")
    assert [turn.at for turn in history] == [datetime(2026, 1, 1, 10, tzinfo=timezone.utc)] * 3 + [
        datetime(2026, 7, 1, 11, tzinfo=timezone.utc)]
    assert {type(turn.at) for turn in history} == {datetime}


async def test_a_str_subclass_in_meta_is_invalid_input_and_nothing_is_written(mem: Engine) -> None:
    """A meta value the encoder refuses raises InvalidInput naming meta (its index in a batch),
    not a TypeError, and no turn of the batch is written."""
    meta = {"source": Label("web")}
    with pytest.raises(InvalidInput, match=r"meta: expected a dict of plain JSON values .* "
                                           r"found Encoding objects of type Label is unsupported"):
        await mem.add_turn(**OK, meta=meta)
    with pytest.raises(InvalidInput) as info:
        await mem.add_turns([{**OK, "meta": {"n": 1}}] * 300 + [{**OK, "meta": meta}])
    assert info.value.field == "items[300].meta"
    with pytest.raises(InvalidInput) as info:
        mem.add_turn_nowait(**OK, meta=meta)
    assert info.value.field == "meta"
    await mem.flush()
    assert (await mem.stats()).turns == 0
    await mem.add_turn(**OK, meta={"source": Colour.RED})
    assert (await mem.session_history("ana", "s1"))[0].meta == {"source": "red"}


@pytest.mark.parametrize("items", [None, 42, "hello", b"x", {"user_id": "ana"}],
                         ids=["None", "int", "str", "bytes", "dict"])
async def test_add_turns_of_something_not_a_list_is_invalid_input(mem: Engine, items) -> None:
    """``items`` that is not a list of turns (nothing, one turn's mapping, a string) is refused
    naming ``items``, not iterated into odd errors."""
    expected = (r"items: expected a list \(or an iterable\) of NewTurn values or mappings, "
                rf"found {type(items).__name__}; wrap one turn in a list")
    with pytest.raises(InvalidInput, match=expected):
        await mem.add_turns(items)
    assert (await mem.stats()).turns == 0


async def test_add_turns_from_a_generator_writes_every_turn_in_order(mem: Engine) -> None:
    """A generator is taken like a list: every item, in order, seqs without gaps."""
    receipts = await mem.add_turns(
        ({**OK, "text": f"t{i}", "at": T0 + timedelta(seconds=i)} for i in range(600)))
    assert [r.seq for r in receipts] == list(range(600))
    history = await mem.session_history("ana", "s1", limit=1000)
    assert [t.text for t in history] == [f"t{i}" for i in range(600)]


async def test_a_meta_dict_reused_across_turns_does_not_rewrite_the_earlier_ones(
        store_path, clock) -> None:
    """A bot that updates one meta dict between turns gets each turn's meta as it was said,
    from the RAM window as from the disk after a restart."""
    async with open_engine(store_path, clock=clock) as mem:
        meta = {"step": 0, "tags": ["a"], "pair": (1, 2)}
        for step in range(3):
            meta["step"] = step
            await mem.add_turn(**OK, meta=meta)
        await mem.add_turns([{**OK, "meta": meta}])
        meta["tags"].append({"not": "said"})
        said = [{"step": step, "tags": ["a"], "pair": [1, 2]} for step in (0, 1, 2, 2)]
        assert [t.meta for t in await mem.session_history("ana", "s1")] == said
    async with open_engine(store_path, clock=clock) as mem:
        assert [t.meta for t in await mem.session_history("ana", "s1")] == said


@pytest.mark.parametrize("role", [["user"], {"role": "user"}], ids=["list", "dict"])
async def test_an_unhashable_role_is_invalid_input(mem: Engine, role) -> None:
    """A role of an unhashable type is refused naming ``role`` (and the item), not a TypeError."""
    expected = (r"expected one of 'user', 'assistant', 'system', 'tool', found "
                rf"{type(role).__name__} ")
    with pytest.raises(InvalidInput, match=rf"role: {expected}") as info:
        await mem.add_turn(**{**OK, "role": role})
    assert info.value.field == "role"
    for items in ([OK, {**OK, "role": role}], [NewTurn(**OK), NewTurn(**{**OK, "role": role})]):
        with pytest.raises(InvalidInput, match=expected) as info:
            await mem.add_turns(items)
        assert info.value.field == "items[1].role"
    assert (await mem.stats()).turns == 0
