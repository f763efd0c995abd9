"""The applier in one process against the real log: ordered apply, lost deliveries re-read."""

from __future__ import annotations

from datetime import date, datetime
from functools import partial
from pathlib import Path

import msgspec
import pytest
import trio

from engine import InvalidInput
from engine.cluster._log import Log
from engine.cluster._node import Node
from engine.cluster._partition import partition_of
from engine.cluster._writes import ClusterEngine, NotInCluster

from ..conftest import open_engine
from .conftest import connect, one_node, wait_for

pytestmark = pytest.mark.timeout(120)


class DroppingLog:
    """The real log, except that the first consumer's second delivery is lost on its way to
    the node (the consumer sequence then jumps at the third)."""

    def __init__(self, log: Log) -> None:
        self._log = log
        self.dropped: list[int] = []

    def __getattr__(self, name: str):
        return getattr(self._log, name)

    async def fetch(self, sub, batch: int, timeout: float):
        got = await self._log.fetch(sub, batch, timeout)
        lost = [d for d in got if d.consumer_seq == 2]
        if not self.dropped and lost:
            self.dropped.append(lost[0].stream_seq)
            return [d for d in got if d is not lost[0]]
        return got


async def test_a_lost_delivery_is_re_read_from_the_watermark_never_skipped(
        nats_servers, cluster_config, tmp_path: Path) -> None:
    """A consumer-sequence gap is counted and the consumer recreated at watermark + 1, so
    every entry lands once and in order."""
    config = msgspec.structs.replace(cluster_config, partitions=1)
    log = await connect(nats_servers, config)
    try:
        async with open_engine(tmp_path / "store", config={"long_term": False}) as engine:
            writer = ClusterEngine(engine, log)
            receipts = [await writer.add_turn("ana", "s1", "user", f"turn {i}", durable=True)
                        for i in range(10)]
            dropping = DroppingLog(log)
            node = Node(engine, dropping, "n1", "http://127.0.0.1:1")
            async with trio.open_nursery() as nursery:
                await nursery.start(node.run)
                await wait_for(lambda: node.marks.get(0, 0) >= receipts[-1].log_seq, 30,
                               "the partition applied")
                nursery.cancel_scope.cancel()
            assert dropping.dropped and node.counts["gaps"] == 1
            stats = node.stats()
            [part] = stats.partitions
            assert (part.partition, part.owned, part.gaps, part.watermark) == (
                0, False, 1, receipts[-1].log_seq)  # cancelled: no longer served
            assert part.consumers == 2 and part.entries >= 10 and part.batches >= 2
            assert stats.owned == [] and stats.leases["claimed"] == 1
            turns = await engine.session_history("ana", "s1", limit=100)
            assert [t.turn_id for t in turns] == [r.turn_id for r in receipts]
            assert [t.seq for t in turns] == list(range(10))
    finally:
        await log.close()


async def test_two_stores_that_applied_the_same_log_hold_the_same_memory(
        nats_servers, cluster_config, tmp_path: Path) -> None:
    """Same log, same sessions, seqs and answers: a new owner replays to what the old held."""
    config = msgspec.structs.replace(cluster_config, partitions=2)
    log = await connect(nats_servers, config)
    try:
        async with open_engine(tmp_path / "a", config={"long_term": False}) as a:
            writer = ClusterEngine(a, log)
            lasts: dict[int, int] = {}  # partition -> its last entry's log_seq
            for i in range(20):
                user = ("ana", "bo", "cy")[i % 3]
                receipt = await writer.add_turn(user, f"s{i % 2}", "user",
                                                f"{user} likes topic {i}", durable=True)
                lasts[partition_of(user, 2)] = receipt.log_seq
            await writer.forget_session("bo", "s1")
            receipt = await writer.add_turn("bo", "s0", "user", "the end", durable=True)
            lasts[partition_of("bo", 2)] = receipt.log_seq
            answers = []
            for path in (tmp_path / "a-store", tmp_path / "b-store"):
                async with open_engine(path, config={"long_term": False}) as engine:
                    node = Node(engine, log, path.name, "http://127.0.0.1:1")
                    async with trio.open_nursery() as nursery:
                        await nursery.start(node.run)
                        await wait_for(lambda: all(node.marks.get(p, 0) >= seq
                                                   for p, seq in lasts.items()),
                                       30, "both partitions applied")
                        nursery.cancel_scope.cancel()
                    await engine.flush()
                    answers.append([
                        [(s.session_id, s.turn_count) for s in await engine.list_sessions(u)]
                        + [(t.turn_id, t.seq, t.text)
                           for s in ("s0", "s1")
                           for t in await engine.session_history(u, s, limit=100)]
                        + [(h.id, round(h.score, 6)) for h in await engine.recall(u, "topic")]
                        for u in ("ana", "bo", "cy")])
            assert answers[0] == answers[1]
            assert all(answers[0])
    finally:
        await log.close()


