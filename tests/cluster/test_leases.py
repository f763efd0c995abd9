"""Leases on the real KV bucket: claim, renew, release, expire, re-acquire, adopt; fair share."""

from __future__ import annotations

import math

import msgspec
import nats.js.errors
import pytest
import trio

from engine.cluster._leases import LEASE_PREFIX, Leases, LeaseValue, plan
from engine.cluster._log import ClusterConfig

from .conftest import connect

pytestmark = pytest.mark.timeout(120)


def test_fair_share_as_nodes_come_and_go_one_three_two() -> None:
    """1 node takes all; with 3 none holds more than ceil(P/3) after hand-backs; with 2,
    the leaver's partitions are claimed up to ceil(P/2) each."""
    P = 16
    owners: dict[int, str] = {}
    claims, release = plan("a", P, owners, {"a"})
    assert claims == list(range(P)) and release is None
    owners = {p: "a" for p in claims}

    def settle(members: set[str]) -> None:
        for _ in range(100):  # ticks
            moved = False
            for node in sorted(members):
                claims, release = plan(node, P, owners, members)
                if release is not None:
                    del owners[release]
                    moved = True
                for p in claims:
                    owners[p] = node
                    moved = True
            if not moved:
                return
        raise AssertionError("no steady state")

    settle({"a", "b", "c"})
    counts = {n: sum(1 for o in owners.values() if o == n) for n in "abc"}
    assert max(counts.values()) == math.ceil(P / 3) and min(counts.values()) >= 1
    assert sorted(owners) == list(range(P))
    for p in [p for p, n in owners.items() if n == "c"]:  # c dies: its leases expire
        del owners[p]
    settle({"a", "b"})
    assert sorted(owners) == list(range(P))
    assert {n: sum(1 for o in owners.values() if o == n) for n in "ab"} == {"a": 8, "b": 8}


def test_a_node_above_its_share_hands_back_one_per_tick() -> None:
    """Hand-backs move one partition at a time (the highest), never with a claim."""
    owners = {p: "a" for p in range(8)}
    assert plan("a", 8, owners, {"a", "b"}) == ([], 7)
    assert plan("b", 8, owners, {"a", "b"}) == ([], None)


async def _leases(log, node: str, events: list[tuple[str, int]]) -> Leases:
    async def acquired(p: int) -> None:
        events.append(("acquired", p))

    async def lost(p: int) -> None:
        events.append(("lost", p))

    return Leases(log, node, f"{node}-1", f"http://127.0.0.1/{node}", acquired, lost)


async def test_claim_renew_release_on_the_real_bucket(nats_servers, cluster_config) -> None:
    """A lone node claims every partition, renews on its revision, releases by deleting."""
    log = await connect(nats_servers, cluster_config)
    try:
        events: list[tuple[str, int]] = []
        a = await _leases(log, "a", events)
        await a.tick()
        assert sorted(a.held) == list(range(cluster_config.partitions))
        assert a.counts["claimed"] == cluster_config.partitions
        revisions = dict(a.held)
        await a.tick()
        assert all(a.held[p] > revisions[p] for p in revisions)  # renewed = new revision
        assert all(a.serving(p) for p in a.held)
        await a.release(3)
        assert 3 not in a.held and ("lost", 3) in events
        with pytest.raises(nats.js.errors.KeyNotFoundError):
            await log.kv("get", LEASE_PREFIX + "3")
    finally:
        await log.close()


async def test_a_lease_held_elsewhere_is_lost_and_an_expired_one_reacquired(
        nats_servers, cluster_config) -> None:
    """Renewal on a revision someone else moved is a loss; a lease that expired unrenewed
    (as during a log election) and that nobody took is taken again, not dropped."""
    config = msgspec.structs.replace(cluster_config, lease_ttl=1.0, partitions=2)
    log = await connect(nats_servers, config)
    try:
        events: list[tuple[str, int]] = []
        a = await _leases(log, "a", events)
        await a.tick()
        assert sorted(a.held) == [0, 1]
        # Partition 0 is taken by b behind a's back (its lease expired and b created it).
        await log.kv("purge", LEASE_PREFIX + "0")
        await log.kv("create", LEASE_PREFIX + "0",
                     msgspec.json.encode(LeaseValue("b", "b-1")))
        # Partition 1 expires unrenewed while nobody else wants it.
        await trio.sleep(1.6)
        await log.kv("put", LEASE_PREFIX + "0", msgspec.json.encode(LeaseValue("b", "b-1")))
        await a._renew_all()
        assert 0 not in a.held and ("lost", 0) in events
        assert 1 in a.held and a.counts["reacquired"] == 1
    finally:
        await log.close()


async def test_a_restarted_node_adopts_the_leases_of_its_earlier_incarnation(
        nats_servers, cluster_config) -> None:
    """Same node id, new incarnation, within the TTL: every lease is adopted, none claimed."""
    log = await connect(nats_servers, cluster_config)
    try:
        first = await _leases(log, "a", [])
        await first.tick()
        events: list[tuple[str, int]] = []
        second = Leases(log, "a", "a-2", "http://127.0.0.1/a", _noted(events, "acquired"),
                        _noted(events, "lost"))
        await second.tick()
        assert sorted(second.held) == list(range(cluster_config.partitions))
        assert second.counts["adopted"] == cluster_config.partitions
        assert second.counts["claimed"] == 0
        value = msgspec.json.decode((await log.kv("get", LEASE_PREFIX + "0")).value,
                                    type=LeaseValue)
        assert value == LeaseValue("a", "a-2")
    finally:
        await log.close()


def _noted(events: list[tuple[str, int]], what: str):
    async def note(p: int) -> None:
        events.append((what, p))

    return note


async def test_two_nodes_split_the_partitions_between_them(nats_servers, cluster_config
                                                           ) -> None:
    """Ticks of two nodes converge to ceil(P/2) each with every partition held once."""
    log = await connect(nats_servers, cluster_config)
    try:
        a, b = await _leases(log, "a", []), await _leases(log, "b", [])
        await a.tick()
        for _ in range(3 * cluster_config.partitions):
            await b.tick()
            await a.tick()
            if len(a.held) == len(b.held):
                break
        assert len(a.held) == len(b.held) == cluster_config.partitions // 2
        assert not set(a.held) & set(b.held)
    finally:
        await log.close()


def test_cluster_config_refuses_a_retry_longer_than_the_duplicate_window() -> None:
    """A publish retried past the window would be stored twice: refused up front."""
    from engine import InvalidInput

    with pytest.raises(InvalidInput, match="duplicate_window"):
        ClusterConfig.checked({"publish_retry_seconds": 300, "duplicate_window": 120})
