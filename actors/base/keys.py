"""Byte limits of LMDB keys, and the bounded form of a key part that could be too long.

LMDB refuses a key over 511 bytes (its compiled-in ``MDB_MAXKEYSIZE``) with MDB_BAD_VALSIZE,
which inside a group commit would fail every op of the batch. So every key is built to fit:

- ids a caller chooses (user, session, note, conversation, memory ids) are refused at the call
  above ``MAX_ID_BYTES`` of UTF-8: a turn's key is two of them, two NULs and an 8-byte seq;
- parts derived from text that can be long (entity names, a fact's category and key, the ends
  of a link) go through :func:`fit`: kept as they are when they fit, else a readable head, a
  0xFF byte and a digest. A part that fits is never changed, so stores written before keep
  their keys; 0xFF never occurs in UTF-8, so a shortened part never equals a part kept whole.
  The record under the key always carries the full value.
"""

from __future__ import annotations

import hashlib

__all__ = ["MAX_KEY_BYTES", "MAX_ID_BYTES", "LEGACY_ID_BYTES", "fit", "is_fitted"]

MAX_KEY_BYTES = 511  # LMDB's MDB_MAXKEYSIZE in the lmdb wheel
MAX_ID_BYTES = (MAX_KEY_BYTES - 11) // 2  # user NUL session NUL seq(8) fits: 250
# Stores written before MAX_ID_BYTES held ids up to Config.max_id_chars's default (256 ASCII
# characters) where their keys fit: the calls that only read or forget accept them.
LEGACY_ID_BYTES = 256
_DIGEST = 16  # bytes of blake2b: collisions are out of reach (2^64 work for a birthday)
_MARK = b"\xff"  # never in UTF-8: tells a shortened part from one kept whole


def fit(part: bytes, room: int) -> bytes:
    """``part`` if it is at most ``room`` bytes; else its head (cut on a character boundary),
    0xFF and the hex digest of the whole part, ``room`` bytes at most.

    Args:
        part: UTF-8 bytes (may contain NUL).
        room: the bytes the key has left for it; at least 64.
    """
    if len(part) <= room:
        return part
    digest = hashlib.blake2b(part, digest_size=_DIGEST).hexdigest().encode()
    head = part[: room - len(digest) - 1].decode("utf-8", "ignore").encode()
    return head + _MARK + digest


def is_fitted(part: bytes) -> bool:
    """Whether a key part is a shortened one (its full value is in the record)."""
    return _MARK in part
