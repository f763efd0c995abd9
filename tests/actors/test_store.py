"""The Store actor: schema, group commit, failures, cancellation and the log it keeps.

Driven bare (``Store.run`` in a nursery, ops built as the session buffer builds them), over a real
LMDB store; what a store fault means for the engine around it is in tests/test_store_in_engine.py.
"""

from __future__ import annotations

import sys
import threading
from array import array
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime, timezone
from pathlib import Path

import lmdb
import msgspec
import numpy as np
import pytest
import trio

import actors.store as store_mod
from actors.base.config import Config
from actors.base.errors import EngineBroken, EngineClosed, StoreCorrupt, StoreIncompatible
from actors.base.messages import AppendTurn, PutVectors
from actors.base.records import SCHEMA_VERSION, Turn
from actors.store.integrity import (
    ZERO,
    CheckedTxn,
    chain_records,
    content_digest,
    link,
    seal,
    seal_all,
    unseal,
)

from ..conftest import downgrade_to_schema_4, raw_databases


@asynccontextmanager
async def running_store(path: Path) -> AsyncIterator[store_mod.Store]:
    """A Store running in a nursery of its own; closed (and drained) on leaving."""
    store = store_mod.Store(path, Config())
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        try:
            yield store
        finally:
            store.close()


class Ingest:
    """Appends turns of user ``ana`` as ingest does: room first, then the op with the store's
    next lsn and the session's next sequence number (counted here, as the session buffer does)."""

    def __init__(self, store: store_mod.Store) -> None:
        self.store = store
        self.seqs: dict[str, int] = {}

    async def add_turn(self, session: str, text: str, durable: bool = False) -> int:
        """Append one turn; its lsn, once committed if ``durable``."""
        await self.store.reserve(1)
        seq = self.seqs.get(session, 0)
        self.seqs[session] = seq + 1
        op = _append(self.store, session, seq, text)
        self.store.submit(op)
        if durable:
            await self.store.wait_committed(op.lsn)
        return op.lsn


async def session_turns(store: store_mod.Store, session: str) -> list[Turn]:
    """Every turn of ``ana``'s session, read through the store."""
    return await store.read(store_mod.read_session_turns, "ana", session, 0, 2**63)


def _set_schema(path, version: int) -> None:
    env = lmdb.open(str(path), max_dbs=32)
    with env.begin(write=True) as txn:
        txn.put(b"schema", version.to_bytes(8, "big"), db=env.open_db(b"meta", txn=txn))
    env.close()


@pytest.mark.parametrize(("version", "message"), [
    (99, rf"schema version 99, newer than this build reads \({SCHEMA_VERSION}\); upgrade"),
    (0, r"no migration from 0 to 1"),
], ids=["newer", "no-migration"])
async def test_a_schema_this_build_cannot_bring_up_to_date_is_refused(store_path, version, message) -> None:
    """A newer schema (upgrade engram) or an old one with no migration path is not opened."""
    async with running_store(store_path):
        pass
    _set_schema(store_path, version)
    # The refusal ends Store.run before it started: the nursery around it reports it.
    with pytest.RaisesGroup(pytest.RaisesExc(StoreIncompatible, match=message)):
        async with running_store(store_path):
            pass


async def test_an_old_schema_is_migrated_in_order(store_path, monkeypatch) -> None:
    """Opening an older store runs each migration once, then records the current version."""
    async with running_store(store_path) as store:
        await Ingest(store).add_turn("s1", "kept through the migration")
    _set_schema(store_path, SCHEMA_VERSION - 1)
    ran: list[int] = []

    def migrate(txn, dbs) -> None:
        ran.append(0)
        txn.put(b"migrated", b"yes", db=dbs[b"meta"])

    monkeypatch.setitem(store_mod.MIGRATIONS, SCHEMA_VERSION - 1, migrate)
    async with running_store(store_path) as store:
        assert [t.text for t in await session_turns(store, "s1")] == ["kept through the migration"]
    async with running_store(store_path):
        pass
    assert ran == [0]
    meta = dict(raw_databases(store_path)["meta"])
    assert meta[b"migrated"] == b"yes" and int.from_bytes(meta[b"schema"], "big") == SCHEMA_VERSION


