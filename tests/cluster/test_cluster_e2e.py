"""A cluster end to end with real processes: three nats-servers, three node processes.

Writes on any node go to the log; the owner applies them; reads with ``?min_seq=`` on any node
find them. A kill -9 of a node loses no acknowledged turn (its partitions move and the new
owner replays them from the log), and a node restarted within the lease TTL keeps its
partitions and resumes from its watermark.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from typing import Any

import httpx
import msgspec
import pytest
import trio

from engine.cluster._partition import partition_of, subject_of

from .conftest import NodeProcess, all_held, retrying, start_all, wait_for

pytestmark = pytest.mark.timeout(300)


async def write(client: httpx.AsyncClient, node: NodeProcess, user: str, text: str
                ) -> dict[str, Any]:
    answer = await retrying(client, "POST", f"{node.url}/v1/users/{user}/sessions/s1/turns",
                            json={"role": "user", "text": text, "durable": True})
    assert answer.status_code == 201, answer.text
    return answer.json()


async def history(client: httpx.AsyncClient, node: NodeProcess, user: str, min_seq: int
                  ) -> list[dict[str, Any]]:
    """The user's session through ``node``, read-your-writes; retried on 503 as a client
    is told to (Retry-After)."""
    answer = await retrying(client, "GET", f"{node.url}/v1/users/{user}/sessions/s1/turns",
                            params={"limit": 1000, "min_seq": min_seq})
    assert answer.status_code == 200, f"{user}: no answer through {node.node_id}: {answer.text}"
    return answer.json()


async def test_write_anywhere_read_your_writes_anywhere_and_kill_9_loses_nothing(
        nodes: list[NodeProcess], cluster_config: Any) -> None:
    """The vertical slice: writes and min_seq reads through every node, then a node's kill -9
    and another's restart within the TTL, with every acknowledged turn found exactly once."""
    seed = random.randrange(1 << 30)
    print("seed", seed)
    rng = random.Random(seed)
    await trio.to_thread.run_sync(start_all, nodes)
    await wait_for(lambda: all_held(nodes, cluster_config.partitions), 60,
                   "every partition held")
    users = [f"user-{i}" for i in range(12)]
    acked: dict[str, list[str]] = {u: [] for u in users}
    async with httpx.AsyncClient(timeout=30) as client:
        # Write through a random node, read back through another with min_seq.
        for i in range(60):
            user = rng.choice(users)
            receipt = await write(client, rng.choice(nodes), user, f"turn {i} of {user}")
            acked[user].append(receipt["turn_id"])
            turns = await history(client, rng.choice(nodes), user, receipt["log_seq"])
            assert [t["turn_id"] for t in turns] == acked[user]
            assert [t["seq"] for t in turns] == list(range(len(acked[user])))

        # A note through any node: the owner logs it, applies it and answers with it.
        answer = await retrying(client, "POST", f"{rng.choice(nodes).url}/v1/users/user-1/notes",
                                json={"text": "likes kestrels", "tags": ["birds"]})
        assert answer.status_code == 201, answer.text
        note = answer.json()
        got = await retrying(client, "GET", f"{rng.choice(nodes).url}/v1/users/user-1/notes/"
                                            f"{note['note_id']}")
        assert got.status_code == 200 and got.json()["text"] == "likes kestrels"

        # Agent tools through any node: run on the owner of their user, writes logged.
        answer = await retrying(client, "POST", f"{rng.choice(nodes).url}/v1/tools/remember_fact",
                                json={"user_id": "user-2", "category": "home", "key": "city",
                                      "value": "Lisbon"})
        assert answer.status_code == 200, answer.text
        assert answer.json()["fact"]["value"] == "Lisbon"
        answer = await retrying(client, "POST", f"{rng.choice(nodes).url}/v1/tools/search_memory",
                                json={"user_id": "user-1", "query": "kestrels"})
        assert answer.status_code == 200, answer.text
        assert note["note_id"] in [h["id"] for h in answer.json()["results"]]

        # kill -9 one node: its partitions move; every acknowledged turn is still there.
        victim, others = nodes[0], nodes[1:]
        await trio.to_thread.run_sync(victim.kill)
        await wait_for(lambda: all_held(others, cluster_config.partitions),
                       cluster_config.lease_ttl * 4 + 30, "the victim's partitions claimed")
        last: dict[str, int] = {}  # a user's last write's log_seq: their reads' min_seq
        for i in range(30):
            user = rng.choice(users)
            receipt = await write(client, rng.choice(others), user, f"after kill {i}")
            acked[user].append(receipt["turn_id"])
            last[user] = receipt["log_seq"]
        for user in users:
            turns = await history(client, rng.choice(others), user, last.get(user, 0))
            ids = [t["turn_id"] for t in turns]
            assert ids == acked[user], user
            assert len(set(ids)) == len(ids)
        got = await retrying(client, "GET", f"{rng.choice(others).url}/v1/users/user-1/notes/"
                                            f"{note['note_id']}")
        assert got.status_code == 200 and got.json()["tags"] == ["birds"]  # replayed
        got = await retrying(client, "GET", f"{rng.choice(others).url}/v1/users/user-2/facts")
        assert [f["value"] for f in got.json()] == ["Lisbon"]  # the tool's write, replayed

        # Restart the node under the same id: it rejoins and catches up from its watermark.
        await victim.restart()

        async def rejoined() -> bool:
            return await all_held(nodes, cluster_config.partitions) and bool(
                await victim.held())

        await wait_for(rejoined, cluster_config.lease_ttl * 20 + 30,
                       "the restarted node holding again")
        for user in users:
            turns = await history(client, victim, user, last.get(user, 0))
            assert [t["turn_id"] for t in turns] == acked[user], user


