"""The messages actors exchange: frozen, tagged Structs, one union per actor.

Persisted records live in ``engine._records``; nothing here is ever written to disk as is.
"""

from __future__ import annotations

from datetime import datetime

import msgspec

from engine._records import Turn

__all__ = ["AppendTurn", "Forget", "StoreOp"]


class AppendTurn(msgspec.Struct, frozen=True, tag=True):
    """Write one turn. ``key`` and ``value`` are encoded on the trio thread at ingest, so the
    writer thread holds the GIL only for LMDB's own C loop.

    Attributes:
        turn: the record (its ``lsn`` orders the log).
        key: the turn's key in the ``turns`` database.
        value: the turn encoded as msgpack.
        started_at: the session's first turn time, for its SessionInfo.
        id_key: the turn's key in the ``ids`` database.
    """

    turn: Turn
    key: bytes
    value: bytes
    started_at: datetime
    id_key: bytes

    @property
    def lsn(self) -> int:
        return self.turn.lsn


class Forget(msgspec.Struct, frozen=True, tag=True):
    """Delete a whole session (``session_id`` set) or a whole user (``session_id`` None), and log
    a tombstone at ``lsn`` that lists the deleted log sequence numbers and nothing of the user."""

    lsn: int
    user_id: str
    session_id: str | None


StoreOp = AppendTurn | Forget