async def test_schema_1_float32_vectors_are_migrated_to_float16(store_path) -> None:
    """A schema-1 store (float32 vectors) opens as the current schema with the same vectors, as
    float16 behind the same header (that the engine's recall then finds the turn is in
    tests/test_store_in_engine.py)."""
    vector = np.random.default_rng(7).standard_normal(384).astype("<f4")
    vector /= np.linalg.norm(vector)
    header = bytes(range(16))  # the ANN's header: opaque to the store, kept as it is
    async with running_store(store_path) as store:
        lsn = await Ingest(store).add_turn("s", "lisbon dog walk", durable=True)
        await store.write_unlogged(PutVectors(
            [(lsn, "ana", header + vector.astype("<f2").tobytes())], lsn, trio.Event()))
    downgrade_to_schema_4(store_path)
    env = lmdb.open(str(store_path), max_dbs=32)
    with env.begin(write=True) as txn:
        vectors = env.open_db(b"vectors", txn=txn)
        for key, value in list(txn.cursor(vectors)):
            old = np.frombuffer(value[16:], dtype="<f2").astype("<f4")  # as schema 1 stored it
            txn.put(key, value[:16] + old.tobytes(), db=vectors)
        txn.put(b"schema", (1).to_bytes(8, "big"), db=env.open_db(b"meta", txn=txn))
    env.close()
    async with running_store(store_path) as store:
        lsns, values = await store.read(store_mod.read_user_vectors, "ana")
    assert lsns == [lsn] and values[:16] == header
    stored = np.frombuffer(values[16:], dtype="<f2").astype("<f4")
    assert stored.shape == (384,) and float(stored @ vector) > 0.999


@pytest.mark.parametrize("foreign", ["in its meta", "in a database of its own",
                                     "in the main database"])
async def test_foreign_lmdb_data_is_refused(store_path, foreign) -> None:
    """An LMDB environment that Engram did not write is not adopted, whatever names its data
    has (Engram's meta, a database Engram has no use for, the unnamed main one), and it is
    left as it was: no database of Engram's added to it."""
    env = lmdb.open(str(store_path), max_dbs=32)
    with env.begin(write=True) as txn:
        db = {"in its meta": lambda: env.open_db(b"meta", txn=txn),
              "in a database of its own": lambda: env.open_db(b"accounts", txn=txn),
              "in the main database": lambda: None}[foreign]()
        txn.put(b"k", b"v", db=db)
    with env.begin() as txn:
        before = list(txn.cursor())
    env.close()
    with pytest.RaisesGroup(pytest.RaisesExc(StoreIncompatible,
                                             match=r"without an Engram schema version")):
        async with running_store(store_path):
            pass
    env = lmdb.open(str(store_path), max_dbs=32)
    with env.begin() as txn:
        assert list(txn.cursor()) == before
    env.close()


async def test_a_failing_disk_fails_receipts_and_the_store_loudly(store_path, monkeypatch) -> None:
    """A write error fails pending durable receipts, ends the store's run with that error and
    refuses every later op (the engine's one EngineBroken around it: tests/test_store_in_engine.py)."""
    outcomes: list[BaseException] = []

    def broken_write(self, segments, last_lsn, flush):
        raise EngineBroken("writing to the store failed: No space left on device") from OSError(28, "ENOSPC")

    with pytest.RaisesGroup(pytest.RaisesExc(EngineBroken, match=r"No space left on device"),
                            flatten_subgroups=True):
        async with running_store(store_path) as store:
            monkeypatch.setattr(store_mod.Store, "_write", broken_write)
            try:
                await Ingest(store).add_turn("s1", "lost", durable=True)
            except EngineBroken as exc:
                outcomes.append(exc)
            with pytest.raises(EngineBroken, match=r"the store failed \(.*No space.*\); reopen it"):
                store.check_usable()
    (failure,) = outcomes
    assert "store failed before committing" in str(failure)


