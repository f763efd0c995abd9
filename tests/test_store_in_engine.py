"""The Store actor as the engine wires it: what a store-level fault or migration means for the
engine around it (the store alone is tested in tests/actors/test_store.py)."""

from __future__ import annotations

import lmdb
import pytest
import trio

import actors.store as store_mod
from engine import EngineBroken, HashEmbedder

from .conftest import downgrade_to_schema_4, open_engine


async def test_schema_1_float32_vectors_are_migrated_to_float16(store_path) -> None:
    """A schema-1 store (float32 vectors) opens as the current schema with the same vectors,
    searchable."""
    import numpy as np

    async with open_engine(store_path) as mem:
        r = await mem.add_turn("ana", "s", "user", "lisbon dog walk")
        await mem.flush()
    downgrade_to_schema_4(store_path)
    env = lmdb.open(str(store_path), max_dbs=32)
    with env.begin(write=True) as txn:
        vectors = env.open_db(b"vectors", txn=txn)
        for key, value in list(txn.cursor(vectors)):
            old = np.frombuffer(value[16:], dtype="<f2").astype("<f4")  # as schema 1 stored it
            txn.put(key, value[:16] + old.tobytes(), db=vectors)
        txn.put(b"schema", (1).to_bytes(8, "big"), db=env.open_db(b"meta", txn=txn))
    env.close()
    async with open_engine(store_path) as mem:
        hits = await mem.recall("ana", "lisbon dog walk", limit=1, kinds=["turn"])
        found = await mem._ann.search("ana", HashEmbedder().encode(["lisbon dog walk"])[0], 1)
    assert [h.id for h in hits] == [r.turn_id]
    assert found[0][0] == r.lsn and found[0][1] > 0.999


async def test_a_failing_disk_breaks_the_engine_loudly(store_path, monkeypatch) -> None:
    """A write error fails pending durable receipts and surfaces as one EngineBroken."""
    outcomes: list[BaseException] = []

    def broken_write(self, segments, last_lsn, flush):
        raise EngineBroken("writing to the store failed: No space left on device") from OSError(28, "ENOSPC")

    with pytest.raises(EngineBroken, match=r"the engine failed") as info:
        async with open_engine(store_path) as mem:
            monkeypatch.setattr(store_mod.Store, "_write", broken_write)
            r = await mem.add_turn("ana", "s1", "user", "lost")
            try:
                await r.durable()
            except EngineBroken as exc:
                outcomes.append(exc)
            await trio.sleep_forever()
    assert isinstance(info.value.__cause__, BaseExceptionGroup)
    (failure,) = outcomes
    assert "store failed before committing" in str(failure)


async def test_a_failing_disk_names_the_write_it_failed_not_a_turn(store_path,
                                                                   monkeypatch) -> None:
    """A forget_session (or a note, a fact) the failing disk never committed was told
    "the store failed before committing this turn": it names the write now."""
    def broken_write(self, segments, last_lsn, flush):
        raise EngineBroken("writing to the store failed: No space left on device")

    failures: list[BaseException] = []
    with pytest.raises(EngineBroken):
        async with open_engine(store_path) as mem:
            await mem.add_turn("ana", "s1", "user", "kept", durable=True)
            await mem.flush()  # no background write of the turn's is left to meet the disk
            monkeypatch.setattr(store_mod.Store, "_write", broken_write)
            try:
                await mem.forget_session("ana", "s1")
            except EngineBroken as exc:
                failures.append(exc)
            await trio.sleep_forever()
    (failure,) = failures
    assert "before committing this write" in str(failure) and "turn" not in str(failure)


async def test_an_open_on_a_full_disk_leaves_no_lock_behind(store_path, monkeypatch) -> None:
    """Writing its pid into the owner lock failed with ENOSPC after the lock was taken: the
    open raised a bare OSError and the descriptor stayed locked, so once space was freed every
    open, in this process or another, was refused as "in use (it is starting)" until the
    process exited. The open fails as EngineBroken saying the disk is full, and the next open
    after space comes back works."""
    import errno
    import os

    import engine._owner as owner_mod

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patched:
        patched.setattr(owner_mod.os, "pwrite", full)
        with pytest.raises(EngineBroken, match="No space left on device"):
            async with open_engine(store_path):
                pass
    async with open_engine(store_path) as mem:
        await mem.add_turn("ana", "s1", "user", "space is back", durable=True)