async def test_notes_facts_links_and_summaries_go_through_the_log_and_replay_the_same(
        nats_servers, cluster_config, tmp_path: Path) -> None:
    """Every caller's write is a log entry applied by the owner: its answer comes from that
    apply, and a second store replaying the same log ends with the same memory."""
    from engine import InvalidInput

    config = msgspec.structs.replace(cluster_config, partitions=1)
    log = await connect(nats_servers, config)
    try:
        async with open_engine(tmp_path / "a", config={"long_term": False}) as a:
            node = Node(a, log, "a", "http://127.0.0.1:1")
            writer = ClusterEngine(a, log, node)
            async with trio.open_nursery() as nursery:
                await nursery.start(node.run)
                await wait_for(lambda: node.owns(0), 30, "the partition held")
                turn = await writer.add_turn("ana", "s1", "user", "I adopted a cat called Miso",
                                             durable=True)
                note = await writer.store_note("ana", "prefers short answers", tags=["style"])
                assert note.note_id.startswith("n_") and note.tags == ("style",)
                await writer.update_note("ana", note.note_id, "prefers very short answers")
                fact = await writer.remember_fact("ana", "pets", "cat", "Miso",
                                                  text="Has a cat called Miso")
                await writer.correct_fact("ana", "pets", "cat", "Mochi")
                await writer.confirm_fact("ana", "pets", "cat")
                await wait_for(lambda: node.marks.get(0, 0) >= turn.log_seq, 30, "the turn")
                link = await writer.link("ana", turn.turn_id, note.note_id, "about")
                assert link.to_id == note.note_id
                gone = await writer.store_note("ana", "to be deleted")
                assert await writer.delete_note("ana", gone.note_id) is True
                with pytest.raises(InvalidInput):
                    await writer.review("ana", note.note_id, "superb")
                # A time without a zone is refused before it is logged, saying so.
                logged = await log.last_seq()
                for call in (partial(writer.remember_fact, "ana", "pets", "dog", "Rex"),
                             partial(writer.correct_fact, "ana", "pets", "cat", "Rex")):
                    with pytest.raises(InvalidInput, match="valid_at: expected a timezone-aware "
                                                           "datetime, found a naive"):
                        await call(valid_at=datetime(2026, 5, 1))
                    with pytest.raises(InvalidInput, match="valid_at: expected a timezone-aware "
                                                           "datetime, found date"):
                        await call(valid_at=date(2026, 5, 1))
                assert await log.last_seq() == logged
                assert fact.value == "Miso"
                told = await writer.call_tool("store_note", {"user_id": "ana",
                                                             "text": "allergic to peanuts"})
                found = await writer.call_tool("search_memory", {"user_id": "ana",
                                                                 "query": "peanuts"})
                assert told["note"]["note_id"] in [h["id"] for h in found["results"]]
                nursery.cancel_scope.cancel()
            first = await _memory_of(a)
        async with open_engine(tmp_path / "b", config={"long_term": False}) as b:
            await _replay(b, log)
            assert await _memory_of(b) == first
        assert first["notes"] == [("prefers very short answers", ())]  # update set no tags
        assert first["profile"] == [("pets", "cat", "Mochi")]
    finally:
        await log.close()


async def _replay(engine, log: Log) -> None:
    """Run a node of the one-partition log on ``engine`` until it has applied the whole log."""
    node = Node(engine, log, "b", "http://127.0.0.1:1")
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        last = await log.last_seq()
        await wait_for(lambda: node.marks.get(0, 0) >= last, 30, "the replay")
        nursery.cancel_scope.cancel()


