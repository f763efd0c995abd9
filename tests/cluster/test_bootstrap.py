"""Snapshots in the object store: a new owner starts from the newest and replays only the
log after it; a copy the node no longer owns is deleted after the grace period."""

from __future__ import annotations

import io
import random
import signal
import sys
import threading
import zlib
from datetime import datetime
from pathlib import Path

import msgspec
import numpy as np
import pytest
import trio

from engine._logbatch import LogTurn
from engine.cluster._bootstrap import (
    Framed,
    PartitionRecords,
    PartitionSnapshot,
    decode,
    drop_local,
    opened,
    restore,
    take,
)
from engine.cluster import _bootstrap
from engine.cluster._node import Node
from engine.cluster._partition import partition_of
from engine.cluster._writes import ClusterEngine

from actors.base.messages import PutNote
from engine import Candidate, Engine, InvalidInput, Note

from ..conftest import T0, open_engine, text_index_held
from .conftest import ROOT, connect, one_node, wait_for

pytestmark = pytest.mark.timeout(120)


def _users(partitions: int) -> tuple[str, str]:
    """A user of partition 0 and one of partition 1."""
    found = {}
    for i in range(100):
        found.setdefault(partition_of(f"user-{i}", partitions), f"user-{i}")
    return found[0], found[1]


async def _memory(engine, user: str) -> list:
    return ([(s.session_id, s.turn_count) for s in await engine.list_sessions(user)]
            + [(t.turn_id, t.seq, t.text) for t in await engine.session_history(user, "s",
                                                                                 limit=1000)]
            + [(n.note_id, n.text) for n in await engine.list_notes(user)]
            + [(f.value, f.status) for f in await engine.fact_versions(user)])


async def test_a_snapshot_restores_into_an_empty_store_as_the_memory_at_its_watermark(
        tmp_path: Path) -> None:
    """take then restore, in-process: the same turns, seqs, notes and facts, the same
    vectors without a model call (the snapshot carries them), and the partition's watermark
    is the snapshot's; a snapshot of another partition is refused."""
    from engine._logbatch import LogCall

    at = T0
    async with open_engine(tmp_path / "a", config={"long_term": False}) as a:
        entries = [(i + 1, LogTurn("ana", "s", f"t_{i:020x}", "user", f"turn {i}", at))
                   for i in range(20)]
        entries.append((21, LogCall("ana", "store_note", {"text": "tea", "note_id": "n_1"})))
        entries.append((22, LogCall("ana", "remember_fact", {"category": "pets", "key": "cat",
                                                             "value": "Miso", "valid_at": at})))
        p = partition_of("ana", 4)
        assert await a.apply_log_batch(p, entries) == 22
        data = await take(a, p, 4, 22, "a")
        expected = await _memory(a, "ana")
        vectors = sorted((await a.export_vectors("ana")).vectors.values())
    snapshot = decode(data, p, 4)
    assert isinstance(snapshot, PartitionRecords) and len(snapshot.vectors[0].lsns) == len(
        vectors) >= 21
    with pytest.raises(InvalidInput, match="partition"):
        decode(data, (p + 1) % 4, 4)
    async with open_engine(tmp_path / "b", config={"long_term": False}) as b:
        await restore(b, snapshot)
        assert await b.apply_log_batch(p, []) == 22
        assert await _memory(b, "ana") == expected
        await b.flush()
        assert sorted((await b.export_vectors("ana")).vectors.values()) == vectors
        assert (await b.stats()).texts_embedded == 0
        assert await drop_local(b, p, 4) == 1
        assert await b.apply_log_batch(p, []) == 0 and await b.list_users() == []
    assert (await Engine.verify(tmp_path / "b"))["ok"]


def test_a_snapshot_taken_before_vectors_were_carried_still_decodes() -> None:
    """A snapshot stored by an engine whose snapshots carried no vectors decodes, with
    none: its new owner embeds the turns, as it did."""

    class Earlier(msgspec.Struct, tag="engram-partition-snapshot"):
        partition: int
        partitions: int
        watermark: int
        node: str
        taken_at: datetime
        users: list[tuple[str, bytes]]

    data = zlib.compress(msgspec.msgpack.encode(Earlier(1, 4, 9, "a", T0, [("ana", b"x")])))
    snapshot = decode(data, 1, 4)
    assert (snapshot.watermark, snapshot.users, snapshot.vectors) == (9, [("ana", b"x")], {})