async def test_a_store_cancelled_from_outside_is_closed_not_broken(store_path) -> None:
    """When the store's nursery is cancelled (a server's task group, a test's scope), a task
    that runs once more before its own cancellation arrives, such as a follower about to
    write its step, must hear the store is closed (on which it returns), not that it failed:
    the engine then ended with EngineBroken ("the store failed; reopen it") around nothing
    but the cancellation."""
    store = store_mod.Store(store_path, Config())
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            await nursery.start(store.run)
            scope.cancel()
    with pytest.raises(EngineClosed):
        store.check_usable()


async def test_durable_writers_share_commits(store_path, monkeypatch) -> None:
    """Turns that arrive while a commit runs are committed together in the next one."""
    commits: list[int] = []
    original = store_mod.Store._write

    def counting_write(self, segments, last_lsn, flush):
        commits.append(last_lsn)
        return original(self, segments, last_lsn, flush)

    monkeypatch.setattr(store_mod.Store, "_write", counting_write)
    async with running_store(store_path) as store:
        ingest = Ingest(store)
        async with trio.open_nursery() as nursery:
            for i in range(200):
                nursery.start_soon(ingest.add_turn, f"s{i % 10}", f"t{i}", True)
    assert commits[-1] == 200
    assert len(commits) < 20


async def test_a_cancelled_caller_leaves_no_hole_in_the_log(store_path, monkeypatch) -> None:
    """Callers cancelled while waiting for queue room take no sequence number with them."""
    monkeypatch.setattr(store_mod.writer, "QUEUE_LIMIT", 4)
    gate = threading.Event()
    original = store_mod.Store._write

    def gated_write(self, segments, last_lsn, flush):
        gate.wait(10)
        return original(self, segments, last_lsn, flush)

    monkeypatch.setattr(store_mod.Store, "_write", gated_write)
    async with running_store(store_path) as store:
        ingest = Ingest(store)
        async with trio.open_nursery() as nursery:
            for i in range(12):
                nursery.start_soon(ingest.add_turn, "s1", f"t{i}")
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
        gate.set()
        lsn = await ingest.add_turn("s1", "after the cancellations", durable=True)
        history = await session_turns(store, "s1")
    # Four fit the queue (one in the blocked writer); the eight that waited were cancelled.
    assert [t.seq for t in history] == [0, 1, 2, 3, 4]
    assert history[-1].lsn == lsn == 5
    log_keys = [int.from_bytes(k, "big") for k, _ in raw_databases(store_path)["log"]]
    assert log_keys == list(range(1, lsn + 1))


async def test_forget_logs_a_tombstone_with_the_deleted_sequence_numbers(store_path) -> None:
    """The tombstone lists exactly the forgotten turns' lsns, for indexes to replay."""
    async with running_store(store_path) as store:
        ingest = Ingest(store)
        kept = await ingest.add_turn("s1", "stays")
        gone = [await ingest.add_turn("s2", f"goes {i}") for i in range(3)]
        await store.forget("ana", "s2")
    log = dict(raw_databases(store_path)["log"])
    key = (kept + 4).to_bytes(8, "big")
    tombstone = unseal(log[key], b"log", key)
    assert tombstone[:1] == store_mod.LOG_TOMBSTONE
    lsns = array("Q", tombstone[1:])
    lsns.byteswap()
    assert sorted(lsns) == gone
    assert sorted(int.from_bytes(k, "big") for k in log) == [kept, kept + 4]