async def test_a_restart_within_the_ttl_keeps_the_partitions_and_resumes(
        nodes: list[NodeProcess], cluster_config: Any, tmp_path: Any) -> None:
    """kill -9 and restart at once under the same id: the node adopts its own leases (no
    partition moves) and goes on from its watermark (nothing applied twice). The node's
    ``/v1/snapshot`` writes its store as it was applied."""
    # A TTL longer than a node process takes to start on a loaded machine.
    node = nodes[0]
    node.config = cluster_config = msgspec.structs.replace(cluster_config, lease_ttl=30.0)
    await node.restart()
    await wait_for(lambda: all_held([node], cluster_config.partitions), 60, "all partitions")
    async with httpx.AsyncClient(timeout=30) as client:
        acked = [await write(client, node, "ana", f"before {i}") for i in range(10)]
        await history(client, node, "ana", acked[-1]["log_seq"])  # applied
        taken = await client.post(f"{node.url}/v1/snapshot", json={"dest": str(tmp_path / "s")})
        assert taken.status_code == 200, taken.text
        assert taken.json()["counts"]["turns"] == 10
        before = await node.read_figures()
        await trio.to_thread.run_sync(node.kill)
        await node.restart()
        await wait_for(lambda: all_held([node], cluster_config.partitions), 60,
                       "its partitions back")
        after = await node.read_figures()
        assert after["leases"]["adopted"] == cluster_config.partitions
        assert after["leases"]["claimed"] == 0
        p = partition_of("ana", cluster_config.partitions)
        acked.append(await write(client, node, "ana", "after"))
        turns = await history(client, node, "ana", acked[-1]["log_seq"])
        assert [t["turn_id"] for t in turns] == [a["turn_id"] for a in acked]
        assert (await node.read_figures())["watermarks"][str(p)] >= before["watermarks"][str(p)]

        # Forgetting a session: a tombstone, and the session's entries deleted from the
        # stream (the user's others stay); a read with its log_seq finds the session gone.
        subject = subject_of("ana", cluster_config.partitions)
        for i in range(2):
            answer = await retrying(client, "POST", f"{node.url}/v1/users/ana/sessions/s2/turns",
                                    json={"role": "user", "text": f"in s2 {i}", "durable": True})
            assert answer.status_code == 201, answer.text
        assert await trio.to_thread.run_sync(entries_of, node.urls, cluster_config.stream,
                                             subject) == len(acked) + 2
        gone = await retrying(client, "DELETE", f"{node.url}/v1/users/ana/sessions/s2")
        assert gone.status_code == 200 and gone.json()["forgotten"] == "s2", gone.text
        left = await retrying(client, "GET", f"{node.url}/v1/users/ana/sessions/s2/turns",
                              params={"min_seq": gone.json()["log_seq"]})
        assert left.json() == []
        assert len(await history(client, node, "ana", gone.json()["log_seq"])) == len(acked)
        assert await trio.to_thread.run_sync(entries_of, node.urls, cluster_config.stream,
                                             subject) == len(acked) + 1  # and the tombstone

        # Forgetting the user: a tombstone in the log, whose log_seq a read can wait for;
        # the user's earlier entries are purged from the stream, the tombstone stays.
        gone = await retrying(client, "DELETE", f"{node.url}/v1/users/ana")
        assert gone.status_code == 200 and gone.json()["forgotten"] == "ana", gone.text
        assert await history(client, node, "ana", gone.json()["log_seq"]) == []
        assert await trio.to_thread.run_sync(entries_of, node.urls, cluster_config.stream,
                                             subject) == 1


