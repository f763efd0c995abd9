"""Ids of derived memories: what the long-term followers derive (an episode, an extracted
fact) takes its id from what it stands for, so every node of a cluster that applies the same
log makes it under the same id, and a logged call naming it (a review) finds it everywhere
(``actors.store.read_derived_id`` picks the first such id no memory of the user holds)."""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

__all__ = ["derived_id"]

_encode_parts = msgspec.msgpack.Encoder().encode


def derived_id(what: Any, salt: int = 0) -> str:
    """20 hex digits (as random and pinned ids have) hashed from ``what`` (msgpack-encodable:
    nested tuples keep their parts apart) and ``salt``: the same on every node."""
    data = _encode_parts((what, salt) if salt else what)
    return hashlib.blake2b(data, digest_size=10).hexdigest()
