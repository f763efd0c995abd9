"""A record that fails its check (damaged on disk, or edited outside the engine) is quarantined
by every follower of the log that meets it (issue 11): kept as a failure, counted in stats, and
skipped, so the engine serves on and bystanders' turns are untouched. Reading that record for a
caller still raises StoreCorrupt naming it: never a wrong answer."""

from __future__ import annotations

import shutil
from pathlib import Path

import lmdb
import pytest

from engine import StoreCorrupt

from ..conftest import open_engine

FILLER = 70  # turns after the damaged one: more than open's tail check covers


async def _store_with_a_damaged_turn(path: Path) -> int:
    """ana's six turns and a bystander's, written with the long-term layer and background
    embedding off (so their followers meet every record at the next open), then plenty of later turns (the damage lies outside the
    tail that open checks), then one byte of ana's third turn flipped on disk."""
    async with open_engine(path, config={"long_term": False,
                                         "background_embedding": False}) as mem:
        receipts = [await mem.add_turn("ana", "s1", "user", f"ana met Maria in Lisbon, day {i}")
                    for i in range(6)]
        await mem.add_turn("bo", "b", "user", "bo's own turn about Berlin")
        for i in range(FILLER):
            await mem.add_turn("cy", "c", "user", f"filler {i}")
        await mem.flush()
    env = lmdb.open(str(path), max_dbs=32, lock=False)
    with env.begin(write=True) as txn:
        turns = env.open_db(b"turns", txn=txn)
        key = b"ana\x00s1\x00" + (2).to_bytes(8, "big")
        value = bytearray(txn.get(key, db=turns))
        value[-3] ^= 0xFF
        txn.put(key, bytes(value), db=turns)
    env.close()
    return receipts[2].lsn


@pytest.mark.parametrize("rebuild", [False, True], ids=["followers", "and-rebuilt-indexes"])
async def test_followers_quarantine_a_damaged_record_and_serve_on(
        store_path: Path, rebuild: bool) -> None:
    """The long-term followers and the embedder (and the text index, rebuilt from the store)
    keep a failure for the damaged record and go on; bo's turns and new turns are served; the
    record itself reads as StoreCorrupt."""
    lsn = await _store_with_a_damaged_turn(store_path)
    if rebuild:
        shutil.rmtree(store_path / "fulltext")
    async with open_engine(store_path) as mem:
        await mem.add_turn("bo", "b", "user", "bo goes on after the damage", durable=True)
        await mem.flush()
        failures = await mem.failures()
        damaged = {f.actor for f in failures if f.lsn == lsn}
        assert {"entities", "facts", "episodic"} <= damaged
        assert "embedder" in damaged
        if rebuild:
            assert "fulltext" in damaged
        assert all("fails its checksum" in f.error for f in failures if f.lsn == lsn)
        assert {f.user_id for f in failures} == {"ana"}
        assert (await mem.stats()).failures == len(failures)
        assert [t.text for t in await mem.session_history("bo", "b")] == [
            "bo's own turn about Berlin", "bo goes on after the damage"]
        hits = await mem.recall("bo", "Berlin")
        assert "bo's own turn about Berlin" in [h.text for h in hits]
        with pytest.raises(StoreCorrupt, match="fails its checksum"):
            await mem.session_history("ana", "s1")
    async with open_engine(store_path) as mem:  # and it opens again, the failures kept
        assert {f.lsn for f in await mem.failures()} == {lsn}