async def test_a_thin_client_writes_to_the_log_and_reads_from_the_owner(
        nodes: list[NodeProcess], cluster_config: Any) -> None:
    """ClusterClient: turns published by the client itself (no node on the way), read back
    from the owner with read-your-writes, by session, recall and retrieve_memory; a refused
    argument comes back as the engine's error, checked here or by the owner; a forget goes
    through the log."""
    from engine import InvalidInput
    from engine.cluster import ClusterClient

    node = nodes[0]
    await node.restart()
    await wait_for(lambda: all_held([node], cluster_config.partitions), 60, "all partitions")
    async with ClusterClient.connect(node.urls, cluster_config) as fleet:
        assert await fleet.owner("maya") == node.url
        first = await fleet.add_turn("maya", "s1", "user", "I moved to Lisbon", durable=True)
        batch = await fleet.add_turns([
            {"user_id": "maya", "session_id": "s1", "role": "assistant",
             "text": "Lisbon is lovely in spring"},
            {"user_id": "maya", "session_id": "s1", "role": "user",
             "text": "my kestrel Pip moved with me"}], durable=True)
        assert first.log_seq < batch[0].log_seq < batch[1].log_seq
        turns = await fleet.session_history("maya", "s1", min_seq=batch[-1].log_seq)
        assert [t["turn_id"] for t in turns] == [first.turn_id, *(r.turn_id for r in batch)]
        hits = await fleet.recall("maya", "kestrel", limit=3, kinds=["turn"],
                                  min_seq=batch[-1].log_seq)
        assert hits[0]["id"] == batch[1].turn_id
        assert "Lisbon" in await fleet.retrieve_memory("maya", "moved to Lisbon",
                                                       min_seq=batch[-1].log_seq)
        with pytest.raises(InvalidInput, match="role"):
            await fleet.add_turn("maya", "s1", "bot", "hi")
        with pytest.raises(InvalidInput, match="kinds"):
            await fleet.recall("maya", "kestrel", kinds=["nonsense"])
        assert await fleet.session_history("nobody-here", "s1") == []
        gone = await fleet.forget_user("maya")
        assert await fleet.session_history("maya", "s1", min_seq=gone) == []


def entries_of(urls: list[str], stream: str, subject: str) -> int:
    """The entries the stream holds under ``subject`` (a user's), asked of the servers."""
    import asyncio

    import nats

    async def count() -> int:
        nc = await nats.connect(servers=urls, connect_timeout=5)
        try:
            info = await nc.jetstream().stream_info(stream, subjects_filter=subject)
            return (info.state.subjects or {}).get(subject, 0)
        finally:
            await nc.close()

    return asyncio.run(count())


