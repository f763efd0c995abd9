"""The store's link op: a link is written only if both its ends exist, checked in the write
transaction that writes it, so no crash can leave a link to a forgotten memory."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
import trio

import actors.store as store_mod
from actors.base.messages import PutLink
from actors.base.records import Link
from engine import NotFound

from ..conftest import open_engine, raw_databases
from .test_store import Ingest, running_store

AT = datetime(2026, 3, 1, tzinfo=timezone.utc)


async def test_a_link_whose_end_was_forgotten_is_refused_in_its_write(store_path) -> None:
    """An end read before its session was forgotten, linked after: the write itself refuses
    the link and names the missing end, and nothing is stored."""
    async with running_store(store_path) as store:
        ingest = Ingest(store)
        await ingest.add_turn("s1", "stays", durable=True)
        await ingest.add_turn("s2", "goes", durable=True)
        kept, gone = "t1", "t2"
        found = await store.read(store_mod.read_memories_by_id, "ana", [kept, gone])
        assert set(found) == {kept, gone}  # what link() checks before its write
        await store.forget("ana", "s2")
        missing: list[tuple[str, ...]] = []
        await store.write_unlogged(PutLink("ana", Link(kept, gone, "relates_to", AT),
                                           trio.Event(), missing.append))
        assert await store.read(store_mod.read_links, "ana", [kept]) == {kept: []}
        assert missing == [(gone,)]
    assert raw_databases(store_path).get("links", []) == []


async def test_a_crash_after_links_write_leaves_no_link_to_a_forgotten_memory(
        store_path) -> None:
    """link() whose end is forgotten between its check and its write, the process dying
    right after the write (here: the next store read raises): no link is left on disk."""

    class Crash(Exception):
        """Stands for the process dying at this point."""

    async with open_engine(store_path) as mem:
        keep = await mem.add_turn("ana", "keep", "user", "kept turn", durable=True)
        doomed = await mem.add_turn("ana", "doomed", "user", "doomed turn", durable=True)
        store = mem._parts.store
        read = store.read
        reads = 0

        async def forget_after_the_check_then_crash(fn, *args):
            nonlocal reads
            if fn is store_mod.read_memories_by_id:
                reads += 1
                if reads == 2:
                    raise Crash
            result = await read(fn, *args)
            if fn is store_mod.read_memories_by_id and reads == 1:
                await mem.forget_session("ana", "doomed")
            return result

        store.read = forget_after_the_check_then_crash
        with pytest.raises((NotFound, Crash)) as raised:
            await mem.link("ana", keep.turn_id, doomed.turn_id, "relates_to")
        store.read = read
        assert await mem.links("ana", keep.turn_id) == []
        assert raised.type is NotFound and "forgotten meanwhile" in str(raised.value)
    assert raw_databases(store_path).get("links", []) == []