async def _memory_of(engine) -> dict:
    notes = [n for n in await engine.recall("ana", "answers", kinds=["note"])]
    return {
        "notes": [((await engine.get_note("ana", h.id)).text,
                   (await engine.get_note("ana", h.id)).tags) for h in notes],
        "profile": [(f.category, f.key, f.value) for f in await engine.profile("ana")],
        "history": [(f.value, f.status) for f in await engine.fact_history("ana", "pets", "cat")],
        "links": [(l.from_id, l.to_id, l.type) for h in await engine.session_history("ana", "s1")
                  for l in await engine.links("ana", h.turn_id)],
        "turns": [(t.turn_id, t.seq) for t in await engine.session_history("ana", "s1")],
    }


async def test_buffered_writes_go_out_pipelined_in_order_and_all_resolve(
        nats_servers, cluster_config, tmp_path: Path) -> None:
    """add_turn without durable returns at once; every receipt's durable() then resolves
    with a log_seq, in call order, and the owner applies them in that order."""
    config = msgspec.structs.replace(cluster_config, partitions=1)
    log = await connect(nats_servers, config)
    try:
        async with open_engine(tmp_path / "store", config={"long_term": False}) as engine:
            writer = ClusterEngine(engine, log)
            receipts = [await writer.add_turn("ana", "s1", "user", f"buffered {i}")
                        for i in range(300)]
            assert all(r.log_seq is None for r in receipts[:1])
            for receipt in receipts:
                await receipt.durable()
            seqs = [r.log_seq for r in receipts]
            assert seqs == sorted(seqs) and len(set(seqs)) == 300
            node = Node(engine, log, "n1", "http://127.0.0.1:1")
            async with trio.open_nursery() as nursery:
                await nursery.start(node.run)
                await wait_for(lambda: node.marks.get(0, 0) >= seqs[-1], 30, "applied")
                nursery.cancel_scope.cancel()
            turns = await engine.session_history("ana", "s1", limit=1000)
            assert [t.turn_id for t in turns] == [r.turn_id for r in receipts]
    finally:
        await log.close()


async def test_a_buffered_publish_whose_puback_is_lost_is_retried_under_its_id(
        nats_servers, cluster_config, tmp_path: Path) -> None:
    """The log stores a buffered turn but its PubAck never arrives: the publish is sent
    again with the same id, the stream keeps one copy, and the receipt resolves with the
    first copy's sequence like every other."""
    import asyncio

    import nats.errors

    config = msgspec.structs.replace(cluster_config, partitions=1)
    log = await connect(nats_servers, config)
    lost: list[str] = []
    js = log._client.js
    real = js.publish_async

    async def losing_one_ack(subject, payload, **kwargs):
        ack = await real(subject, payload, **kwargs)
        if lost:
            return ack
        lost.append(kwargs["headers"]["Nats-Msg-Id"])
        await ack  # stored on a quorum; only the answer goes missing
        missing = asyncio.get_running_loop().create_future()
        missing.set_exception(nats.errors.TimeoutError())
        return missing

    js.publish_async = losing_one_ack
    try:
        async with open_engine(tmp_path / "store", config={"long_term": False}) as engine:
            writer = ClusterEngine(engine, log)
            receipts = [await writer.add_turn("ana", "s1", "user", f"buffered {i}")
                        for i in range(50)]
            for receipt in receipts:
                await receipt.durable()
            assert lost and log.retries >= 1
            seqs = [r.log_seq for r in receipts]
            assert seqs == sorted(seqs) and len(set(seqs)) == 50
            assert await log.last_seq() == seqs[-1] == 50  # one copy each
    finally:
        await log.close()