def _append(store: store_mod.Store, session: str, seq: int, text: str = "hi") -> AppendTurn:
    """An AppendTurn for the store's next lsn, built as the session buffer builds one."""
    at = datetime(2026, 3, 1, tzinfo=timezone.utc)
    turn = Turn(store.next_lsn, f"t{store.next_lsn}", "ana", session, seq, "user", text, at)
    key = store_mod.session_prefix("ana", session) + seq.to_bytes(8, "big")
    return AppendTurn(turn, key, msgspec.msgpack.encode(turn), at,
                      store_mod.user_prefix("ana") + turn.turn_id.encode(), at)


async def test_a_receipt_is_released_by_a_flush_begun_after_its_commit(store_path,
                                                                       monkeypatch) -> None:
    """With fsync on, LMDB leaves each commit's meta page to the next flush (MDB_NOMETASYNC):
    the receipt waits for a flush that began after its commit returned, and not a moment less."""
    flushing = threading.Event()  # set when the flush has begun
    gate = threading.Event()  # set by the test: the flush may return
    original = store_mod.Store._sync

    def gated_sync(self):
        flushing.set()
        gate.wait(10)
        original(self)

    monkeypatch.setattr(store_mod.Store, "_sync", gated_sync)
    released: list[int] = []
    async with running_store(store_path) as store:
        flags = store._env.flags()
        assert (flags["sync"], flags["metasync"]) == (True, False)
        ingest = Ingest(store)
        async with trio.open_nursery() as nursery:

            async def durable() -> None:
                released.append(await ingest.add_turn("s1", "on disk", durable=True))

            nursery.start_soon(durable)
            await trio.to_thread.run_sync(flushing.wait, 10)
            await trio.testing.wait_all_tasks_blocked()
            assert released == []
            assert store.committed_lsn == 0
            gate.set()
        assert released == [1]
        assert store.committed_lsn == 1


async def test_the_next_commit_lands_the_batch_before_it(store_path, monkeypatch) -> None:
    """A commit fdatasyncs its pages after the previous commit wrote its meta page, so it lands
    that batch even while the sync loop's own flush is still under way."""
    gate = threading.Event()  # set by the test: the sync loop's flushes may return
    # Set by the test once a turn is queued behind batch 1 / 2: with a batch queued behind
    # it, the writer leaves a batch's flush to the sync loop and to the next commit.
    queued = {1: threading.Event(), 2: threading.Event()}
    writing = {1: threading.Event(), 2: threading.Event()}  # set as batch 1 / 2 is written
    original_sync, original_write = store_mod.Store._sync, store_mod.Store._write

    def gated_sync(self):
        gate.wait(10)
        original_sync(self)

    def held_write(self, segments, last_lsn, flush):
        if last_lsn in queued:
            writing[last_lsn].set()
            queued[last_lsn].wait(10)
        return original_write(self, segments, last_lsn, flush)

    monkeypatch.setattr(store_mod.Store, "_sync", gated_sync)
    monkeypatch.setattr(store_mod.Store, "_write", held_write)
    released = trio.Event()  # set when the first turn's receipt resolves
    async with running_store(store_path) as store:
        ingest = Ingest(store)

        async def durable() -> None:
            await ingest.add_turn("s1", "first", durable=True)
            released.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(durable)
            for lsn in (1, 2):
                await trio.to_thread.run_sync(writing[lsn].wait, 10)
                await ingest.add_turn("s1", f"behind batch {lsn}")
                queued[lsn].set()
            with trio.fail_after(30):
                await released.wait()  # landed by the second commit, the flush still held
            assert store.committed_lsn == 1
            gate.set()
        await store.wait_committed(3)


