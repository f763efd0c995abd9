"""What the long-term followers derive from the log's turns (episodes, extracted facts) has
the same ids and times on every node that applies the log, so a logged call naming one (a
review, what a retrieval showed) applies on a replaying node as it did on the owner, however
much later it replays, and however far behind its followers are."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import trio.testing

from actors.episodic import EpisodicCompressor
from actors.store import read_facts, read_pending, read_review_states
from engine._logbatch import decode_entry
from engine.cluster._log import Log
from engine.cluster._node import FETCH_SECONDS, Node
from engine.cluster._writes import ClusterEngine

from ..conftest import T0, StepClock, open_engine
from .conftest import connect, log_applied, log_grown, wait_for

pytestmark = pytest.mark.timeout(120)

LATER = timedelta(days=365)  # how much later than the owner the replaying node's clock reads
# Twenty turns make one episode of the oldest ten (the default window); the user's turns
# state facts the rules extract, one of them superseding another.
TURNS = [("user", "I live in Lisbon, near the old market."),
         ("assistant", "Lisbon is lovely, the old market is a fine place to live."),
         ("user", "My sister Ana is visiting next week."),
         ("assistant", "How nice that your sister Ana is coming to Lisbon."),
         ("user", "I'm allergic to peanuts, so we cook at home."),
         ("assistant", "Cooking at home keeps the peanuts away, good plan."),
         ("user", "Big change: I moved to Porto last month."),
         ("assistant", "Porto! The river and the bridges must be a change from Lisbon."),
         ("user", "I love hiking in the hills around Porto."),
         ("assistant", "Hiking the hills around Porto sounds wonderful.")] * 2


async def test_a_replaying_store_holds_the_owners_episodes_and_facts_under_their_ids(
        nats_servers, cluster_config, tmp_path: Path) -> None:
    """An owner applies twenty turns (an episode, extracted facts, one superseded), a review
    of the episode and a retrieval's record of what it showed, all through the log; a store
    that applies the same log a year later by its clock holds the same episodes and facts
    under the same ids and times, the episode rated as on the owner (the same FSRS state),
    the same pending review. The replaying store has taken in the turns before it applies
    the calls, as the owner had when they were logged."""
    log, first, turns_end = await _owner(nats_servers, cluster_config, tmp_path / "a")
    try:
        async with open_engine(tmp_path / "b", clock=StepClock(T0 + LATER)) as b:
            await _apply_log(b, log, 1, turns_end)
            await b.flush()  # its followers took the turns in, as the owner's had
            await _apply_log(b, log, turns_end + 1, await log.last_seq())
            assert await _derived(b) == first
            assert b._partition_log.invalid == 0  # the review found its episode
    finally:
        await log.close()


async def test_a_call_waits_for_the_followers_to_derive_what_it_names(
        nats_servers, cluster_config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
        ) -> None:
    """A store that applies the owner's whole log in one batch, its episodes' follower held
    back until its applier has nothing else to do, applies the logged review of the episode
    as the owner did: the applier waits for the followers to derive the episode first."""
    log, first, turns_end = await _owner(nats_servers, cluster_config, tmp_path / "a")
    gate = trio.Event()  # set: the replaying store's episodes' follower may step again
    handle = EpisodicCompressor._handle

    async def held(self: EpisodicCompressor, records: list, last: int) -> Any:
        await gate.wait()
        return await handle(self, records, last)

    monkeypatch.setattr(EpisodicCompressor, "_handle", held)
    try:
        async with open_engine(tmp_path / "b", clock=StepClock(T0 + LATER)) as b:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_apply_log, b, log, 1, await log.last_seq())
                await wait_for(lambda: (b._partition_log.known_watermark(0) or 0) >= turns_end,
                               30, "the turns applied")
                await trio.testing.wait_all_tasks_blocked(0.1)
                gate.set()
            assert await _derived(b) == first
            assert b._partition_log.invalid == 0  # the review found its episode
    finally:
        await log.close()


async def _owner(nats_servers: Any, cluster_config: Any, path: Path
                 ) -> tuple[Log, dict[str, Any], int]:
    """Run an owner of a one-partition log on a store at ``path``: twenty turns, a review of
    their episode, a retrieval. Returns the log, what the owner derived and recorded, and
    the sequence of the last turn."""
    config = msgspec.structs.replace(cluster_config, partitions=1)
    log = await connect(nats_servers, config)
    async with open_engine(path, clock=StepClock()) as a:
        node = Node(a, log, "a", "http://127.0.0.1:1")
        owner = ClusterEngine(a, log, node)
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            await wait_for(lambda: node.owns(0), 30, "the partition held")
            for n, (role, text) in enumerate(TURNS):
                await owner.add_turn("ana", "s1", role, text, at=T0 + timedelta(minutes=n),
                                     durable=True)
            await log_applied(node, log)
            await a.flush()
            turns_end = await log.last_seq()
            [episode] = await a.episodes("ana")
            rated = await owner.review("ana", episode.episode_id, "easy")
            before = await log.last_seq()
            shown = await owner.retrieve_memory_raw("ana", "Porto hiking hills",
                                                    conversation_id="s2")
            assert shown.episodic
            await log_grown(log, before)
            await log_applied(node, log)
            nursery.cancel_scope.cancel()
        first = await _derived(a)
    assert first["reviews"] == {episode.episode_id: (
        rated.stability, rated.difficulty, rated.last_review, 1)}
    assert sorted((f[3], f[4]) for f in first["facts"] if f[2] == "location") == [
        ("Lisbon", "superseded"), ("Porto", "active")]
    return log, first, turns_end


async def _derived(engine: Any) -> dict[str, Any]:
    """What ``engine`` derived for ana and what the logged calls wrote about it, with the
    times each node gives them."""
    await engine.flush()
    store = engine._parts.store
    episodes = await engine.episodes("ana")
    ids = [e.episode_id for e in episodes]
    return {
        "episodes": [(e.episode_id, e.first_seq, e.last_seq, e.turn_ids, e.created_at,
                      e.stability, e.difficulty) for e in episodes],
        "facts": sorted((f.fact_id, f.category, f.key, f.value, f.status, f.created_at,
                         f.valid_at, f.expired_at, f.access_count, f.last_access_at)
                        for f in await store.read(read_facts, "ana", False)),
        "reviews": {i: (r.stability, r.difficulty, r.last_review, r.reps)
                    for i, r in (await store.read(read_review_states, "ana", ids)).items()},
        "pending": [(c, p.memory_ids, p.shown_at) for u, c, p in await store.read(read_pending)
                    if u == "ana"],
    }


async def _apply_log(engine: Any, log: Log, start: int, upto: int) -> None:
    """Apply the one-partition log's entries ``start``..``upto`` to ``engine``, as a node
    replaying it would."""
    sub = await log.subscribe(0, start, f"replay-{start}")
    entries: list[tuple[int, Any]] = []
    try:
        with trio.fail_after(30):
            while not entries or entries[-1][0] < upto:
                entries += [(d.stream_seq, decode_entry(d.data))
                            for d in await log.fetch(sub, 256, FETCH_SECONDS)
                            if d.stream_seq <= upto]
    finally:
        await log.drop(sub)
    await engine.apply_log_batch(0, entries)
