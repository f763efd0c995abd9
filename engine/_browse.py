"""Listing what a store holds, for the inspector and for operators: the users, and a user's
notes, entities and every version of every fact (the facade's ``list_*`` and
``fact_versions``).

Each listing waits until everything acknowledged before the call is on disk (as
``memory_stats`` does) and reads it in one read transaction, so what it lists is one
consistent state that includes the caller's own writes.
"""

from __future__ import annotations

from typing import Any

import msgspec

from actors.base.records import Entity, Fact, Note
from actors.store import read_entities, read_entity_keys, read_facts, user_prefix

from ._parts import Parts

__all__ = ["list_users", "list_notes", "list_entities", "fact_versions", "users_with",
           "read_notes"]

_decode_note = msgspec.msgpack.Decoder(Note).decode


async def list_users(parts: Parts) -> list[str]:
    """See ``Engine.list_users``: the session buffer knows every user with a session from open
    on; users with only notes or facts are read from those two tables, one seek per user."""
    parts.check_open()
    await parts.committed()
    others = await parts.store.read(users_with, (b"notes", b"facts"))
    return sorted(set(parts.buffer.users()) | others)


async def list_notes(parts: Parts, user_id: Any) -> list[Note]:
    """See ``Engine.list_notes``."""
    parts.check_open()
    parts.check_ids(user_id)
    await parts.committed()
    notes = await parts.store.read(read_notes, user_id)
    notes.sort(key=lambda n: (n.updated_at, n.lsn), reverse=True)
    return notes


async def list_entities(parts: Parts, user_id: Any) -> list[Entity]:
    """See ``Engine.list_entities``."""
    parts.check_open()
    parts.check_ids(user_id)
    await parts.committed()
    return await parts.store.read(_read_all_entities, user_id)


async def fact_versions(parts: Parts, user_id: Any) -> list[Fact]:
    """See ``Engine.fact_versions``."""
    parts.check_open()
    parts.check_ids(user_id)
    await parts.committed()
    facts = await parts.store.read(read_facts, user_id, False)
    facts.sort(key=lambda f: (f.category, f.key, f.lsn))
    return facts


def users_with(txn: Any, dbs: dict[bytes, Any], tables: tuple[bytes, ...]) -> set[str]:
    """The users holding a key in any of ``tables`` (keys start ``user NUL``): after each user
    found, the cursor jumps past all of that user's keys."""
    users: set[str] = set()
    for table in tables:
        cursor = txn.cursor(dbs[table])
        found = cursor.first()
        while found:
            user = bytes(cursor.key()).split(b"\x00", 1)[0]
            users.add(user.decode())
            found = cursor.set_range(user + b"\x01")
    return users


def read_notes(txn: Any, dbs: dict[bytes, Any], user_id: str) -> list[Note]:
    """Every note of the user, in key order (a store read: ``Store.read``)."""
    prefix = user_prefix(user_id)
    cursor = txn.cursor(dbs[b"notes"])
    out: list[Note] = []
    if cursor.set_range(prefix):
        for key, value in cursor:
            if not key.startswith(prefix):
                break
            out.append(_decode_note(value))
    return out


def _read_all_entities(txn: Any, dbs: dict[bytes, Any], user_id: str) -> list[Entity]:
    found = read_entities(txn, dbs, user_id, read_entity_keys(txn, dbs, user_id))
    entities = [e for e in found.values() if e.type != "alias"]
    entities.sort(key=lambda e: (-e.mentions, e.name.lower()))
    return entities