async def test_a_lone_durable_commit_is_flushed_on_the_writers_thread(store_path,
                                                                      monkeypatch) -> None:
    """A batch a caller waits for, with nothing queued behind it, is flushed by the writer's
    own thread right after its commit returned: no hop to the sync thread and back. Its
    receipt's way is timed stage by stage."""
    calls: list[str] = []  # "write", or where a flush ran, in order
    writing = threading.local()  # .now: this thread is inside the writer's transaction call
    original_sync, original_write = store_mod.Store._sync, store_mod.Store._write

    def recorded_sync(self):
        calls.append("flush in the write" if getattr(writing, "now", False) else "flush alone")
        original_sync(self)

    def recorded_write(self, segments, last_lsn, flush):
        calls.append("write")
        writing.now = True
        try:
            return original_write(self, segments, last_lsn, flush)
        finally:
            writing.now = False

    monkeypatch.setattr(store_mod.Store, "_sync", recorded_sync)
    monkeypatch.setattr(store_mod.Store, "_write", recorded_write)
    async with running_store(store_path) as store:
        assert store.receipt_stages() == {}
        assert await Ingest(store).add_turn("s1", "alone", durable=True) == 1
        assert store.committed_lsn == 1
        assert calls == ["write", "flush in the write"]
        stages = store.receipt_stages()
        assert list(stages) == [*store_mod.writer.STAGES, "total"]
        assert all(0 <= s["p50_ms"] <= s["p99_ms"] <= s["max_ms"] for s in stages.values())
        assert stages["total"]["p50_ms"] >= stages["flush"]["p50_ms"] > 0


async def test_a_receipt_does_not_wait_for_the_batch_queued_behind_it(store_path,
                                                                      monkeypatch) -> None:
    """While the next batch is being written, the flush that covers the previous commit runs on
    its own thread and releases that commit's callers."""
    writing = threading.Event()  # set once the first batch's write has begun
    gate = threading.Event()  # set by the test: later batches may be written
    original = store_mod.Store._write

    def gated_write(self, segments, last_lsn, flush):
        if last_lsn is not None and last_lsn > 1:
            gate.wait(10)
        writing.set()
        return original(self, segments, last_lsn, flush)

    monkeypatch.setattr(store_mod.Store, "_write", gated_write)
    async with running_store(store_path) as store:
        first = _append(store, "s1", 0)
        store.submit(first)
        await trio.to_thread.run_sync(writing.wait, 10)
        for seq in range(1, 4):
            store.submit(_append(store, "s1", seq))
        with trio.fail_after(30):
            await store.wait_committed(first.lsn)  # batch 2..4 is held in its write meanwhile
        assert store.committed_lsn == 1
        gate.set()
        await store.wait_committed(4)


async def test_without_fsync_a_commit_lands_at_once(store_path, monkeypatch) -> None:
    """fsync=False: LMDB syncs nothing (a receipt survives kill -9, not a power cut) and the
    sync loop never flushes."""
    flushes: list[int] = []
    monkeypatch.setattr(store_mod.Store, "_sync", lambda self: flushes.append(1))
    store = store_mod.Store(store_path, Config(fsync=False))
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        flags = store._env.flags()
        assert (flags["sync"], flags["metasync"]) == (False, False)
        assert await Ingest(store).add_turn("s1", "in the page cache", durable=True) == 1
        store.close()
    assert flushes == []


async def test_background_steps_yield_to_a_receipt_on_its_way(store_path, monkeypatch) -> None:
    """A follower's step waits while a caller waits for its commit to land, until the next
    landing; with nobody waiting it goes on at once."""
    gate = threading.Event()  # set by the test: the sync loop's flushes may return
    original = store_mod.Store._sync

    def gated_sync(self):
        gate.wait(10)
        original(self)

    monkeypatch.setattr(store_mod.Store, "_sync", gated_sync)
    stepped_at: list[int] = []
    async with running_store(store_path) as store:
        ingest = Ingest(store)
        await store.yield_to_receipts()  # nobody waits: at once

        async def follower_step() -> None:
            await store.yield_to_receipts()
            stepped_at.append(store.committed_lsn)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ingest.add_turn, "s1", "on its way", True)
            await trio.testing.wait_all_tasks_blocked()  # its flush is held
            nursery.start_soon(follower_step)
            await trio.testing.wait_all_tasks_blocked()
            assert stepped_at == []
            gate.set()
        assert stepped_at == [1]


