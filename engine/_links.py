"""Typed links between two memories of one user, which recall follows in both directions
(``Retriever._expand``). A link is written through the store's group commit, unlogged (it
carries no text to embed or index), and only if the write transaction finds both its ends.
"""

from __future__ import annotations

from datetime import timezone
from typing import Any

import trio

from actors.base import validate as v
from actors.base.errors import InvalidInput, NotFound
from actors.base.messages import PutLink
from actors.base.records import Link
from actors.store import read_links, read_memories_by_id

from ._parts import Parts

__all__ = ["Links"]


class Links:
    """The facade's ``link`` and ``links``."""

    def __init__(self, parts: Parts) -> None:
        self._parts = parts

    async def link(self, user_id: Any, from_id: Any, to_id: Any, type: Any, at: Any) -> Link:
        parts = self._parts
        parts.check_open()
        parts.check_ids(user_id)
        for field, memory_id in (("from_id", from_id), ("to_id", to_id)):
            parts.check_id(field, memory_id)
        parts.check_id("type", type)
        if from_id == to_id:
            raise InvalidInput("to_id", f"expected another memory than from_id, found {to_id!r}")
        at = parts.now() if at is None else v.check_at(at)
        # Both memories must be on disk to be found; indexes and vectors are not needed.
        await parts.committed()
        found = await parts.store.read(read_memories_by_id, user_id, [from_id, to_id])
        for field, memory_id in (("from_id", from_id), ("to_id", to_id)):
            if memory_id not in found:
                raise NotFound(field, f"expected the id of a memory of user {user_id!r}, "
                                      f"found none with id {memory_id!r}")
        link = Link(from_id, to_id, type, at.astimezone(timezone.utc))
        # An end forgotten between the read above and the write is found by the write itself,
        # in its transaction: no link to a memory that is gone is ever stored, even for a
        # moment a crash could keep (forgetting means gone).
        written: list[tuple[str, ...] | Link] = []
        await parts.store.write_unlogged(PutLink(user_id, link, trio.Event(), written.append))
        if isinstance(held := written[0], Link):
            raise InvalidInput("to_id", f"expected memories not linked by a {type!r} link the "
                                        f"other way (a pair holds one link of each type), found "
                                        f"one from {to_id!r} to {from_id!r}, made "
                                        f"{held.at.isoformat()}")
        for field, memory_id in (("from_id", from_id), ("to_id", to_id)):
            if memory_id in held:
                raise NotFound(field, f"expected the id of a memory of user {user_id!r}, found "
                                      f"none with id {memory_id!r} (forgotten meanwhile)")
        return link

    async def links(self, user_id: Any, memory_id: Any) -> list[Link]:
        parts = self._parts
        parts.check_open()
        parts.check_lookup_ids(user_id)
        parts.check_lookup_id("memory_id", memory_id)
        return (await parts.store.read(read_links, user_id, [memory_id]))[memory_id]
