"""Shared fixtures: a store directory, a steppable engine clock, an open engine."""

from __future__ import annotations

import threading
import zlib
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import lmdb
import pytest
import trio

import actors.fulltext as fulltext_mod
from engine import Engine, HashEmbedder

T0 = datetime(2026, 3, 1, 9, 0, tzinfo=timezone.utc)


class StepClock:
    """An engine clock that moves one step per reading, so turn times are distinct and known."""

    def __init__(self, start: datetime = T0, step: timedelta = timedelta(seconds=1)) -> None:
        self.now = start
        self.step = step

    def __call__(self) -> datetime:
        now = self.now
        self.now += self.step
        return now


def open_engine(path: Path, **kwargs: Any):
    """Engine.open with the deterministic HashEmbedder, for tests not about embeddings."""
    kwargs.setdefault("embedder", HashEmbedder())
    return Engine.open(path, **kwargs)


@contextmanager
def text_index_held(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The text index's commits held back until the block ends (at most 10 s each): what is
    stored meanwhile is not in the index yet, as right after a write (read-your-writes)."""
    gate = threading.Event()  # set: the text index may commit again
    original = fulltext_mod.FullText._commit

    def held_commit(self: Any) -> Any:
        gate.wait(10)
        return original(self)

    monkeypatch.setattr(fulltext_mod.FullText, "_commit", held_commit)
    try:
        yield
    finally:
        gate.set()


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def clock() -> StepClock:
    return StepClock()


@pytest.fixture
async def mem(store_path: Path, clock: StepClock) -> AsyncIterator[Engine]:
    async with open_engine(store_path, clock=clock) as engine:
        yield engine


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """A closed store with a few turns of two users, for commands run on it (the CLI's tests)."""
    async def fill() -> None:
        async with open_engine(tmp_path / "store") as engine:
            await engine.add_turn("ana", "s1", "user", "I moved to Lisbon")
            await engine.add_turn("ana", "s1", "assistant", "Welcome to Lisbon!")
            await engine.add_turn("bo", "x", "user", "hello")
            await engine.flush()

    trio.run(fill)
    return tmp_path / "store"


def raw_databases(path: Path) -> dict[str, list[tuple[bytes, bytes]]]:
    """Every key and value of every named database of a closed store, read with bare lmdb."""
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=32)
    try:
        with env.begin() as txn:
            names = [key for key, _ in txn.cursor()]
            out: dict[str, Any] = {}
            for name in names:
                db = env.open_db(name, txn=txn, create=False)
                out[name.decode()] = list(txn.cursor(db))
        return out
    finally:
        env.close()


def downgrade_to_schema_5(path: Path) -> None:
    """Turn a closed store into what a schema-5 build wrote: each value's checksum of its
    bytes alone (the migration to schema 6 takes the key in)."""
    env = lmdb.open(str(path), max_dbs=32, map_size=1 << 30)
    try:
        with env.begin(write=True) as txn:
            for name in [key for key, _ in txn.cursor()]:
                if name != b"meta":
                    db = env.open_db(name, txn=txn, create=False)
                    for key, value in list(txn.cursor(db)):
                        txn.put(key, value[:-4] + zlib.crc32(value[:-4]).to_bytes(4, "big"),
                                db=db)
            txn.put(b"schema", (5).to_bytes(8, "big"), db=env.open_db(b"meta", txn=txn))
    finally:
        env.close()


def downgrade_to_schema_4(path: Path) -> None:
    """Turn a closed store into what a schema-4 build wrote: values without their checksum, no
    hash chain (the migration to schema 5 adds both back)."""
    env = lmdb.open(str(path), max_dbs=32)
    try:
        with env.begin(write=True) as txn:
            names = [key for key, _ in txn.cursor()]
            for name in names:
                db = env.open_db(name, txn=txn, create=False)
                if name == b"chain":
                    txn.drop(db, delete=True)
                elif name != b"meta":
                    for key, value in list(txn.cursor(db)):
                        txn.put(key, value[:-4], db=db)
            meta = env.open_db(b"meta", txn=txn)
            txn.delete(b"chain_head", db=meta)
            txn.put(b"schema", (4).to_bytes(8, "big"), db=meta)
    finally:
        env.close()
