"""What a read records (a pending review, a use of the facts shown) goes through the log in a
cluster, so a node that replays the log ends with the owner's memory (issue 18)."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import msgspec
import pytest
import trio

from actors.store import read_pending
from engine import InvalidInput
from engine._logbatch import CALLS, LogCall, LogTurn
from engine.cluster._log import Log
from engine.cluster._node import Node
from engine.cluster._writes import ClusterEngine

from ..conftest import open_engine
from .conftest import connect, log_applied, log_grown, wait_for

pytestmark = pytest.mark.timeout(120)



async def test_a_read_on_the_owner_records_what_a_replaying_node_records_too(
        nats_servers, cluster_config, tmp_path: Path) -> None:
    """retrieve_memory, context_pre_retrieve and context_for_prompt on the owner record their
    pending review and fact uses as log entries: the owner counts each once, and a store replaying the log holds
    the same pending reviews and access counts."""
    config = msgspec.structs.replace(cluster_config, partitions=1)
    log = await connect(nats_servers, config)
    try:
        async with open_engine(tmp_path / "a", config={"long_term": False}) as a:
            node = Node(a, log, "a", "http://127.0.0.1:1")
            owner = ClusterEngine(a, log, node)
            async with trio.open_nursery() as nursery:
                await nursery.start(node.run)
                await wait_for(lambda: node.owns(0), 30, "the partition held")
                await owner.add_turn("ana", "s1", "user", "I adopted a cat called Miso",
                                     durable=True)
                await owner.add_turn("ana", "s1", "assistant", "Miso is a lovely name",
                                     durable=True)
                await owner.remember_fact("ana", "pets", "cat", "Miso",
                                          text="Has a cat called Miso")
                await log_applied(node, log)
                await a.flush()
                before = await log.last_seq()
                shown = await owner.retrieve_memory_raw("ana", "my cat", conversation_id="s2")
                assert shown.episodic and shown.semantic
                assert "Miso" in await owner.context_pre_retrieve("ana", "my cat")
                assert "Miso" in await owner.context_for_prompt("ana", "s4")
                looked = await owner.retrieve_memory_raw("ana", "cat", "s3", record=False)
                assert looked.episodic  # a look, not a use: nothing recorded or logged
                await log_grown(log, before)
                await log_applied(node, log)
                nursery.cancel_scope.cancel()
            first = await _recorded(a)
        assert [c for c, _ in first["pending"]] == ["s2"]  # not s3, looked at only
        assert first["pending"][0][1] == [i.id for i in shown.episodic]
        assert first["uses"] == [("pets", "cat", 3)]  # once per read, not twice on the owner
        async with open_engine(tmp_path / "b", config={"long_term": False}) as b:
            await _replay(b, log)
            assert await _recorded(b) == first
            assert b._partition_log.invalid == 0 and b._partition_log.split == 0
    finally:
        await log.close()


async def test_a_logged_record_applies_the_same_on_two_stores_and_refuses_bad_arguments(
        tmp_path: Path) -> None:
    """The entry a recording read logs, applied to two stores, writes the same pending
    review and fact use (read from the store when the facts are not cached), in one op with
    the watermark; memories gone by its place in the log are left out; bad arguments are the
    applier's InvalidInput, counted invalid."""
    [method] = [m for m in CALLS if m.startswith("record")]
    at = datetime(2026, 3, 1, 12, tzinfo=timezone.utc)
    turn = LogTurn("ana", "s1", "t_" + "0" * 19 + "1", "user", "my cat Miso", at)
    fact = LogCall("ana", "remember_fact", {"category": "pets", "key": "cat", "value": "Miso",
                                            "valid_at": at}, at=at)
    memories = []
    for path in (tmp_path / "a", tmp_path / "b"):
        async with open_engine(path, config={"long_term": False}) as engine:
            assert await engine.apply_log_batch(0, [(1, turn), (2, fact)]) == 2
            [known] = await engine.profile("ana")
            engine._parts.facts._cache.clear()  # a replica that has not read ana's facts yet
            args = {"conversation_id": "s2", "query": "cat", "fact_ids": [known.fact_id],
                    "memory_ids": [turn.turn_id, "t_gone"], "texts": ["my cat Miso", "gone"]}
            bad = [{**args, "texts": ["one"]}, {**args, "fact_ids": "f_1"},
                   {**args, "query": 3}, {**args, "surprise": 1}]
            entries = [(3, LogCall("ana", method, args, at=at))]
            entries += [(4 + i, LogCall("ana", method, b, at=at)) for i, b in enumerate(bad)]
            results: dict = {}
            assert await engine.apply_log_batch(0, entries, results) == 7
            assert results[3] is None
            assert all(isinstance(results[s], InvalidInput) for s in range(4, 8))
            assert "texts" in str(results[4]) and "fact_ids" in str(results[5])
            assert engine._partition_log.invalid == 4 and engine._partition_log.split == 0
            [pending] = await engine._parts.store.read(read_pending)
            assert pending[2].memory_ids == (turn.turn_id,) and pending[2].shown_at == at
            [used] = await engine.profile("ana")
            assert (used.access_count, used.last_access_at) == (known.access_count + 1, at)
            memories.append((pending, used))
    assert memories[0] == memories[1]


async def _replay(engine, log: Log) -> None:
    """Run a node of the one-partition log on ``engine`` until it has applied the whole log."""
    node = Node(engine, log, "b", "http://127.0.0.1:1")
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        await log_applied(node, log)
        nursery.cancel_scope.cancel()


async def _recorded(engine) -> dict:
    """What reads recorded in ``engine``'s store: pending reviews and the facts' uses."""
    await engine.flush()
    pending = await engine._parts.store.read(read_pending)
    return {
        "pending": [(c, list(p.memory_ids)) for u, c, p in pending if u == "ana"],
        "shown_at": [p.shown_at for _, _, p in pending],
        "uses": [(f.category, f.key, f.access_count) for f in await engine.profile("ana")],
        "last_use": [f.last_access_at for f in await engine.profile("ana")],
    }