async def test_a_nodes_snapshot_is_its_store_and_a_node_restored_from_it_resumes_there(
        nats_servers, cluster_config, tmp_path: Path) -> None:
    """``snapshot`` on a node writes its local store (the partitions it applied, each with
    its watermark, committed together); a node opened on that snapshot, restored, holds
    what was applied before it and replays only the log after its watermarks."""
    from engine import Engine

    config = msgspec.structs.replace(cluster_config, partitions=1)
    log = await connect(nats_servers, config)
    try:
        async with open_engine(tmp_path / "a", config={"long_term": False}) as a:
            node = Node(a, log, "a", "http://127.0.0.1:1")
            writer = ClusterEngine(a, log, node)
            async with trio.open_nursery() as nursery:
                await nursery.start(node.run)
                before = [await writer.add_turn("ana", "s", "user", f"before {i}", durable=True)
                          for i in range(5)]
                await wait_for(lambda: node.marks.get(0, 0) >= before[-1].log_seq, 30,
                               "applied before the snapshot")
                manifest = await writer.snapshot(tmp_path / "snap")
                after = [await writer.add_turn("ana", "s", "user", f"after {i}", durable=True)
                         for i in range(3)]
                await node.leases.release_all()
                nursery.cancel_scope.cancel()
        assert manifest.counts["turns"] == 5
        await Engine.restore(tmp_path / "snap", tmp_path / "b")
        async with open_engine(tmp_path / "b", config={"long_term": False}) as b:
            assert await b.apply_log_batch(0, []) == before[-1].log_seq
            node = Node(b, log, "b", "http://127.0.0.1:2")
            async with trio.open_nursery() as nursery:
                await nursery.start(node.run)
                await wait_for(lambda: node.marks.get(0, 0) >= after[-1].log_seq, 60,
                               "the log after the snapshot applied")
                nursery.cancel_scope.cancel()
            assert node.partitions[0].entries == len(after)  # the tail only
            history = await b.session_history("ana", "s", limit=100)
            assert [t.turn_id for t in history] == [r.turn_id for r in before + after]
            assert [t.seq for t in history] == list(range(8))
    finally:
        await log.close()


async def test_scopes_go_through_the_log_and_a_node_holds_what_one_engine_holds(
        nats_servers, cluster_config, tmp_path: Path) -> None:
    """A scoped turn written via one node (which only publishes) is recalled with the scope
    filter via another, the partition's owner; a scoped note and forget_scope go through the
    log (the tombstone applied in log order, its counts returned to the owner's caller); the
    owner's store, a store replaying the same log, and a single-process engine given the same
    calls hold the same memory."""
    from engine import NewTurn

    config = msgspec.structs.replace(cluster_config, partitions=1)
    log = await connect(nats_servers, config)
    turns = [("s1", "I walk the dog in Lisbon", "bot", "r1"),
             ("s2", "my dog is called Pixel", "bot", "r2"),
             ("s1", "the dog likes the beach", None, None),
             ("s3", "the dog barks at night", None, None)]
    try:
        async with open_engine(tmp_path / "w", config={"long_term": False}) as w, \
                open_engine(tmp_path / "a", config={"long_term": False}) as a:
            writer = ClusterEngine(w, log)  # a node that holds no partition: it publishes
            node = Node(a, log, "a", "http://127.0.0.1:1")
            owner = ClusterEngine(a, log, node)
            async with trio.open_nursery() as nursery:
                await nursery.start(node.run)
                await wait_for(lambda: node.owns(0), 30, "the partition held")
                first = turns[0]
                await writer.add_turn("ana", first[0], "user", first[1], agent_id=first[2],
                                      run_id=first[3], durable=True)
                receipts = await writer.add_turns(
                    [NewTurn(user_id="ana", session_id=s, role="user", text=t, agent_id=ag,
                             run_id=run) for s, t, ag, run in turns[1:]], durable=True)
                note = await owner.store_note("ana", "walks the dog at seven", agent_id="bot",
                                              run_id="r1")
                assert (note.agent_id, note.run_id) == ("bot", "r1")
                await wait_for(lambda: node.marks.get(0, 0) >= receipts[-1].log_seq, 30,
                               "the turns applied")
                await a.flush()
                found = {h.text for h in await owner.recall("ana", "dog", run_id="r1")}
                assert found == {turns[0][1], turns[2][1], note.text}
                before = await _scoped_memory(a)
                assert await owner.forget_scope("ana", run_id="r1") == {"sessions": 1,
                                                                        "notes": 1}
                with pytest.raises(InvalidInput, match="agent_id or run_id"):
                    await writer.forget_scope("ana")
                nursery.cancel_scope.cancel()
            applied = await _scoped_memory(a)
        async with open_engine(tmp_path / "single", config={"long_term": False}) as single:
            for s, t, ag, run in turns:
                await single.add_turn("ana", s, "user", t, agent_id=ag, run_id=run)
            await single.store_note("ana", "walks the dog at seven", agent_id="bot", run_id="r1")
            await single.flush()
            assert await _scoped_memory(single) == before
            await single.forget_scope("ana", run_id="r1")
            assert await _scoped_memory(single) == applied
        async with open_engine(tmp_path / "b", config={"long_term": False}) as b:
            await _replay(b, log)
            await b.flush()
            assert await _scoped_memory(b) == applied
        assert applied["sessions"] == [("s2", "bot", "r2", 1), ("s3", "", "", 1)]
    finally:
        await log.close()


