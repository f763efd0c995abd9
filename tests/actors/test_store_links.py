"""The store's link op: a link is written only if both its ends exist, checked in the write
transaction that writes it, so no crash can leave a link to a forgotten memory (link()
through the engine, a crash right after its write: tests/test_links_reviews_hostile.py)."""

from __future__ import annotations

from datetime import datetime, timezone

import trio

import actors.store as store_mod
from actors.base.messages import PutLink
from actors.base.records import Link

from ..conftest import raw_databases
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