async def test_a_text_index_commit_failing_at_close_frees_it_for_the_reopen(
        store_path, monkeypatch) -> None:
    """The disk filled as the text index committed at close: its writer was never dropped
    (the commit raised before the release), so tantivy's directory lock stayed with the
    broken engine, and the reopen failed with a bare ValueError (LockBusy) until that
    engine's objects were collected. The writer goes in any case; a full disk at that commit
    is logged, not the close's failure (the index is derived: the next open replays what
    the commit lost); the reopen works and the index catches up from the log."""
    import actors.fulltext.fulltext as fulltext_mod

    def full(self) -> None:
        raise ValueError("IoError { kind: StorageFull, \"No space left on device\" }")

    with monkeypatch.context() as patched:
        patched.setattr(fulltext_mod, "COMMIT_INTERVAL", 3600.0)  # it commits at close only
        async with open_engine(store_path) as mem:
            await mem.add_turn("ana", "s1", "user", "the ferry to Barreiro", durable=True)
            while mem._parts.fulltext._pending == 0:
                await trio.sleep(0.01)
            patched.setattr(fulltext_mod.FullText, "_commit", full)
    async with open_engine(store_path) as mem:
        await mem.flush()  # the index replays the turn its failed commit lost
        hits = await mem.recall("ana", "ferry Barreiro", legs=["bm25"])
        assert [h.text for h in hits] == ["the ferry to Barreiro"]


async def test_a_text_index_a_full_disk_cannot_open_is_kept_not_deleted(
        store_path, monkeypatch) -> None:
    """Opening a healthy text index on a full disk failed (tantivy: StorageFull), and the
    engine took that for damage: it deleted the index to rebuild it, which then failed too.
    The open fails as EngineBroken saying the disk is full, and the index is kept."""
    import actors.fulltext.fulltext as fulltext_mod

    async with open_engine(store_path) as mem:
        await mem.add_turn("ana", "s1", "user", "the ferry to Barreiro", durable=True)
        await mem.flush()
    index = fulltext_mod.tantivy.Index

    def full(*args, **kwargs):
        raise ValueError('IoError { io_error: Custom { kind: StorageFull, error: "No space '
                         'left on device" } }')

    with monkeypatch.context() as patched:
        patched.setattr(fulltext_mod.tantivy, "Index", full)
        with pytest.raises(EngineBroken, match="StorageFull"):
            async with open_engine(store_path):
                pass
    assert fulltext_mod.tantivy.Index is index
    assert (store_path / "fulltext" / "meta.json").exists()
    async with open_engine(store_path) as mem:
        assert not mem._parts.fulltext.rebuilt
        assert [h.text for h in await mem.recall("ana", "ferry", legs=["bm25"])] == [
            "the ferry to Barreiro"]


@pytest.mark.parametrize("where", ["open", "first transaction"])
async def test_a_store_a_full_disk_cannot_open_says_so(store_path, monkeypatch, where) -> None:
    """On a full disk LMDB's open or its first write transaction (a new store's databases, a
    schema migration) failed with ENOSPC: the caller got StoreIncompatible ("cannot open an
    LMDB store"), which says the store is not usable by this build, or a bare lmdb.DiskError.
    Both are EngineBroken saying the disk is full; the store opens once there is room."""
    async with open_engine(store_path) as mem:
        await mem.add_turn("ana", "s1", "user", "kept", durable=True)

    def full(*args, **kwargs):
        raise lmdb.DiskError(f"{store_path}: No space left on device")

    with monkeypatch.context() as patched:
        patched.setattr(store_mod.Store, "_lmdb_open" if where == "open" else "_open_txn",
                        full)
        with pytest.raises(EngineBroken, match="No space left on device"):
            async with open_engine(store_path):
                pass
    async with open_engine(store_path) as mem:
        assert [t.text for t in await mem.session_history("ana", "s1")] == ["kept"]


async def test_a_child_forked_while_the_engine_runs_does_not_keep_the_store(store_path) -> None:
    """A worker forked while the engine ran (a pre-forking server, a multiprocessing pool)
    inherited the owner lock's descriptor, and with it the lock: once the engine closed, the
    parent could not open its own store again (StoreInUse naming itself) until the child
    exited. The child drops the descriptor at the fork."""
    import os
    import signal
    import time

    async with open_engine(store_path) as mem:
        await mem.add_turn("ana", "s1", "user", "before the fork", durable=True)
        child = os.fork()
        if child == 0:  # a worker that never touches the engine, until it is killed
            try:
                time.sleep(60)
            finally:
                os._exit(0)
    try:
        async with open_engine(store_path) as mem:
            assert [t.text for t in await mem.session_history("ana", "s1")] == [
                "before the fork"]
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_a_forked_childs_inherited_lock_never_releases_a_lock_of_its_own(tmp_path) -> None:
    """The child closes its copy of an inherited owner lock at the fork; the next lock it
    takes may get the same descriptor number, and releasing the inherited lock object (a
    `with` block unwinding in the child) closed that new lock: another process could then
    take a store the child believed it owned. Only the process that took a lock releases it."""
    import fcntl
    import os

    from engine._owner import LOCK_NAME, OwnerLock

    inherited = OwnerLock(tmp_path / "a", "serving").acquire()
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            own = OwnerLock(tmp_path / "b", "serving").acquire()
            inherited.release()
            probe = os.open(tmp_path / "b" / LOCK_NAME, os.O_RDWR)
            try:
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.write(write, b"taken")
            except BlockingIOError:
                os.write(write, b"held")
            own.release()
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    assert os.read(read, 16) == b"held"
    inherited.release()