async def _scoped_memory(engine) -> dict:
    """What a user's scopes hold, by text (ids are made by whoever wrote them)."""
    sessions = sorted((s.session_id, s.agent_id, s.run_id, s.turn_count)
                      for s in await engine.list_sessions("ana"))
    return {
        "sessions": sessions,
        "turns": [t.text for s, *_ in sessions for t in await engine.session_history("ana", s)],
        "notes": sorted((n.text, n.agent_id, n.run_id) for n in await engine.list_notes("ana")),
        "r1": sorted(h.text for h in await engine.recall("ana", "dog", run_id="r1")),
        "bot": sorted(h.text for h in await engine.recall("ana", "dog", agent_id="bot")),
    }


async def test_writes_the_log_does_not_carry_are_refused_on_a_node(
        nats_servers, cluster_config, tmp_path: Path) -> None:
    """A write that would reach only this node's store (no log entry) is refused with
    NotInCluster, naming what to use instead: the partition's next owner would not have it."""
    log = await connect(nats_servers, cluster_config)
    try:
        async with open_engine(tmp_path / "store", config={"long_term": False}) as engine:
            source = tmp_path / "ana.jsonl"
            await engine.add_turn("ana", "s1", "user", "I moved to Lisbon")
            await engine.export_user("ana", source)
            await engine.forget_user("ana")
            writer = ClusterEngine(engine, log)
            with pytest.raises(NotInCluster, match="add_turn_nowait.*add_turn"):
                writer.add_turn_nowait("ana", "s1", "user", "hello")
            with pytest.raises(NotInCluster, match="import_user"):
                await writer.import_user(source)
            with pytest.raises(NotInCluster, match="import_users"):
                await writer.import_users([source])
            records, _ = await engine.export_records("ana")
            with pytest.raises(NotInCluster, match="restore_users"):
                await writer.restore_users([records], [None])
            # The applier's own entry points: a caller moving a watermark or applying entries
            # itself would make this copy skip or repeat the log.
            with pytest.raises(NotInCluster, match="set_log_watermark"):
                await writer.set_log_watermark(0, 7)
            with pytest.raises(NotInCluster, match="apply_log_batch"):
                await writer.apply_log_batch(0, [])
            assert await engine.apply_log_batch(0, []) == 0  # the watermark did not move
            assert await engine.list_users() == []  # nothing reached the store
            assert await engine.session_history("ana", "s1", limit=10) == []
    finally:
        await log.close()


async def test_an_entry_filed_under_another_partition_is_skipped_not_stored(
        nats_servers, cluster_config, tmp_path: Path) -> None:
    """An entry under partition p's subjects whose user belongs to another partition (a raw
    publisher, a writer with another count) is skipped and counted: stored, it would sit in
    partition p's copy where no forget of the user (published to the user's own partition)
    and no hand-over of p (which drops p's users) ever reaches it."""
    from engine._logbatch import encode_entry
    from engine.cluster._partition import SUBJECT_ROOT, partition_of, user_digest

    config = msgspec.structs.replace(cluster_config, partitions=2)
    async with one_node(nats_servers, config, tmp_path / "store",
                        config={"long_term": False}) as (engine, node, writer, log):
        home = partition_of("ana", 2)
        wrong = f"{SUBJECT_ROOT}.{1 - home}.{user_digest('ana')}"
        turn = writer._turn("", "ana", "s1", "user", "misfiled", None, None)
        await log.publish(wrong, encode_entry(turn), turn.turn_id)
        other = next(u for u in ("bo", "cy", "di", "ed") if partition_of(u, 2) != home)
        after = await writer.add_turn(other, "s1", "user", "filed right", durable=True)
        await wait_for(lambda: node.marks.get(1 - home, 0) >= after.log_seq, 30,
                       "the other partition applied")
        assert node.counts["undecodable"] == 1
        assert [t.text for t in await engine.session_history(other, "s1")] == ["filed right"]
        assert await engine.session_history("ana", "s1") == []