async def _exports(engine: Engine, p: int, partitions: int, watermark: int
                   ) -> PartitionSnapshot:
    """A snapshot of the first format, as nodes took them before they carried records: each
    user's export and vectors, through the bytes a node stored."""
    users, vectors = [], {}
    for user in sorted(u for u in await engine.list_users() if partition_of(u, partitions) == p):
        out = io.BytesIO()
        await engine.export_user(user, out)
        users.append((user, out.getvalue()))
        vectors[user] = await engine.export_vectors(user)
    data = _bootstrap._pack(PartitionSnapshot(p, partitions, watermark, "a", T0, users, vectors))
    snapshot = decode(data, p, partitions)
    assert isinstance(snapshot, PartitionSnapshot)
    return snapshot


async def test_a_snapshot_of_the_first_format_restores_in_batches_and_a_bad_export_unmarked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A snapshot stored before snapshots carried records (users' exports) restores, in
    batches (here of a few users each), into the same memory as one of records; an export
    that does not read stops the restore with its own InvalidInput, naming it, and the
    partition's watermark is not set, so the next owner starts over."""
    p = 0
    users = [u for u in (f"user-{i}" for i in range(200)) if partition_of(u, 4) == p][:24]
    async with open_engine(tmp_path / "a", config={"long_term": False}) as a:
        entries = [(i + 1, LogTurn(users[i % len(users)], "s", f"t_{i:020x}", "user",
                                   f"turn {i}", T0)) for i in range(10 * len(users))]
        assert await a.apply_log_batch(p, entries) == len(entries)
        snapshot = await _exports(a, p, 4, len(entries))
        records = decode(await take(a, p, 4, len(entries), "a"), p, 4)
        expected = {u: await _memory(a, u) for u in users}
    batches: list[int] = []
    import_users = Engine.import_users

    async def counted(self: Engine, sources: list[bytes], **kwargs: object) -> object:
        batches.append(len(sources))
        return await import_users(self, sources, **kwargs)

    monkeypatch.setattr(Engine, "import_users", counted)
    monkeypatch.setattr(_bootstrap, "RESTORE_BATCH_BYTES", 5 * len(snapshot.users[0][1]))
    async with open_engine(tmp_path / "b", config={"long_term": False}) as b:
        await restore(b, snapshot)
        assert {u: await _memory(b, u) for u in users} == expected
        assert await b.apply_log_batch(p, []) == len(entries)
    assert len(batches) > 3 and sum(batches) == len(users), batches
    async with open_engine(tmp_path / "c", config={"long_term": False}) as c:
        await restore(c, records)
        assert {u: await _memory(c, u) for u in users} == expected
    bad = msgspec.structs.replace(snapshot, users=[*snapshot.users[:-1],
                                                   (users[-1], b"not an export")])
    async with open_engine(tmp_path / "d", config={"long_term": False}) as d:
        with pytest.raises(InvalidInput, match=r"sources\[\d+\]: line 1"):
            await restore(d, bad)
        assert await d.apply_log_batch(p, []) == 0


async def _snapshot_of(path: Path, users: int, turns: int, p: int = 0, partitions: int = 4
                       ) -> tuple[bytes, list[str], dict[str, list[str]]]:
    """A store at ``path`` applies ``turns`` turns of ``users`` users of partition ``p``
    (round robin, one session each) and takes the partition's snapshot: its bytes, the
    users, and each user's texts."""
    ids = [u for u in (f"user-{i}" for i in range(200)) if partition_of(u, partitions) == p]
    ids = ids[:users]
    async with open_engine(path, config={"long_term": False}) as a:
        entries = [(i + 1, LogTurn(ids[i % users], "s", f"t_{i:020x}", "user", f"turn {i}", T0))
                   for i in range(turns)]
        await a.apply_log_batch(p, entries)
        data = await take(a, p, partitions, turns, "a")
        texts = {u: [t.text for t in await a.session_history(u, "s", limit=1000)] for u in ids}
    return data, ids, texts


async def test_a_snapshot_of_records_that_fail_the_checks_is_refused_and_writes_nothing(
        tmp_path: Path) -> None:
    """A snapshot whose bytes are not one, or whose records do not pass an import's checks
    (a session's turns with a gap, vectors of another user), is refused with InvalidInput
    naming the user; nothing is written and the watermark stays 0."""
    p = 0
    data, _, _ = await _snapshot_of(tmp_path / "a", 3, 30, p)
    snapshot = decode(data, p, 4)
    with pytest.raises(InvalidInput, match="snapshot: expected a partition snapshot"):
        decode(data[:len(data) // 2], p, 4)
    gap = msgspec.structs.replace(snapshot.users[1], turns=snapshot.users[1].turns[1:])
    swapped = [snapshot.vectors[0], snapshot.vectors[2], snapshot.vectors[1]]
    async with open_engine(tmp_path / "b", config={"long_term": False}) as b:
        with pytest.raises(InvalidInput, match=r"users\[1\]: session s: expected turns "
                                               "numbered 0, 1, 2"):
            await restore(b, msgspec.structs.replace(
                snapshot, users=[snapshot.users[0], gap, snapshot.users[2]]))
        with pytest.raises(InvalidInput, match=r"vectors\[1\]: expected the vectors of user"):
            await restore(b, msgspec.structs.replace(snapshot, vectors=swapped))
        assert await b.apply_log_batch(p, []) == 0
        assert await b.list_users() == [] and (await b.stats()).last_lsn == 0


async def test_recall_after_a_restore_says_its_legs_are_degraded_until_the_indexes_hold_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The text index and the vectors catch up after a restore returns (the writes go
    first): until they hold every restored record, recall names those legs in
    ``degraded``, as after an open that finds them behind; then it names none."""
    p = partition_of("ana", 4)
    async with open_engine(tmp_path / "a", config={"long_term": False}) as a:
        entries = [(i + 1, LogTurn("ana", "s", f"t_{i:020x}", "user", f"kestrel {i}", T0))
                   for i in range(40)]
        await a.apply_log_batch(p, entries)
        snapshot = decode(await take(a, p, 4, 40, "a"), p, 4)
    async with open_engine(tmp_path / "b", config={"long_term": False}) as b:
        with text_index_held(monkeypatch):
            await restore(b, snapshot)
            hits = await b.recall("ana", "kestrel")
            assert "bm25" in hits.degraded and "bm25" in (await b.stats()).degraded
        await b.flush()
        hits = await b.recall("ana", "kestrel")
        assert hits and hits.degraded == () and (await b.stats()).degraded == ()


async def test_log_entries_after_a_restore_apply_as_on_the_copy_it_was_taken_from(
        tmp_path: Path) -> None:
    """The restored copy goes on from the snapshot's watermark as the copy it was taken
    from does: the same next seqs, entries at or below the watermark skipped."""
    p = partition_of("ana", 4)
    first = [(i + 1, LogTurn("ana", "s", f"t_{i:020x}", "user", f"turn {i}", T0))
             for i in range(10)]
    later = [(i + 1, LogTurn("ana", "s", f"t_{i:020x}", "user", f"turn {i}", T0))
             for i in range(8, 14)]
    async with open_engine(tmp_path / "a", config={"long_term": False}) as a:
        await a.apply_log_batch(p, first)
        snapshot = decode(await take(a, p, 4, 10, "a"), p, 4)
        assert await a.apply_log_batch(p, later) == 14
        expected = await _memory(a, "ana")
    async with open_engine(tmp_path / "b", config={"long_term": False}) as b:
        await restore(b, snapshot)
        assert await b.apply_log_batch(p, later) == 14
        assert await _memory(b, "ana") == expected
        assert [t.seq for t in await b.session_history("ana", "s", limit=100)] == list(range(14))
    assert (await Engine.verify(tmp_path / "b"))["ok"]


async def test_a_restore_killed_midway_leaves_a_copy_the_next_owner_starts_over(
        tmp_path: Path) -> None:
    """A process restoring a snapshot dies by SIGKILL with some of its records committed:
    the partition's watermark is still 0, so the next owner drops what it left and restores
    again, ending with the snapshot's memory in a store that verifies."""
    p = 0
    users = [u for u in (f"user-{i}" for i in range(200)) if partition_of(u, 4) == p][:6]
    async with open_engine(tmp_path / "a", config={"long_term": False}) as a:
        entries = [(i + 1, LogTurn(users[i % len(users)], "s", f"t_{i:020x}", "user",
                                   f"turn {i}", T0)) for i in range(120)]
        await a.apply_log_batch(p, entries)
        data = await take(a, p, 4, 120, "a")
        expected = {u: await _memory(a, u) for u in users}
    (tmp_path / "snapshot").write_bytes(data)
    child = await trio.run_process(
        [sys.executable, "-m", "tests.cluster.restore_child", str(tmp_path / "snapshot"),
         str(tmp_path / "b"), str(p), "4"], cwd=ROOT, check=False)
    assert child.returncode == -signal.SIGKILL
    async with open_engine(tmp_path / "b", config={"long_term": False}) as b:
        assert await b.apply_log_batch(p, []) == 0
        assert 0 < (await b.stats()).last_lsn < len(entries), "killed before or after it"
        assert await drop_local(b, p, 4) > 0
        await restore(b, decode(data, p, 4))
        assert await b.apply_log_batch(p, []) == 120
        assert {u: await _memory(b, u) for u in users} == expected
    assert (await Engine.verify(tmp_path / "b"))["ok"]


async def test_a_new_owner_restores_the_newest_snapshot_and_the_old_copy_goes_after_grace(
        nats_servers, cluster_config, tmp_path: Path) -> None:
    """Node a owns both partitions and publishes their snapshots; node b joins, takes one,
    restores it and applies only the entries after its watermark, ending with a's memory;
    a deletes its copy of the partition it handed over once the grace period is past."""
    config = msgspec.structs.replace(cluster_config, partitions=2, snapshot_interval=0.5,
                                     grace=1.0)
    mine, moved = _users(2)
    log_a = await connect(nats_servers, config, "a")
    log_b = await connect(nats_servers, config, "b")
    try:
        async with open_engine(tmp_path / "a", config={"long_term": False}) as a, \
                open_engine(tmp_path / "b", config={"long_term": False}) as b:
            node_a = Node(a, log_a, "a", "http://127.0.0.1:1")
            writer = ClusterEngine(a, log_a, node_a)
            async with trio.open_nursery() as nursery:
                await nursery.start(node_a.run)
                await wait_for(lambda: node_a.owns(0) and node_a.owns(1), 30, "both held")
                for i in range(30):
                    await writer.add_turn(mine, "s", "user", f"mine {i}", durable=True)
                    last = await writer.add_turn(moved, "s", "user", f"moved {i}",
                                                 durable=True)
                await writer.store_note(moved, "keeps bees")
                mark = (await writer.add_turn(moved, "s", "user", "last before", durable=True)
                        ).log_seq
                await wait_for(lambda: node_a.partitions[1].snapshot_watermark >= mark, 60,
                               "the moved partition's snapshot")
                assert await log_a.snapshot_mark(1) >= mark
                tail = [await writer.add_turn(moved, "s", "user", f"after {i}", durable=True)
                        for i in range(5)]
                await wait_for(lambda: node_a.marks.get(1, 0) >= tail[-1].log_seq, 30,
                               "the tail applied on a")
                expected = await _memory(a, moved)

                node_b = Node(b, log_b, "b", "http://127.0.0.1:2")
                await nursery.start(node_b.run)
                await wait_for(lambda: node_b.owns(1) and node_b.marks.get(1, 0)
                               >= tail[-1].log_seq, 60, "b holding the moved partition")
                stats = {s.partition: s for s in node_b.stats().partitions}
                assert stats[1].bootstraps == 1 and stats[1].bootstrap_seconds is not None
                assert stats[1].entries <= len(tail)  # only the log after the snapshot
                assert await _memory(b, moved) == expected
                assert len(expected) > 30 and last.log_seq < mark

                await wait_for(lambda: node_a.partitions[1].dropped == 1, 60,
                               "a's copy of the moved partition deleted")
                assert 1 not in node_a.marks
                assert await a.apply_log_batch(1, []) == 0
                assert await a.list_sessions(moved) == []
                assert len(await a.session_history(mine, "s", limit=100)) == 30  # kept

                # A node that starts with a copy of a partition held elsewhere (it moved
                # while the node was down) deletes it after the grace period too.
                async with open_engine(tmp_path / "c", config={"long_term": False}) as c:
                    await c.apply_log_batch(1, [(1, LogTurn(moved, "s", "t_old", "user",
                                                            "stale", T0))])
                    node_c = Node(c, log_b, "c", "http://127.0.0.1:3")
                    await nursery.start(node_c.run)
                    await wait_for(lambda: node_c.partitions.get(1) is not None
                                   and node_c.partitions[1].dropped == 1, 60,
                                   "c's stale copy deleted")
                    assert not node_c.owns(1) and await c.list_users() == []
                    nursery.cancel_scope.cancel()
                nursery.cancel_scope.cancel()
    finally:
        await log_a.close()
        await log_b.close()


class HeldExtractor:
    """The LLM's place in the long-term layer, answering only once ``release`` is set (by the
    test): until then the layer, and so ``flush``, stays behind the log. It finds a parrot."""

    name = "held"

    def __init__(self) -> None:
        self.release = trio.Event()
        self.asked = 0

    async def extract(self, text: str) -> list:
        self.asked += 1
        await self.release.wait()
        if "parrot" not in text:
            return []
        return [Candidate("pet", "parrot", "Kiwi", "Has a parrot called Kiwi", 0.9, 0.6)]


async def test_a_snapshot_waits_for_a_lagging_long_term_layer_without_holding_the_partition(
        nats_servers, cluster_config, tmp_path: Path) -> None:
    """A snapshot is the memory at its watermark, derivations included, so it waits until the
    long-term layer has taken in what was applied. That wait must not hold the partition: its
    applies (and the reads waiting on them) go on, and the snapshot is taken once the layer
    has caught up, at the watermark of that moment, with what the layer derived."""
    config = msgspec.structs.replace(cluster_config, partitions=1, snapshot_interval=3600.0)
    extractor = HeldExtractor()
    async with one_node(nats_servers, config, tmp_path / "a", extractor=extractor) as (
            a, node, writer, log):
        flushing = trio.Event()  # set once the snapshot waits for the layer
        flush = a.flush

        async def watched_flush() -> None:
            flushing.set()
            await flush()

        a.flush = watched_flush
        first = await writer.add_turn("ana", "s", "user", "I live in Lisbon.", durable=True)
        await wait_for(lambda: extractor.asked > 0, 30, "the layer held by its extractor")
        taken: list[int | None] = []

        async def snapshot() -> None:
            taken.append(await node.snapshot(0))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(snapshot)
            await flushing.wait()
            second = await writer.add_turn("ana", "s", "user", "Kiwi is my parrot.",
                                           durable=True)
            assert await node.wait_applied(0, second.log_seq, 10), \
                "an apply waited for the snapshot's wait on the long-term layer"
            assert not taken and first.log_seq < second.log_seq
            extractor.release.set()
        assert taken == [second.log_seq]
        mark, data = await log.get_snapshot(0)
        assert mark == second.log_seq
        (records,) = decode(data, 0, 1).users
        assert records.user_id == "ana" and [f.value for f in records.facts] == ["Kiwi"]


async def test_a_snapshot_compresses_without_holding_the_partition(
        nats_servers, cluster_config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compressing a partition's snapshot (about a second for 100k turns, in a worker thread)
    ran under the partition's guard, so its applies, and the reads waiting on them, waited
    for it. The records are read under the guard; they are compressed after it."""
    config = msgspec.structs.replace(cluster_config, partitions=1, snapshot_interval=3600.0)
    packing, unpack = threading.Event(), threading.Event()
    pack = _bootstrap._pack

    def held_pack(snapshot):
        packing.set()
        unpack.wait(30)
        return pack(snapshot)

    monkeypatch.setattr(_bootstrap, "_pack", held_pack)
    async with one_node(nats_servers, config, tmp_path / "a") as (a, node, writer, log):
        first = await writer.add_turn("ana", "s", "user", "I live in Lisbon.", durable=True)
        await node.wait_applied(0, first.log_seq, 10)
        taken: list[int | None] = []

        async def snapshot() -> None:
            taken.append(await node.snapshot(0))

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(snapshot)
                await wait_for(packing.is_set, 30, "the snapshot compressing")
                second = await writer.add_turn("ana", "s", "user", "Kiwi is my parrot.",
                                               durable=True)
                assert await node.wait_applied(0, second.log_seq, 10), \
                    "an apply waited for the snapshot's compression"
                unpack.set()
        finally:
            unpack.set()
        assert taken == [first.log_seq]
        mark, data = await log.get_snapshot(0)
        assert mark == first.log_seq
        (records,) = decode(data, 0, 1).users
        assert [t.text for t in records.turns] == ["I live in Lisbon."]


async def test_a_record_the_store_refused_does_not_stop_a_snapshot(
        nats_servers, cluster_config, tmp_path: Path) -> None:
    """A snapshot's flush raises a record the store refused (an op behind the facade's checks
    that LMDB cannot hold): the record is kept among the failures, and the snapshot is taken
    all the same; before, the error left the snapshot task and ended the node."""
    config = msgspec.structs.replace(cluster_config, partitions=1, snapshot_interval=3600.0)
    async with one_node(nats_servers, config, tmp_path / "a", config={"long_term": False}) as (
            a, node, writer, log):
        last = await writer.add_turn("ana", "s", "user", "hello", durable=True)
        assert await node.wait_applied(0, last.log_seq, 10)
        store = a._store
        bad = store.next_lsn
        store.submit(PutNote(bad, Note(bad, "n" * 600, "ana", "refused", (), T0, T0), -1))
        assert await node.snapshot(0) == last.log_seq
        assert [f.lsn for f in await a.failures()] == [bad]
        assert await log.snapshot_mark(0) == last.log_seq


async def test_a_copy_whose_next_entries_aged_out_of_the_log_restores_the_newer_snapshot(
        nats_servers, cluster_config, tmp_path: Path) -> None:
    """A node back after longer than the stream's max_age resumes its copy of a partition
    from its watermark, but the entries after it are gone from the log: it must restore the
    newer snapshot the partition's later owner left, not go on without what those entries
    held (acknowledged turns missing from every read it answers)."""
    from engine._logbatch import encode_entry
    from engine.cluster._partition import subject_of
    from engine.cluster._writes import LogWriter
    from actors.base.config import Config

    config = msgspec.structs.replace(cluster_config, partitions=1, snapshot_interval=0.5,
                                     max_age=1.5, duplicate_window=1.0,
                                     publish_retry_seconds=0.5)
    store = tmp_path / "a"
    log = await connect(nats_servers, config, "w")
    try:
        writer = LogWriter(log, Config())
        turns = [writer._turn("", "ana", "s", "user", text, None, None)
                 for text in ("first", "second")]

        async def publish(turn: LogTurn) -> int:
            return (await log.publish(subject_of("ana", 1), encode_entry(turn),
                                      turn.turn_id))[0]

        with trio.fail_after(60):
            async with one_node(nats_servers, config, store,
                                config={"long_term": False}) as (_, node, _w, _l):
                first = await publish(turns[0])
                await wait_for(lambda: node.marks.get(0, 0) >= first, 20, "first applied")
            # While the node is down: the partition's next owner applies the second turn
            # and leaves a snapshot at it; then both entries age out of the log.
            second = await publish(turns[1])
            async with open_engine(tmp_path / "b", config={"long_term": False}) as b:
                await b.apply_log_batch(0, [(first, turns[0]), (second, turns[1])])
                await log.put_snapshot(0, second, await take(b, 0, 1, second, "b"))

            async def first_seq() -> int:
                info = await log.thread.run(log._client.js.stream_info, config.stream)
                return info.state.first_seq

            while await first_seq() <= second:
                await trio.sleep(0.1)
            async with one_node(nats_servers, config, store,
                                config={"long_term": False}) as (engine, node, _w, _l):
                await wait_for(lambda: node.marks.get(0, 0) >= second, 20,
                               "the copy brought to the snapshot")
                history = await engine.session_history("ana", "s")
                assert [t.text for t in history] == ["first", "second"]
    finally:
        await log.close()


async def _two_turns_and_their_snapshot(log, tmp_path: Path) -> tuple[list[int], bytes]:
    """ana's turns "first" and "second" published to partition 0 of 1; their stream
    sequences, and a snapshot of a store that applied them."""
    from engine._logbatch import encode_entry
    from engine.cluster._partition import subject_of
    from engine.cluster._writes import LogWriter
    from actors.base.config import Config

    writer = LogWriter(log, Config())
    turns = [writer._turn("", "ana", "s", "user", text, None, None)
             for text in ("first", "second")]
    seqs = [(await log.publish(subject_of("ana", 1), encode_entry(turn), turn.turn_id))[0]
            for turn in turns]
    async with open_engine(tmp_path / "b", config={"long_term": False}) as b:
        await b.apply_log_batch(0, list(zip(seqs, turns)))
        return seqs, await take(b, 0, 1, seqs[-1], "b")


async def _a_damaged_snapshot_is_refused(nats_servers, cluster_config, tmp_path: Path,
                                         damage) -> None:
    """Two turns in the log and a snapshot of them, which ``await damage(log, config, data,
    mark)`` stores damaged: a new owner refuses it, counts it, and replays the whole log
    instead of ending the node or waiting for ever."""
    config = msgspec.structs.replace(cluster_config, partitions=1, snapshot_interval=3600.0)
    log = await connect(nats_servers, config, "w")
    try:
        seqs, data = await _two_turns_and_their_snapshot(log, tmp_path)
        await damage(log, config, data, seqs[-1])
        with trio.fail_after(60):
            async with one_node(nats_servers, config, tmp_path / "a",
                                config={"long_term": False}) as (engine, node, _w, _l):
                await wait_for(lambda: node.marks.get(0, 0) >= seqs[-1], 20,
                               "the whole log replayed")
                history = await engine.session_history("ana", "s")
                assert [t.text for t in history] == ["first", "second"]
                assert node.partitions[0].bootstraps == 0
                assert node.partitions[0].snapshots_refused == 1
    finally:
        await log.close()


async def test_a_snapshot_whose_records_fail_the_checks_is_refused_and_the_log_replayed(
        nats_servers, cluster_config, tmp_path: Path) -> None:
    """A new owner given a snapshot that decodes but whose records do not pass an import's
    checks (here a session's first turn missing) refuses it, as one that does not decode,
    and replays the whole log instead of ending the node."""

    async def first_turn_missing(log, config, data: bytes, mark: int) -> None:
        snapshot = decode(data, 0, 1)
        (records,) = snapshot.users
        damaged = msgspec.structs.replace(
            snapshot, users=[msgspec.structs.replace(records, turns=records.turns[1:])])
        await log.put_snapshot(0, mark, _bootstrap._pack(damaged))

    await _a_damaged_snapshot_is_refused(nats_servers, cluster_config, tmp_path,
                                         first_turn_missing)


async def _stored_with_chunks_replaced(log, config, data: bytes, mark: int) -> None:
    """Store ``data`` as partition 0's snapshot, then replace its chunks by as many others
    (the object's digest no longer matches: damaged in the object store)."""
    from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE, OBJ_STREAM_TEMPLATE

    from engine.cluster._log import _snapshot_name

    await log.put_snapshot(0, mark, data)
    client = log._client

    async def damage() -> None:
        info = await client.objects.get_info(_snapshot_name(0))
        subject = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=config.objects, obj=info.nuid)
        await client.js.purge_stream(OBJ_STREAM_TEMPLATE.format(bucket=config.objects),
                                     subject=subject)
        for _ in range(info.chunks):
            await client.js.publish(subject, b"damaged")

    await log.thread.run(damage)


async def test_a_snapshot_that_fails_its_digest_is_refused_and_the_log_replayed(
        nats_servers, cluster_config, tmp_path: Path) -> None:
    """A snapshot object whose chunks no longer match its digest (damaged in the object
    store) was asked for again every second for ever, as if the log were unreachable, and
    the partition never served; it is refused as one that does not decode is, and the whole
    log replayed."""
    await _a_damaged_snapshot_is_refused(nats_servers, cluster_config, tmp_path,
                                         _stored_with_chunks_replaced)


async def test_a_refused_snapshot_is_not_replaced_by_a_log_missing_its_first_entries(
        nats_servers, cluster_config, tmp_path: Path, monkeypatch) -> None:
    """Refused, a snapshot was replaced by the whole log replayed even when the log no
    longer held its first entries (aged out): the new owner served a copy without them,
    and its next snapshot would have spread the loss. The partition now waits, unserved and
    counted, and restores the first snapshot that restores."""
    from engine.cluster import _node
    from engine.cluster._partition import subject_of

    monkeypatch.setattr(_node, "UNRESTORABLE_RETRY_SECONDS", 0.5)
    config = msgspec.structs.replace(cluster_config, partitions=1, snapshot_interval=3600.0)
    log = await connect(nats_servers, config, "w")
    try:
        seqs, data = await _two_turns_and_their_snapshot(log, tmp_path)
        await log.purge(subject_of("ana", 1), seqs[1])  # the first turn aged out
        assert await log.first_seq() == seqs[1]
        await _stored_with_chunks_replaced(log, config, data, seqs[-1])
        with trio.fail_after(60):
            async with one_node(nats_servers, config, tmp_path / "a",
                                config={"long_term": False}) as (engine, node, _w, _l):
                await wait_for(lambda: node.partitions.get(0) is not None
                               and node.partitions[0].snapshots_refused >= 2, 20,
                               "the snapshot refused, and asked for again")
                assert node.marks.get(0, 0) == 0
                assert await engine.session_history("ana", "s") == []
                await log.put_snapshot(0, seqs[-1], data)
                await wait_for(lambda: node.marks.get(0, 0) >= seqs[-1], 20,
                               "the good snapshot restored")
                history = await engine.session_history("ana", "s")
                assert [t.text for t in history] == ["first", "second"]
                assert node.partitions[0].bootstraps == 1
    finally:
        await log.close()


async def test_a_snapshot_of_many_chunks_comes_back_whole_and_leaves_no_consumer(
        nats_servers, cluster_config) -> None:
    """A snapshot larger than one object chunk (128 KiB) is read back byte for byte, checked
    against its digest, through a consumer that is gone afterwards; a partition with no
    snapshot has none."""
    config = msgspec.structs.replace(cluster_config, partitions=2)
    log = await connect(nats_servers, config, "r")
    try:
        data = random.Random(5).randbytes(700_000)
        await log.put_snapshot(1, 42, data)
        assert await log.get_snapshot(1) == (42, data)
        assert await log.get_snapshot(0) is None
        stream = f"OBJ_{config.objects}"
        consumers = await log.thread.run(
            lambda: log._client.js.consumers_info(stream))
        assert consumers == []
    finally:
        await log.close()


async def test_a_snapshot_in_frames_is_restored_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A snapshot is stored as frames of users, each compressed alone; a new owner decodes
    them in worker threads, then restores them as one: the copy holds what the source held.
    A damaged frame is refused as no snapshot, and nothing is written."""
    monkeypatch.setattr(_bootstrap, "FRAME_BYTES", 1)  # a frame a user
    p = 0
    data, users, before = await _snapshot_of(tmp_path / "a", 3, 30, p)
    found = opened(data, p, 4)
    assert isinstance(found, Framed) and len(found.frames) == 3 and found.head.users == 3
    async with open_engine(tmp_path / "b", config={"long_term": False}) as b:
        await restore(b, found)
        assert {u: [t.text for t in await b.session_history(u, "s", limit=1000)]
                for u in users} == before
        assert await b.apply_log_batch(p, []) == 30
    ends = np.cumsum([len(frame) for frame in found.frames]) + (len(data) - len(
        b"".join(found.frames)))
    for bad in ([ends[-1] - 5], [ends[0] - 5, ends[1] - 5, ends[2] - 5]):  # one frame, three
        damaged = bytearray(data)
        for at in bad:
            damaged[at] ^= 0xFF
        async with open_engine(tmp_path / f"c{len(bad)}", config={"long_term": False}) as c:
            with pytest.raises(InvalidInput, match="snapshot: expected a partition snapshot"):
                await restore(c, opened(bytes(damaged), p, 4))
            assert await c.apply_log_batch(p, []) == 0
            assert await c.list_users() == [] and (await c.stats()).last_lsn == 0


async def test_a_snapshot_of_the_single_stream_format_still_restores(tmp_path: Path) -> None:
    """A snapshot stored before frames (``engram-partition-snapshot-2``: one zlib stream of
    every user's records) restores as it did."""
    p = 0
    data, users, before = await _snapshot_of(tmp_path / "a", 2, 10, p)
    records = decode(data, p, 4)
    old = zlib.compress(_bootstrap._encode(records), 1)
    found = opened(old, p, 4)
    assert isinstance(found, PartitionRecords) and not old.startswith(_bootstrap.MAGIC)
    async with open_engine(tmp_path / "b", config={"long_term": False}) as b:
        await restore(b, found)
        assert {u: [t.text for t in await b.session_history(u, "s", limit=1000)]
                for u in users} == before
        assert await b.apply_log_batch(p, []) == 10
