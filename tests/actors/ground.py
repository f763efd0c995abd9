"""The ground an actor test stands on: a real Store, running bare, and turns appended to it as
ingest appends them (room first, then the op), without the engine above."""

from __future__ import annotations

import hashlib
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import trio

import actors.store as store_mod
from actors.base.config import Config
from actors.base.messages import AppendTurn
from actors.base.records import Turn

T0 = datetime(2026, 3, 1, 9, 0, tzinfo=timezone.utc)
DIM = 384  # the vectors' dimension, as the engine's model gives them
_WORD = re.compile(r"\w+")


def hash_vectors(texts: list[str], dim: int = DIM) -> np.ndarray:
    """A deterministic hash embedding (the engine's HashEmbedder, for actors that consume
    vectors without the embedder): each word hashes to a signed position, the sum is
    normalised, so texts sharing words have positive cosine and unrelated ones near zero."""
    out = np.zeros((len(texts), dim), dtype=np.float32)
    for row, text in enumerate(texts):
        for word in _WORD.findall(text.lower()) or [text]:
            h = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "big")
            out[row, h % dim] += 1.0 if (h >> 32) & 1 else -1.0
    norms = np.linalg.norm(out, axis=1, keepdims=True)
    norms[norms == 0] = 1.0
    return out / norms


class Ground:
    """A running Store, the nursery it runs in, and the sessions' next sequence numbers.

    Attributes:
        store: the Store.
        nursery: where the store runs; start the actor under test here (it stops when the store
            closes, as under the engine).
    """

    def __init__(self, store: store_mod.Store, nursery: trio.Nursery) -> None:
        self.store = store
        self.nursery = nursery
        self._seqs: dict[tuple[str, str], int] = {}  # the session buffer's count, per session

    async def start(self, run: Callable[..., Any]) -> None:
        """Start an actor's ``run`` next to the store's, and wait until it has started."""
        await self.nursery.start(run)

    async def add_turn(self, user_id: str, session_id: str, text: str, durable: bool = False,
                       role: str = "user", at_offset: timedelta | None = None) -> int:
        """Append one turn as ingest does; its lsn, once committed if ``durable``. It was said
        at T0 plus ``at_offset``, or by default at T0 plus its lsn in seconds."""
        store = self.store
        if (user_id, session_id) not in self._seqs:  # a session a previous run wrote goes on
            turns = await store.read(store_mod.read_session_turns, user_id, session_id, 0, 2**63)
            # setdefault: a concurrent first append to the same session may have counted already.
            self._seqs.setdefault((user_id, session_id), turns[-1].seq + 1 if turns else 0)
        await store.reserve(1)
        seq = self._seqs[user_id, session_id]
        self._seqs[user_id, session_id] = seq + 1
        lsn = store.next_lsn
        # Distinct and known by default, as the tests' StepClock gives.
        at = T0 + (timedelta(seconds=lsn) if at_offset is None else at_offset)
        turn = Turn(lsn, f"t{lsn}", user_id, session_id, seq, role, text, at)
        key = store_mod.session_prefix(user_id, session_id) + seq.to_bytes(8, "big")
        store.submit(AppendTurn(turn, key, msgspec.msgpack.encode(turn), at,
                                store_mod.user_prefix(user_id) + turn.turn_id.encode(), at))
        if durable:
            await store.wait_committed(lsn)
        return lsn

    async def texts(self, user_id: str, session_id: str) -> dict[int, str]:
        """A session's turns as stored: lsn -> text."""
        turns = await self.store.read(store_mod.read_session_turns, user_id, session_id, 0, 2**63)
        return {t.lsn: t.text for t in turns}


@asynccontextmanager
async def running_store(path: Path, config: Config | None = None,
                        model: store_mod.ModelInfo | None = None,
                        reembed: bool = False) -> AsyncIterator[Ground]:
    """A Store running in a nursery of its own; closed (and drained) on leaving, which also
    ends the actors started next to it. ``model`` and ``reembed`` as the engine passes them
    (the embedding model the vectors must come from; drop the vectors of another)."""
    store = store_mod.Store(path, config or Config(), model, reembed)
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        try:
            yield Ground(store, nursery)
        finally:
            store.close()