async def test_a_waiting_receipt_lowers_the_switch_interval_until_it_lands(store_path,
                                                                           monkeypatch) -> None:
    """While a caller waits for its commit to land, the interpreter's switch interval is at
    most receipt_switch_us (each thread on the receipt's way gets the GIL back within it);
    once nobody waits it is what it was. Two stores waiting at once share one count."""
    gate = threading.Event()  # set by the test: flushes may return
    original = store_mod.Store._sync

    def gated_sync(self):
        gate.wait(10)
        original(self)

    monkeypatch.setattr(store_mod.Store, "_sync", gated_sync)
    before = sys.getswitchinterval()
    seen: dict[str, float] = {}
    async with running_store(store_path / "a") as first, running_store(store_path / "b") as second:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(Ingest(first).add_turn, "s1", "waits", True)
            nursery.start_soon(Ingest(second).add_turn, "s1", "waits too", True)
            await trio.testing.wait_all_tasks_blocked()  # both flushes are held
            seen["waiting"] = sys.getswitchinterval()
            gate.set()
        seen["landed"] = sys.getswitchinterval()
        await Ingest(first).add_turn("s1", "buffered")
        seen["buffered"] = sys.getswitchinterval()
    assert seen == {"waiting": Config().receipt_switch_us / 1e6, "landed": before,
                    "buffered": before}


async def test_receipt_switch_zero_leaves_the_interval_alone(store_path, monkeypatch) -> None:
    """receipt_switch_us=0: the interpreter's switch interval is never touched."""
    set_to: list[float] = []
    monkeypatch.setattr(sys, "setswitchinterval", set_to.append)
    store = store_mod.Store(store_path, Config(receipt_switch_us=0))
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        assert await Ingest(store).add_turn("s1", "durable", durable=True) == 1
        store.close()
    assert set_to == []