def test_cluster_status_lists_owner_watermark_and_lag(nodes: list[NodeProcess],
                                                      cluster_config: Any) -> None:
    """`engram-trio cluster status` shows every partition's owner, watermark, lag, lease age."""
    node = nodes[0].start()
    deadline_ok = False
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not deadline_ok:
        deadline_ok = len(node.figures()["leases"]["held"]) == cluster_config.partitions
        time.sleep(0.2)
    receipt = httpx.post(f"{node.url}/v1/users/bo/sessions/s/turns",
                         json={"role": "user", "text": "hi", "durable": True}, timeout=30).json()
    p = partition_of("bo", cluster_config.partitions)
    # The node's figures, per partition, on /cluster/node and in /metrics beside the app's.
    def applied() -> dict[int, dict]:
        return {s["partition"]: s for s in node.figures()["partitions"]}

    deadline = time.monotonic() + 60
    while (applied()[p]["watermark"] or 0) < receipt["log_seq"] or not applied()[p]["replays"]:
        assert time.monotonic() < deadline, applied()[p]
        time.sleep(0.1)
    parts = applied()
    assert sorted(parts) == list(range(cluster_config.partitions))
    assert parts[p]["owned"] and parts[p]["watermark"] == receipt["log_seq"]
    assert parts[p]["lag"] == 0 and parts[p]["replays"] == 1 and parts[p]["gaps"] == 0
    metrics = httpx.get(f"{node.url}/metrics", timeout=30).text
    assert "engram_http_requests_total" in metrics  # the app's own families stay
    assert f'engram_cluster_partition_watermark{{partition="{p}"}} {receipt["log_seq"]}.0' in metrics
    assert f'engram_cluster_partition_owned{{partition="{p}"}} 1.0' in metrics
    assert f"engram_cluster_owned_partitions {cluster_config.partitions}.0" in metrics
    assert 'engram_cluster_leases_total{event="claimed"} ' in metrics
    out = subprocess.run(
        [sys.executable, "-m", "engine", "cluster", "status", "--json", "--nats",
         ",".join(node.urls), "--cluster-config",
         json.dumps(msgspec.structs.asdict(cluster_config))],
        capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert status["nodes"] == {"node0": node.url}
    assert [p["owner"] for p in status["partitions"]] == ["node0"] * cluster_config.partitions
    assert all(p["lag"] is not None and p["lease_age_seconds"] is not None
               for p in status["partitions"])
    # The node's /v1/stats (Engine.stats of its store) carries the node's figures too.
    stats = httpx.get(f"{node.url}/v1/stats", timeout=30).json()
    assert stats["turns"] >= 1 and stats["cluster"]["node"] == "node0"
    assert sorted(s["partition"] for s in stats["cluster"]["partitions"]
                  if s["owned"]) == list(range(cluster_config.partitions))
    # Without --json, a table for people: a row per partition with its owner.
    out = subprocess.run(
        [sys.executable, "-m", "engine", "cluster", "status", "--nats", ",".join(node.urls),
         "--cluster-config", json.dumps(msgspec.structs.asdict(cluster_config))],
        capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if "node0" in line and "│" in line]
    assert len(rows) == cluster_config.partitions and "lease age" in out.stdout
    assert not out.stdout.lstrip().startswith("{")
    # `cluster init` (the stream and bucket exist: it says what they are), without --json:
    # it made them, then died of a KeyError taking its answer for a status table (exit 1).
    out = subprocess.run(
        [sys.executable, "-m", "engine", "cluster", "init", "--nats", ",".join(node.urls),
         "--cluster-config", json.dumps(msgspec.structs.asdict(cluster_config))],
        capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert cluster_config.stream in out.stdout


def test_a_second_node_process_on_the_same_store_is_refused(nodes: list[NodeProcess],
                                                           tmp_path: Any) -> None:
    """One owner per store holds for nodes too: the second exits 1 naming the first's pid."""
    first = nodes[0].start()
    second = NodeProcess(first.store, first.urls, "intruder", first.config, tmp_path)
    with pytest.raises(AssertionError, match="exited with 1"):
        second.start()
    assert f"in use by process {first.proc.pid}" in second.log_path.read_text()
    assert first.figures()["node"] == "node0"  # the first serves on, untouched