async def test_callers_run_before_the_steps_that_yielded_to_them(store_path, monkeypatch) -> None:
    """A landing releases its callers before the background steps that yielded to them:
    trio runs one scheduling batch in random order, so a step woken with a caller could run
    its Python first, between the flush and the caller. Twenty landings, each with a caller
    and a step waiting on it: the caller goes first every time."""
    gate = threading.Semaphore(0)  # released by the test: one flush may return
    original = store_mod.Store._sync

    def gated_sync(self):
        gate.acquire(timeout=10)
        original(self)

    monkeypatch.setattr(store_mod.Store, "_sync", gated_sync)
    order: list[str] = []
    async with running_store(store_path) as store:
        ingest = Ingest(store)

        async def caller(i: int) -> None:
            await ingest.add_turn("s1", f"turn {i}", durable=True)
            order.append("caller")

        async def step() -> None:
            await store.yield_to_receipts()
            order.append("step")

        for i in range(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(caller, i)
                await trio.testing.wait_all_tasks_blocked()  # its flush is held
                nursery.start_soon(step)
                await trio.testing.wait_all_tasks_blocked()
                gate.release()
    assert order == ["caller", "step"] * 20


def test_chain_records_of_a_run_are_its_links_one_at_a_time() -> None:
    """chain_records (the writer's loop over a run of turns) makes the records and the last
    digest that content_digest and link make one position at a time, which verify uses; and
    seal_all seals as seal does."""
    lsns = [store_mod.lsn_key(lsn) for lsn in range(7, 12)]
    entries = [store_mod.LOG_TURN + b"ana\x00s\x00" + lsn for lsn in lsns]
    values = [bytes(range(i * 10)) for i in range(5)]
    previous, expected = bytes(range(16)), []
    for lsn, entry, value in zip(lsns, entries, values, strict=True):
        content = content_digest(lsn, entry, value)
        previous = link(previous, lsn, content, b"")
        expected.append(previous + content)
    assert chain_records(bytes(range(16)), lsns, entries, values) == (expected, previous)
    assert chain_records(ZERO, [], [], []) == ([], ZERO)
    assert list(seal_all(values, lsns)) == [seal(v, k) for v, k in zip(values, lsns)]


def test_a_getter_checks_each_value_as_get_does(tmp_path) -> None:
    """CheckedTxn.getter (read_records' loop) and a checked cursor's scan return what get
    returns and refuse each damaged value, a flipped byte in the value or in its seal and a
    value shorter than a seal, with get's StoreCorrupt; meta is read raw."""
    env = lmdb.open(str(tmp_path), max_dbs=4)
    turns, meta = env.open_db(b"turns"), env.open_db(b"meta")
    good = seal(b"a turn's bytes")
    body_flip = bytearray(good)
    body_flip[3] ^= 0x20
    seal_flip = bytearray(good)
    seal_flip[-1] ^= 0x01
    values = {b"good": good, b"empty": seal(b""), b"body": bytes(body_flip),
              b"seal": bytes(seal_flip), b"short": b"\x00\x00", b"none": b""}
    with env.begin(write=True) as raw:
        for key, value in values.items():
            raw.put(key, value, db=turns)
        raw.put(b"m", b"raw", db=meta)
    with env.begin(buffers=False) as raw:
        txn = CheckedTxn(raw, {turns: b"turns", meta: b"meta"})
        get = txn.getter(turns)
        assert get(b"good") == txn.get(b"good", db=turns) == b"a turn's bytes"
        assert get(b"empty") == b""
        assert get(b"missing") is None
        assert txn.getter(meta)(b"m") == b"raw"
        for key in (b"body", b"seal", b"short", b"none"):
            with pytest.raises(StoreCorrupt) as by_get:
                txn.get(key, db=turns)
            with pytest.raises(StoreCorrupt) as by_getter:
                get(key)
            cursor = txn.cursor(turns)
            assert cursor.set_key(key)
            with pytest.raises(StoreCorrupt) as by_scan:
                next(cursor.iternext())
            assert str(by_getter.value) == str(by_scan.value) == str(by_get.value)
            assert (by_getter.value.database, by_getter.value.key) == ("turns", key)
    env.close()


async def test_a_batch_is_planned_on_the_writers_thread(store_path, monkeypatch) -> None:
    """Cutting a batch into runs is Python over every op (4-5 ms for 3,000 turns), so it runs
    on the writer's thread, beside the trio thread that lands receipts and takes buffered
    turns, not on it; and its receipt's stages say so, in order."""
    planned_on: list[int] = []
    original = store_mod.writer._plan

    def recorded_plan(ops):
        planned_on.append(threading.get_ident())
        return original(ops)

    monkeypatch.setattr(store_mod.writer, "_plan", recorded_plan)
    async with running_store(store_path) as store:
        ingest = Ingest(store)
        for i in range(3):
            await ingest.add_turn("s1", f"turn {i}", durable=True)
        stages = store.receipt_stages()
    assert len(planned_on) == 3
    assert threading.get_ident() not in planned_on
    assert list(stages)[:4] == ["queued", "to_writer", "plan", "write"]


def _used(store: store_mod.Store) -> int:
    """Bytes of the store's map in use."""
    return (store._env.info()["last_pgno"] + 1) * store._env.stat()["psize"]


async def _fill_past_half_the_map(store: store_mod.Store, ingest: Ingest,
                                  text: str) -> None:
    """Append turns until more than half of the map is in use: a snapshot then grows it."""
    while _used(store) * 2 <= store.map_size():
        for _ in range(20):
            lsn = await ingest.add_turn("s", text)
        await store.wait_committed(lsn)


async def test_ingest_outgrowing_the_map_does_not_wait_for_a_snapshots_copy(store_path,
                                                                             monkeypatch) -> None:
    """A snapshot's copy holds one read transaction for as long as it runs, and the map can
    grow only with no transaction open: a map that filled meanwhile stalled the writer, and
    every add_turn behind its queue, until the copy ended (one add_turn waited 37 s in a 1M
    snapshot under load). The copy makes room first, so ingest writing past the map's size
    of before commits while the copy is still held open."""
    inside = threading.Event()  # set by the copy once it runs, inside its read transaction
    release = threading.Event()  # set by the test: the copy may go on
    original = store_mod.store.copy_pages_hashed

    def held(env, txn, dest, chunk):
        inside.set()
        release.wait()
        return original(env, txn, dest, chunk)

    monkeypatch.setattr(store_mod.store, "copy_pages_hashed", held)
    store = store_mod.Store(store_path, Config(initial_map_bytes=1 << 20))
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        try:
            ingest = Ingest(store)
            text = "a long enough turn " * 50
            await _fill_past_half_the_map(store, ingest, text)
            before = store.map_size()
            copied: list[tuple[int, list[str] | None]] = []

            async def snapshot() -> None:
                copied.append(await store.copy_to(store_path.parent / "copy", sync=False,
                                                  hash_chunk=8 << 20))

            nursery.start_soon(snapshot)
            await trio.to_thread.run_sync(inside.wait)
            # A hang guard, not a timing: without the room made first this never returns.
            with trio.fail_after(60):
                while _used(store) <= before:
                    for _ in range(20):
                        lsn = await ingest.add_turn("s", text)
                    await store.wait_committed(lsn)
            assert not copied  # all of it committed while the copy held its transaction
            release.set()
        finally:
            release.set()
            store.close()
    assert copied and copied[0][0] < lsn  # the copy is of the state its transaction saw


async def test_a_snapshot_grows_the_map_only_between_the_writers_transactions(
        store_path, monkeypatch) -> None:
    """A snapshot makes room in the map before its copy (above); LMDB may resize a map only
    with no transaction open in the process, the writer's included. A snapshot that came
    while the writer's thread was inside its write transaction failed with a bare lmdb.Error
    ("Cannot set_mapsize while a write transaction is active"), and a resize that met the
    writer's own calls on the map broke the store (EngineBroken, "mdb_env_info: Invalid
    argument"). The resize now waits for the writer's transaction, and the writer for it."""
    inside = threading.Event()  # set by the writer's thread inside its write transaction
    release = threading.Event()  # set by the test: the transaction may commit
    original = store_mod.writer._put_run

    def held(txn, dbs, seg):
        if not release.is_set():
            inside.set()
            release.wait()
        return original(txn, dbs, seg)

    store = store_mod.Store(store_path, Config(initial_map_bytes=1 << 20))
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        try:
            ingest = Ingest(store)
            await _fill_past_half_the_map(store, ingest, "a long enough turn " * 50)
            before = store.map_size()
            monkeypatch.setattr(store_mod.writer, "_put_run", held)
            held_lsn = await ingest.add_turn("s", "written while the snapshot starts")
            await trio.to_thread.run_sync(inside.wait)
            copied: list[int] = []

            async def snapshot() -> None:
                copied.append((await store.copy_to(store_path.parent / "copy", sync=False))[0])

            nursery.start_soon(snapshot)
            await trio.sleep(0.2)  # the snapshot meets the open transaction
            release.set()
            with trio.fail_after(60):  # a hang guard, not a timing
                await store.wait_committed(held_lsn)
                while not copied:
                    await trio.sleep(0.01)
            assert store.map_size() > before
            assert copied[0] >= held_lsn - 1
            assert store.usable()
            await ingest.add_turn("s", "after the snapshot", durable=True)
        finally:
            release.set()
            store.close()
    async with running_store(store_path) as reopened:
        texts = {t.text for t in await reopened.read(store_mod.read_session_turns, "ana", "s",
                                                     0, 2**63)}
    assert {"written while the snapshot starts", "after the snapshot"} <= texts
